"""The tests' container backend (`MEMFILTER_TEST_BACKEND=containers`): Kafka, Redis and the
workers as containers of the images `deploy/images.sh` builds, through testcontainers.

One network per test session, made here and removed at the end, with no masquerading: the
containers reach each other and the host, nothing beyond; the ports they publish bind to
127.0.0.1. Kafka advertises two listeners, `kafka:19092` to the containers and
`127.0.0.1:<port>` to the tests. A worker container answers as a `subprocess.Popen` does
(`poll`, `wait`, `terminate`, `kill`, `send_signal`), so `Pipeline` starts and kills workers the
same way on either backend.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")  # its reaper image cannot be pulled here; `stop` removes what this starts

import docker  # noqa: E402
import redis  # noqa: E402
import requests  # noqa: E402
import yaml  # noqa: E402
from pipeline import REPO  # noqa: E402
from testcontainers.core.container import DockerContainer  # noqa: E402
from testcontainers.core.network import Network  # noqa: E402

from memfilter.stack import broker_answers  # noqa: E402

NETWORK_OPTIONS = {
    "com.docker.network.bridge.enable_ip_masquerade": "false",  # no route beyond the host
    "com.docker.network.bridge.host_binding_ipv4": "127.0.0.1",  # published ports on loopback only
}
WEB_PORT = 6066  # the workers' web server inside their containers (the Dockerfile's)


def published(container: DockerContainer, port: int) -> int:
    return int(container.get_exposed_port(port))


class WorkerContainer:
    """A `memfilter worker` (or `agent`) container, handled like a process: signals, exit
    code; its output is written to `log_path` when it has exited (or a test fails: see
    `save_logs`), and then it is removed."""

    def __init__(self, container: DockerContainer, log_path: Path):
        self.container = container
        self.log_path = log_path
        self.returncode: int | None = None
        self.web_port = published(container, WEB_PORT)
        RUNNING.add(self)

    def save_log(self) -> None:
        self.log_path.write_bytes(self.container.get_wrapped_container().logs())

    def poll(self) -> int | None:
        if self.returncode is None:
            state = self.container.get_wrapped_container()
            state.reload()
            if state.status in ("exited", "dead"):
                self._finished(state.attrs["State"]["ExitCode"])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                done = self.container.get_wrapped_container().wait(timeout=timeout)
            except requests.exceptions.RequestException as e:  # the engine's answer timed out
                raise subprocess.TimeoutExpired(f"container {self.container.get_container_id()[:12]}", timeout) from e
            self._finished(done["StatusCode"])
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """As Popen's: nothing once it has exited (also when it exits just before the signal)."""
        if self.poll() is None:
            try:
                self.container.get_wrapped_container().kill(signal=signal.Signals(sig).name)
            except docker.errors.APIError:
                if self.poll() is None:
                    raise

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _finished(self, code: int) -> None:
        self.save_log()
        self.container.stop()
        self.returncode = code
        RUNNING.discard(self)


RUNNING: set[WorkerContainer] = set()


def save_logs() -> None:
    """Every running worker container's output so far, to its log file (for a failed test's
    report, made while they still run)."""
    for worker in RUNNING:
        worker.save_log()


class ContainerStack:
    """Kafka and Redis containers on a network of their own; workers started on it."""

    def __init__(self, kafka_port: int):
        self.network = Network(docker_network_kw={"options": NETWORK_OPTIONS})
        self.kafka_port = kafka_port
        self.kafka = (
            DockerContainer("memfilter/kafka")
            .with_network(self.network)
            .with_network_aliases("kafka")
            .with_bind_ports(9092, kafka_port)  # advertised as 127.0.0.1:kafka_port: the same port on both sides
            .with_envs(**kafka_settings(kafka_port))
        )
        self.redis = DockerContainer("memfilter/redis").with_network(self.network).with_network_aliases("redis").with_exposed_ports(6379)
        self.bootstrap = f"127.0.0.1:{kafka_port}"
        self.redis_url = ""

    def start(self, timeout: float = 120) -> ContainerStack:
        self.network.create()
        try:
            self.redis.start()
            self.kafka.start()
            self.redis_url = f"redis://127.0.0.1:{published(self.redis, 6379)}/0"
            deadline = time.monotonic() + timeout
            while not _redis_answers(self.redis_url) and time.monotonic() < deadline:
                time.sleep(0.2)
            while not asyncio.run(broker_answers(self.bootstrap, 5)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Kafka container did not answer on {self.bootstrap} within {timeout} s: {self.kafka.get_logs()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def worker(self, argv: list[str], env: dict[str, str], log_path: Path) -> WorkerContainer:
        """A container of the worker image running `memfilter ARGV` (`worker ...`, `agent ...`)
        with its web server on WEB_PORT, and `env` pointed at the containers' Kafka and Redis."""
        container = (
            DockerContainer("memfilter/worker")
            .with_network(self.network)
            .with_command(["memfilter", *argv, "--web-port", str(WEB_PORT)])
            .with_envs(**{**env, "KAFKA_BOOTSTRAP_SERVERS": "kafka:19092", "REDIS_URL": "redis://redis:6379/0"})
            .with_exposed_ports(WEB_PORT)
        )
        return WorkerContainer(container.start(), log_path)

    def stop(self) -> None:
        for container in (self.kafka, self.redis):
            container.stop()
        self.network.remove()


def kafka_settings(port: int) -> dict[str, str]:
    """The broker's settings: docker-compose.yml's (KAFKA_* variables), with the tests' port
    as the host's side of its loopback listener."""
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    return {k: str(v).replace("${MEMFILTER_KAFKA_PORT:-9092}", str(port)) for k, v in compose["services"]["kafka"]["environment"].items()}


def _redis_answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=1) as client:
            return client.ping()
    except redis.RedisError:
        return False

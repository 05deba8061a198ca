"""The tests' container backend (`MEMFILTER_TEST_BACKEND=containers`): Kafka, Redis, PostgreSQL
and the product's processes (workers, the sink, the agent runner, the gateway) as containers of
the images `deploy/images.sh` builds, through testcontainers; a command (`memfilter history`,
...) as a container of its own that exits (`run`).

One network per test session, made here and removed at the end, with no masquerading: the
containers reach each other and the host, nothing beyond; the ports they publish bind to
127.0.0.1. Kafka advertises two listeners, `kafka:19092` to the containers and
`127.0.0.1:<port>` to the tests; Redis and PostgreSQL are `redis` and `postgres` to the
containers (`inside` turns the tests' addresses into these). A worker container answers as a `subprocess.Popen` does
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
IMAGE = "memfilter/memfilter"


def published(container: DockerContainer, port: int) -> int:
    return int(container.get_exposed_port(port))


class WorkerContainer:
    """A `memfilter worker` (or `agent`) container, handled like a process: signals, exit
    code; its output is written to `log_path` when it has exited (or a test fails: see
    `save_logs`), and then it is removed."""

    def __init__(self, container: DockerContainer, log_path: Path, port: int = WEB_PORT):
        self.container = container
        self.log_path = log_path
        self.returncode: int | None = None
        self.web_port = published(container, port)
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
    """Kafka, Redis and PostgreSQL containers on a network of their own; the product's processes started on it."""

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
        self.postgres = DockerContainer("memfilter/postgres").with_network(self.network).with_network_aliases("postgres").with_exposed_ports(5432)
        self.bootstrap = f"127.0.0.1:{kafka_port}"
        self.redis_url = ""
        self.postgres_url = ""

    def start(self, timeout: float = 120) -> ContainerStack:
        self.network.create()
        try:
            for container in (self.redis, self.postgres, self.kafka):
                container.start()
            self.redis_url = f"redis://127.0.0.1:{published(self.redis, 6379)}/0"
            self.postgres_url = f"postgresql://memfilter@127.0.0.1:{published(self.postgres, 5432)}/postgres"
            deadline = time.monotonic() + timeout
            while not _redis_answers(self.redis_url) and time.monotonic() < deadline:
                time.sleep(0.2)
            while self.postgres.get_wrapped_container().exec_run(["sh", "-c", "/usr/lib/postgresql/*/bin/pg_isready -q -h 127.0.0.1"]).exit_code:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the PostgreSQL container did not answer within {timeout} s")
                time.sleep(0.2)
            while not asyncio.run(broker_answers(self.bootstrap, 5)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the Kafka container did not answer on {self.bootstrap} within {timeout} s: {self.kafka.get_logs()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def host_address(self) -> str:
        """The host's address on the containers' network: where a test's own server (a fake
        endpoint) listens for both the containers and the host's processes."""
        network = docker.from_env().networks.get(self.network.name)
        return network.attrs["IPAM"]["Config"][0]["Gateway"]

    def inside(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with the services' addresses as the containers reach them."""
        out = {**env, "KAFKA_BOOTSTRAP_SERVERS": "kafka:19092", "REDIS_URL": "redis://redis:6379/0"}
        if "POSTGRES_URL" in env:
            out["POSTGRES_URL"] = "postgresql://memfilter@postgres:5432/postgres"
        return out

    def worker(self, argv: list[str], env: dict[str, str], log_path: Path, port: int = WEB_PORT, web_port_flag: bool = True) -> WorkerContainer:
        """A container of the product's image running `memfilter ARGV` (`worker ...`, `agent
        ...`, `sink ...`, `gateway ...`) with its web server on `port` (given as `--web-port`
        unless `web_port_flag` is false: the settings in `env` name it), published on loopback,
        and `env` pointed at the containers' Kafka, Redis and PostgreSQL."""
        container = (
            DockerContainer(IMAGE)
            .with_network(self.network)
            .with_command(["memfilter", *argv, *(["--web-port", str(port)] if web_port_flag else [])])
            .with_envs(**self.inside(env))
            .with_exposed_ports(port)
        )
        return WorkerContainer(container.start(), log_path, port)

    def run(self, argv: list[str], env: dict[str, str], input: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """`memfilter ARGV` in a container of the product's image that exits, `input` on its stdin: as `subprocess.run` answers (text)."""
        flags = [f"--env={k}={v}" for k, v in self.inside(env).items()]
        command = ["docker", "run", "--rm", "-i", f"--network={self.network.name}", *flags, IMAGE, "memfilter", *argv]
        done = subprocess.run(command, input=input or b"", capture_output=True, timeout=timeout)
        return subprocess.CompletedProcess(argv, done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

    def stop(self) -> None:
        for container in (self.kafka, self.redis, self.postgres):
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

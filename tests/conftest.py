"""Shared fixtures: the real Kafka broker and Redis server the processor's tests run against.

If `KAFKA_BOOTSTRAP_SERVERS` and `REDIS_URL` are both set, the tests use those services.
Otherwise the session starts the project's own stack (`memfilter stack up`) in
`.stack/tests/` on ports of its own (19092, 19093, 16379, overridable with the usual
`MEMFILTER_*_PORT` settings), so a developer's `.stack/` on the default ports is left alone,
and stops it at the end if it started it.

`MEMFILTER_TEST_BACKEND=containers` runs the tests marked `containers` on containers instead
(`tests/containers.py`: Kafka, Redis and the workers from the images `deploy/images.sh`
builds, through testcontainers, on a network made for the session); the others are deselected.
The default, `processes`, runs every test on the process stack above.

Tests of the replicated stack (`cluster_services`) start `memfilter stack up --brokers 3
--redis-cluster` in `.stack/cluster-tests/`: brokers on 29092, 29094, 29096 (controllers one
above each), Redis Cluster nodes on 17001-17006.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from containers import ContainerStack

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("processes", "containers")
BACKEND = os.environ.get("MEMFILTER_TEST_BACKEND", "processes")
if BACKEND not in BACKENDS:
    raise pytest.UsageError(f"MEMFILTER_TEST_BACKEND={BACKEND!r} is not a test backend; use one of {', '.join(BACKENDS)}")


def pytest_configure(config):
    config.addinivalue_line("markers", "containers: runs on the container backend too (MEMFILTER_TEST_BACKEND=containers)")


def pytest_collection_modifyitems(config, items):
    """On the container backend, only the tests marked `containers`."""
    if BACKEND == "containers":
        others = [item for item in items if item.get_closest_marker("containers") is None]
        if others:
            config.hook.pytest_deselected(items=others)
            items[:] = [item for item in items if item.get_closest_marker("containers") is not None]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report ends with the last lines of every worker log written while it
    ran: the workers are processes (or containers) of their own, and on CI their logs are not kept."""
    from pipeline import WORKER_LOGS

    report = (yield).get_result()
    if report.failed:
        if BACKEND == "containers":
            from containers import save_logs

            save_logs()
        for log in sorted(WORKER_LOGS.glob("memfilter-test-*-worker*.log")):
            if log.stat().st_mtime >= call.start:
                tail = log.read_text(errors="replace").splitlines()[-20:]
                report.sections.append((f"worker log {log}", "\n".join(line[:300] for line in tail)))


@dataclass(frozen=True)
class Services:
    bootstrap: str
    redis_url: str
    stack_dir: Path | None  # None when the services were given, not started here
    settings: dict[str, str] = field(default_factory=dict)  # what else the stack exports for workers (MEMFILTER_REDIS_REPLICAS)
    containers: ContainerStack | None = None  # on the container backend: its workers are containers

    def pipeline(self):
        """A `Pipeline` on these services (see `pipeline`)."""
        from pipeline import Pipeline

        return Pipeline(self.bootstrap, self.redis_url, settings=self.settings, containers=self.containers)


def stack_env(**overrides: str) -> dict[str, str]:
    """The environment of a `memfilter stack` call for the test stack."""
    env = dict(os.environ)
    env.setdefault("MEMFILTER_STACK_DIR", str(REPO / ".stack" / "tests"))
    env.setdefault("MEMFILTER_KAFKA_PORT", "19092")
    env.setdefault("MEMFILTER_CONTROLLER_PORT", "19093")
    env.setdefault("MEMFILTER_REDIS_PORT", "16379")
    env.update(overrides)
    return env


def memfilter(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfilter", *argv], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


@pytest.fixture
def pipeline(services):
    """Topics, a consumer group and a Redis prefix of the test's own; its workers stopped after."""
    p = services.pipeline()
    asyncio.run(p.create_topics())
    yield p
    p.stop_all()


@pytest.fixture(scope="session")
def services():
    if BACKEND == "containers":
        from containers import ContainerStack
        from pipeline import free_port

        stack = ContainerStack(free_port()).start()
        yield Services(stack.bootstrap, stack.redis_url, None, containers=stack)
        stack.stop()
        return
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("REDIS_URL")
    if all(given):
        yield Services(given[0], given[1], None)
        return
    env = stack_env()
    was_running = "running" in memfilter("stack", "status", env=env).stdout.split("\n")[0]
    up = memfilter("stack", "up", env=env)
    assert up.returncode == 0, f"memfilter stack up failed: {up.stderr}"
    exports = dict(line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines())
    yield Services(exports["KAFKA_BOOTSTRAP_SERVERS"], exports["REDIS_URL"], Path(env["MEMFILTER_STACK_DIR"]))
    if not was_running:
        memfilter("stack", "down", env=env)


CLUSTER_PORTS = {"MEMFILTER_KAFKA_PORT": "29092", "MEMFILTER_CONTROLLER_PORT": "29093", "MEMFILTER_REDIS_PORT": "17001"}


def cluster_env() -> dict[str, str]:
    """The environment of a `memfilter stack` call for the replicated test stack."""
    return {**stack_env(), "MEMFILTER_STACK_DIR": str(REPO / ".stack" / "cluster-tests"), **CLUSTER_PORTS}


@pytest.fixture(scope="session")
def cluster_services():
    """Three Kafka brokers (replication factor 3, min ISR 2) and a Redis Cluster of three
    masters with a replica each, on loopback; stopped at the end if started here."""
    env = cluster_env()
    was_running = "running" in memfilter("stack", "status", env=env).stdout.split("\n")[0]
    up = memfilter("stack", "up", "--brokers", "3", "--redis-cluster", env=env)
    assert up.returncode == 0, f"memfilter stack up --brokers 3 --redis-cluster failed: {up.stderr}"
    exports = dict(line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines())
    given = ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "MEMFILTER_SECRET")
    yield Services(
        exports["KAFKA_BOOTSTRAP_SERVERS"], exports["REDIS_URL"], Path(env["MEMFILTER_STACK_DIR"]), {k: v for k, v in exports.items() if k not in given}
    )
    if not was_running:
        memfilter("stack", "down", env=env)

"""The services the tests run against, and how to start them: shared by the fixtures
(`conftest.py`) and the tests that start or stop a stack themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
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


def start_redis(conf: Path, url: str) -> subprocess.Popen:
    """A redis-server of a test's own on `conf` (`pipeline.redis_config`), once it answers at `url`."""
    from memfilter.stack import redis_server

    server = subprocess.Popen([redis_server(), str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    wait_for_redis(url, server)
    return server


def wait_for_redis(url: str, server: subprocess.Popen, timeout: float = 10) -> None:
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis.from_url(url, socket_connect_timeout=1).ping()
            return
        except redis.ConnectionError:
            assert server.poll() is None and time.monotonic() < deadline, f"redis-server for {url} did not start"
            time.sleep(0.02)


CLUSTER_PORTS = {"MEMFILTER_KAFKA_PORT": "29092", "MEMFILTER_CONTROLLER_PORT": "29093", "MEMFILTER_REDIS_PORT": "17001"}


def cluster_env() -> dict[str, str]:
    """The environment of a `memfilter stack` call for the replicated test stack."""
    return {**stack_env(), "MEMFILTER_STACK_DIR": str(REPO / ".stack" / "cluster-tests"), **CLUSTER_PORTS}

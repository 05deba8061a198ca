"""The services the tests run against, and how to start them: shared by the fixtures
(`conftest.py`) and the tests that start or stop a stack themselves."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
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
    postgres_url: str = ""  # the stack's PostgreSQL (POSTGRES_URL), for the history's PostgreSQL tier
    containers: ContainerStack | None = None  # on the container backend: its workers are containers

    def pipeline(self):
        """A `Pipeline` on these services (see `pipeline`)."""
        from pipeline import Pipeline

        return Pipeline(self.bootstrap, self.redis_url, settings=self.settings, containers=self.containers, postgres_url=self.postgres_url)


def stack_env(**overrides: str) -> dict[str, str]:
    """The environment of a `memfilter stack` call for the test stack."""
    env = dict(os.environ)
    env.setdefault("MEMFILTER_STACK_DIR", str(REPO / ".stack" / "tests"))
    env.setdefault("MEMFILTER_KAFKA_PORT", "19092")
    env.setdefault("MEMFILTER_CONTROLLER_PORT", "19093")
    env.setdefault("MEMFILTER_REDIS_PORT", "16379")
    env.setdefault("MEMFILTER_POSTGRES_PORT", "15432")
    env.update(overrides)
    return env


def memfilter(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfilter", *argv], capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # set in the processes of `pytest -n N`
STARTED_BY_WORKERS = "started-by-test-workers"  # in a stack's folder: pytest-xdist's workers started it; the run's end stops it


def shared_stack(env: dict[str, str], *up_args: str) -> tuple[dict[str, str], bool]:
    """`memfilter stack up` of the stack in `env`'s MEMFILTER_STACK_DIR, once for every pytest
    process of the run (pytest-xdist's workers share it: the first starts it, under a lock
    every stack's start takes); what it exports, and whether this call started it. A stack an xdist worker started is
    marked so, for the run's end to stop it (`stop_if_workers_started`): the other workers may
    still use it when this one is done."""
    folder = Path(env["MEMFILTER_STACK_DIR"])
    folder.mkdir(parents=True, exist_ok=True)
    # One lock for every stack: brokers starting side by side on two cores overload their
    # controllers past `stack up`'s wait (seen: the test and replicated stacks at once).
    with open(folder.parent / ".stack-up.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = "running" not in memfilter("stack", "status", env=env).stdout.split("\n")[0]
        up = memfilter("stack", "up", *up_args, env=env)
        if started and XDIST_WORKER:
            (folder / STARTED_BY_WORKERS).touch()
    assert up.returncode == 0, f"memfilter stack up {' '.join(up_args)} failed: {up.stderr}"
    return dict(line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines()), started


def stop_if_workers_started(env: dict[str, str]) -> None:
    """`memfilter stack down` of a stack pytest-xdist's workers started (`shared_stack`)."""
    mark = Path(env["MEMFILTER_STACK_DIR"]) / STARTED_BY_WORKERS
    if mark.exists():
        memfilter("stack", "down", env=env)
        mark.unlink(missing_ok=True)


def start_postgres(folder: Path, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A PostgreSQL of a test's own (Debian's, as `memfilter stack up` starts it) on `port` (a
    free one unless given: a restart on the same data gives the same), its data in `folder` (under the checkout: the `postgres` user must reach it when the
    tests run as root), once it answers; and its URL."""
    from pipeline import free_port

    from memfilter.stack import POSTGRES_USER, postgres_answers, postgres_bin, start_postgres

    port = port or free_port()
    server = start_postgres(folder, port, postgres_bin())
    deadline = time.monotonic() + 60
    while not postgres_answers(port):
        assert server.poll() is None, f"PostgreSQL exited at start: see {folder / 'postgres.log'}"
        assert time.monotonic() < deadline, f"PostgreSQL on port {port} did not answer within 60 s: see {folder / 'postgres.log'}"
        time.sleep(0.1)
    return server, f"postgresql://{POSTGRES_USER}@127.0.0.1:{port}/postgres"


def signal_postgres(pid: int, sig: int) -> None:
    """Signal a PostgreSQL server and every process of it (each backend is a session of its
    own: SIGSTOP of the server alone leaves open connections answering). SIGSTOP goes to the
    server first, so that it forks no backend between the listing of its processes and their
    stop; any other signal to it last. A backend gone meanwhile (its session closed) needs none."""
    if sig == signal.SIGSTOP:
        os.kill(pid, sig)
    for child in [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, sig)
    if sig != signal.SIGSTOP:
        os.kill(pid, sig)


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


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


CLUSTER_PORTS = {"MEMFILTER_KAFKA_PORT": "29092", "MEMFILTER_CONTROLLER_PORT": "29093", "MEMFILTER_REDIS_PORT": "17001", "MEMFILTER_POSTGRES_PORT": "25432"}


def cluster_env() -> dict[str, str]:
    """The environment of a `memfilter stack` call for the replicated test stack."""
    return {**stack_env(), "MEMFILTER_STACK_DIR": str(REPO / ".stack" / "cluster-tests"), **CLUSTER_PORTS}

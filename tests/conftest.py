"""Shared fixtures and the tiers: what each test needs, started once and only when needed.

Tiers, by folder (each test is marked with its tier, so `pytest -m redis` runs one alone, as
does `pytest tests/redis`):
- `unit`: the pure core and files read as files; starts nothing (asking for a service fails).
- `redis`: the history store, processor and persister against a real Redis, which the
  session starts on a free port (a bare `redis-server`, a few milliseconds) unless REDIS_URL
  is set.
- `postgres`: the history's PostgreSQL tier (eviction, cold loads, the sink's writes) against a
  real PostgreSQL the session starts (Debian's, under `.stack/`, a second or two) and the
  redis tier's Redis; unless POSTGRES_URL is set.
- `kafka`: workers, the agent runner, the sink and the command line against a real Kafka,
  Redis and PostgreSQL.
- `system`: the replicated stack, Compose, the installed wheel, the soaks.
- `jepsen`: hosts in network namespaces the harness makes (`tests/jepsen/net.py`), and the
  faults between them; as root. Run by `pytest tests/jepsen`, not by the default paths.

If `KAFKA_BOOTSTRAP_SERVERS` and `REDIS_URL` are both set, the Kafka tier uses those services.
Otherwise the session starts the project's own stack (`memfilter stack up`) in
`.stack/tests/` on ports of its own (19092, 19093, 16379, overridable with the usual
`MEMFILTER_*_PORT` settings), so a developer's `.stack/` on the default ports is left alone,
and stops it at the end if it started it. With pytest-xdist (`-n N`, as `deploy/test.sh`
runs the kafka and system tiers) the workers share one stack: the first starts it, the run's
end stops it. Tests that share a module- or class-scoped stack, or that must not run beside
one another, are in one `xdist_group` (run with `--dist loadgroup`).

`MEMFILTER_TEST_BACKEND=containers` runs the tests marked `containers` on containers instead
(`tests/containers.py`: Kafka, Redis, PostgreSQL and the product's processes from the images `deploy/images.sh`
builds, through testcontainers, on a network made for the session); the others are deselected.
The default, `processes`, runs every test on the process stack above.

Tests of the replicated stack (`cluster_services`, marked `replicated`, all in one
`xdist_group`) start `memfilter stack up --brokers 3 --redis-cluster` in `.stack/cluster-tests/`:
brokers on 29092, 29094, 29096 (controllers one above each), Redis Cluster nodes on
17001-17006. A stack the run started is stopped right after the last of them, not at the run's
end: its three idle brokers would cost the tests after them most of a core.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The repository's folders are not import names: only the installed `memfilter` is. Neither
# this process nor the commands the tests run may find `streams` or `schemas` in the checkout.
REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != REPO_ROOT]
os.environ["PYTHONSAFEPATH"] = "1"

from stacks import BACKEND, STARTED_BY_WORKERS, XDIST_WORKER, Services, cluster_env, memfilter, shared_stack, stack_env, start_redis, stop_if_workers_started  # noqa: E402

TIERS = {
    "unit": "the pure core; starts nothing",
    "redis": "against a real Redis the session starts",
    "postgres": "the history's PostgreSQL tier against a real PostgreSQL and Redis the session starts",
    "kafka": "against a real Kafka, Redis and PostgreSQL (the session's stack)",
    "system": "replicated stack, Compose, the installed wheel, soaks",
    "jepsen": "hosts in network namespaces of the harness's own, and faults between them; as root",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "containers: runs on the container backend too (MEMFILTER_TEST_BACKEND=containers)")
    config.addinivalue_line("markers", "replicated: uses the replicated stack (`cluster_services`), stopped after the last such test")
    for tier, what in TIERS.items():
        config.addinivalue_line("markers", f"{tier}: {what} (tests/{tier}/)")


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its tier (its folder); on the container backend, only the
    tests marked `containers` run."""
    for item in items:
        tier = Path(item.path).parent.name
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid} is in no tier: put it in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(tier)
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


@pytest.fixture
def pipeline(services):
    """Topics, a consumer group and a Redis prefix of the test's own; its workers stopped after."""
    p = services.pipeline()
    asyncio.run(p.create_topics())
    yield p
    p.stop_all()
    asyncio.run(p.delete_topics())  # a broker with fewer topics answers metadata and stops sooner


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A Redis of the session's own for the `redis` tier (REDIS_URL when given), flushed of
    nothing: tests keep to key prefixes of their own."""
    if given := os.environ.get("REDIS_URL"):
        yield given
        return
    from pipeline import redis_config

    conf, url = redis_config(tmp_path_factory.mktemp("redis"))
    server = start_redis(conf, url)
    try:
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="session")
def postgres_url():
    """A PostgreSQL of the session's own for the `postgres` tier (POSTGRES_URL when given);
    tests keep to schemas of their own."""
    if given := os.environ.get("POSTGRES_URL"):
        yield given
        return
    import shutil
    import uuid

    from stacks import start_postgres

    folder = REPO_ROOT / ".stack" / f"postgres-tests-{uuid.uuid4().hex[:8]}"
    server, url = start_postgres(folder)
    try:
        yield url
    finally:
        server.send_signal(2)  # SIGINT: PostgreSQL's fast shutdown
        server.wait(30)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def services():
    if BACKEND == "containers":
        from containers import ContainerStack
        from pipeline import free_port

        stack = ContainerStack(free_port()).start()
        yield Services(stack.bootstrap, stack.redis_url, None, postgres_url=stack.postgres_url, containers=stack)
        stack.stop()
        return
    given = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("REDIS_URL")
    if all(given):
        yield Services(given[0], given[1], None)
        return
    exports, started = shared_stack(stack_env())
    yield Services(exports["KAFKA_BOOTSTRAP_SERVERS"], exports["REDIS_URL"], Path(stack_env()["MEMFILTER_STACK_DIR"]), postgres_url=exports["POSTGRES_URL"])
    if started and not XDIST_WORKER:  # an xdist worker's is stopped at the run's end (`pytest_sessionfinish`)
        memfilter("stack", "down", env=stack_env())


REPLICATED_STARTED: list[bool] = []  # whether this process started the replicated stack (`cluster_services`)


@pytest.fixture(scope="session")
def cluster_services(services):  # the single-node stack first: the other worker's tests need it while these brokers start
    """Three Kafka brokers (replication factor 3, min ISR 2) and a Redis Cluster of three
    masters with a replica each, on loopback; if started here, stopped after the last test
    marked `replicated` (`pytest_runtest_teardown`)."""
    exports, started = shared_stack(cluster_env(), "--brokers", "3", "--redis-cluster")
    REPLICATED_STARTED.append(started)
    given = ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "MEMFILTER_SECRET")
    yield Services(
        exports["KAFKA_BOOTSTRAP_SERVERS"],
        exports["REDIS_URL"],
        Path(cluster_env()["MEMFILTER_STACK_DIR"]),
        {k: v for k, v in exports.items() if k not in given},
    )


STOPPING: list[subprocess.Popen] = []  # stacks being stopped in the background (`pytest_runtest_teardown`)


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
    """The replicated stack this process started goes once no test after this one needs it
    (its tests run one after the other: `replicated`, one `xdist_group`). Three brokers take
    most of a minute to stop: the next tests run meanwhile, and the session's end waits."""
    if any(REPLICATED_STARTED) and item.get_closest_marker("replicated") and (nextitem is None or not nextitem.get_closest_marker("replicated")):
        (Path(cluster_env()["MEMFILTER_STACK_DIR"]) / STARTED_BY_WORKERS).unlink(missing_ok=True)  # the run's end need not stop it
        STOPPING.append(subprocess.Popen([sys.executable, "-m", "memfilter", "stack", "down"], env=cluster_env(), cwd=REPO_ROOT, stdout=subprocess.DEVNULL))
        REPLICATED_STARTED.clear()


def pytest_sessionfinish(session):
    """With pytest-xdist, the stacks its workers started are stopped once all of them are done."""
    for stopping in STOPPING:
        stopping.wait(300)
    if not XDIST_WORKER and getattr(session.config.option, "numprocesses", None):
        stop_if_workers_started(stack_env())
        stop_if_workers_started(cluster_env())

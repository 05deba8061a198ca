"""Faults on the replicated stack: three brokers and a Redis Cluster (three masters, a replica
each) on the host `stack`, a worker on each of `worker-1` and `worker-2` (with
MEMFILTER_REDIS_REPLICAS=1, as `memfilter stack up --redis-cluster` prints it: a batch commits
only once its Redis writes are on a replica). Each schedule runs as `runs.run` says, and the
independent checker must find nothing lost, twice, out of order or stale."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable

import pytest
from runs import deployment as deployed
from runs import run, steps

PAUSE_S = 15  # longer than the workers' Kafka sessions (6 s) and Redis Cluster's node timeout (2 s)


@pytest.fixture(scope="module")
def deployment():
    with deployed(replicated=True) as made:
        yield made


def paused(pid: int, what: str, woken: str) -> Callable[[list[str]], Awaitable[None]]:
    """Process `pid` paused (SIGSTOP) 5 s in, for PAUSE_S, then woken."""
    return steps((5, lambda: os.kill(pid, signal.SIGSTOP), what), (PAUSE_S, lambda: os.kill(pid, signal.SIGCONT), woken))


class TestABrokerOrAMasterPaused:
    def test_a_broker_paused_past_the_workers_sessions_then_woken_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        run(net, product, paused(product.pids()["kafka-2"], "broker kafka-2 paused (SIGSTOP)", "broker kafka-2 woken"))

    def test_a_redis_master_paused_past_the_node_timeout_fails_over_and_nothing_acknowledged_is_lost(self, deployment):
        net, product = deployment
        what = "Redis node 6379 (a master) paused: its replica takes over"
        run(net, product, paused(product.pids()["redis-6379"], what, "Redis node 6379 woken: it rejoins as a replica"))


class TestAWorkerCutFromOneBroker:
    def test_a_worker_cut_from_one_broker_of_three_past_its_session_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        cut = lambda: net.cut("worker-1", "stack", port=9094)  # noqa: E731
        run(net, product, steps((5, cut, "worker-1 cut from broker kafka-2 (port 9094)"), (PAUSE_S, net.heal, "healed")))

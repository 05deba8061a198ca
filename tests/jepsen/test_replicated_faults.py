"""Faults on the replicated stack: three brokers and a Redis Cluster (three masters, a replica
each) on the host `stack`, a worker on each of `worker-1` and `worker-2` (with
MEMFILTER_REDIS_REPLICAS=1, as `memfilter stack up --redis-cluster` prints it: a batch commits
only once its Redis writes are on a replica). Each schedule runs as `runs.run` says, and the
independent checker must find nothing lost, twice, out of order or stale."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from runs import at, run
from runs import deployment as deployed

PAUSE_S = 15  # longer than the workers' Kafka sessions (6 s) and Redis Cluster's node timeout (2 s)


@pytest.fixture(scope="module")
def deployment():
    with deployed(replicated=True) as made:
        yield made


class TestABrokerOrAMasterPaused:
    def test_a_broker_paused_past_the_workers_sessions_then_woken_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            pid = product.pids()["kafka-2"]
            os.kill(pid, signal.SIGSTOP)
            at(faults, started, "broker kafka-2 paused (SIGSTOP)")
            await asyncio.sleep(PAUSE_S)
            os.kill(pid, signal.SIGCONT)
            at(faults, started, "broker kafka-2 woken")

        run(net, product, schedule)

    def test_a_redis_master_paused_past_the_node_timeout_fails_over_and_nothing_acknowledged_is_lost(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            pid = product.pids()["redis-6379"]
            os.kill(pid, signal.SIGSTOP)
            at(faults, started, "Redis node 6379 (a master) paused: its replica takes over")
            await asyncio.sleep(PAUSE_S)
            os.kill(pid, signal.SIGCONT)
            at(faults, started, "Redis node 6379 woken: it rejoins as a replica")

        run(net, product, schedule)


class TestAWorkerCutFromOneBroker:
    def test_a_worker_cut_from_one_broker_of_three_past_its_session_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            net.cut("worker-1", "stack", port=9094)
            at(faults, started, "worker-1 cut from broker kafka-2 (port 9094)")
            await asyncio.sleep(PAUSE_S)
            net.heal()
            at(faults, started, "healed")

        run(net, product, schedule)

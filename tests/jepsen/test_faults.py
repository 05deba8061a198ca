"""Faults on the product's hosts, and the independent checker's verdict on what came of them.

The stack (Kafka, Redis, PostgreSQL) runs on the host `stack`, two workers on `worker-1` and
`worker-2` (`product.py`). For each schedule, the clients (`workload.py`) publish full-echo
turns on fresh threads while the schedule's faults come and go; after the last fault heals and
the last turn is published, every acknowledged request must get its outcome within ANSWERED_S,
and the checker (`checker.py`) must find nothing lost, nothing twice, nothing out of order, no
stale decision, and Redis holding what the outcomes contributed. Each run prints its report:
the faults and when, what the clients saw, the verdict, the longest a request waited.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from product import SESSION_TIMEOUT_S
from runs import at, run
from runs import deployment as deployed


@pytest.fixture(scope="module")
def deployment():
    with deployed() as made:
        yield made


class TestAWorkerCutOff:
    def test_a_worker_cut_from_the_brokers_but_not_from_redis_past_its_session_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            net.cut("worker-1", "stack", port=9092)
            at(faults, started, "worker-1 cut from the broker (port 9092), not from Redis")
            await asyncio.sleep(3 * SESSION_TIMEOUT_S)
            net.heal()
            at(faults, started, "healed")

        run(net, product, schedule)

    def test_a_worker_cut_from_everything_past_its_session_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            net.isolate("worker-2")
            at(faults, started, "worker-2 isolated")
            await asyncio.sleep(3 * SESSION_TIMEOUT_S)
            net.heal()
            at(faults, started, "healed")

        run(net, product, schedule)


class TestAWorkerPaused:
    def test_a_worker_paused_past_its_session_timeout_then_woken_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            worker = product.workers["worker-1"]
            # the worker is the child of `ip netns exec`, which execs it: the same process
            worker.send_signal(signal.SIGSTOP)
            at(faults, started, "worker-1 paused (SIGSTOP)")
            await asyncio.sleep(3 * SESSION_TIMEOUT_S)
            worker.send_signal(signal.SIGCONT)
            at(faults, started, "worker-1 woken (SIGCONT)")

        run(net, product, schedule)


class TestAWorkersClockJumps:
    def test_a_workers_clock_jumping_an_hour_ahead_then_ten_minutes_behind_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            product.clock("worker-1", 3600)
            at(faults, started, "worker-1's clock an hour ahead")
            await asyncio.sleep(8)
            product.clock("worker-1", -600)
            at(faults, started, "worker-1's clock ten minutes behind")
            await asyncio.sleep(8)
            product.clock("worker-1", 0)
            at(faults, started, "worker-1's clock right")

        run(net, product, schedule)


class TestAFullDisk:
    def test_redis_out_of_disk_for_its_append_only_file_then_given_room_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(5)
            product.fill()
            at(faults, started, "Redis's disk full")
            await asyncio.sleep(12)
            product.free()
            at(faults, started, "Redis's disk has room again")

        run(net, product, schedule)


class TestALossyLink:
    def test_a_worker_dropping_a_third_of_its_packets_loses_and_repeats_nothing(self, deployment):
        net, product = deployment

        async def schedule(faults: list[str]) -> None:
            started = time.monotonic()
            await asyncio.sleep(3)
            net.loss("worker-2", 33)
            at(faults, started, "worker-2 drops 33% of its packets")
            await asyncio.sleep(15)
            net.heal()
            at(faults, started, "healed")

        run(net, product, schedule)

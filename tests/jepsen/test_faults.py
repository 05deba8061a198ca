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
import shutil
import signal
import time
from collections.abc import Awaitable, Callable

import pytest
from checker import check
from net import Net
from product import LOGS, SESSION_TIMEOUT_S, Product
from workload import Clients, read

ANSWERED_S = 60.0  # after the faults heal, the longest the last outcomes may take
RATE, THREADS, TURNS = 20.0, 20, 25  # 500 turns over 25 s


@pytest.fixture(scope="module")
def deployment():
    shutil.rmtree(LOGS, ignore_errors=True)
    with Net(["stack", "worker-1", "worker-2"]) as net:
        product = Product(net)
        product.up()
        try:
            yield net, product
        finally:
            product.down()


def workers_ready(net: Net, product: Product) -> None:
    """Both workers running, each having said it is ready (one that died is started again)."""
    for name in ("worker-1", "worker-2"):
        process = product.workers.get(name)
        if process is None or process.poll() is not None:
            (LOGS / f"{name}.log").unlink(missing_ok=True)
            product.worker(net[name])
    deadline = time.monotonic() + 120
    while not all("memfilter worker ready" in (LOGS / f"{n}.log").read_text(errors="replace") for n in ("worker-1", "worker-2")):
        assert time.monotonic() < deadline, (LOGS / "worker-1.log").read_text()[-2000:]
        time.sleep(0.5)


def run(net: Net, product: Product, schedule: Callable[[list[str]], Awaitable[None]]) -> None:
    """The workload with `schedule`'s faults (it appends what it does to the list it is given),
    then the wait for every outcome and the checker's verdict, printed and asserted."""
    workers_ready(net, product)
    env = product.env
    clients = Clients(env["KAFKA_BOOTSTRAP_SERVERS"], THREADS, TURNS)
    faults: list[str] = []
    started, healed = time.monotonic(), 0.0

    async def both() -> None:
        nonlocal healed
        stop = asyncio.Event()
        watching = asyncio.create_task(clients.watch(stop))
        await asyncio.gather(clients.run(RATE), schedule(faults))
        net.heal()
        healed = time.monotonic()
        acknowledged = {s.at for s in clients.sent if s.at is not None}
        while not acknowledged <= clients.answered.keys() and time.monotonic() - healed < ANSWERED_S:
            await asyncio.sleep(0.5)
        stop.set()
        await watching

    asyncio.run(both())
    answered_s = time.monotonic() - healed
    outcomes, saved, stored = asyncio.run(read(env["KAFKA_BOOTSTRAP_SERVERS"], env["REDIS_URL"], clients.threads))
    waits = [clients.answered[s.at] - s.sent_ms / 1000 for s in clients.sent if s.at in clients.answered]
    verdict = check(clients.sent, outcomes, saved, stored)
    print(f"\n--- schedule (t from the first turn, s): {'; '.join(faults)}")
    print(
        f"--- {len(clients.sent)} turns, {verdict.unacknowledged} not acknowledged, {verdict.outcomes} outcomes "
        f"({verdict.dead_letters} dead letters), all answered {answered_s:.1f} s after the heal; "
        f"longest a request waited for its outcome: {max(waits, default=0):.1f} s; {time.monotonic() - started:.0f} s in all"
    )
    print("--- verdict: " + ("ok" if verdict.ok else "\n".join(verdict.problems[:20])))
    assert verdict.ok, verdict.problems[:20]


def at(faults: list[str], started: float, what: str) -> None:
    faults.append(f"{time.monotonic() - started:.1f} {what}")


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

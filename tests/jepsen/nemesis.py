"""The seeded random nemesis: a schedule of faults drawn from a seed, so that a run is repeated by
its seed alone. Until `seconds` have passed, it waits a moment, draws a fault of a kind
(`kinds`) and its targets from the hosts the deployment has, holds it a while, and undoes it;
`runs.run` heals the network after. Or every kind once, in the seed's order (the short
schedule CI runs). The kinds:

- partitions: one host from the rest, random halves, a bridge (a host the two sides both see),
  a cut one way only;
- loss: a host drops a share of its packets, or of those on one of its links;
- a slow link: a host sends at most so many kilobits a second, so what it sends under load
  waits, up to a second (`net.slow`);
- a delay: what a host sends, or both ends of one of its links, held a fixed time (`net.delay`,
  as netem would: this kernel has none);
- reordering: what a host sends held a random time each, so that it leaves out of order;
- a process paused (SIGSTOP) past the workers' Kafka sessions and Redis Cluster's node timeout,
  then woken: a broker, a Redis node, PostgreSQL, a worker, the sink, the agent runner, the
  gateway; in a long schedule, one pause in four past Kafka's transaction timeout too (LONG_S);
- a clock jump, forward or back, on a worker or a broker;
- a disk full under a broker's log, a Redis node's append-only file or PostgreSQL's data, then
  given room (what stopped for it started again, as an operator does).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable

from net import Net
from product import Product

HOLD_S = (4.0, 16.0)  # how long a fault lasts: drawn between these
REST_S = (1.0, 5.0)  # the quiet between two faults
EACH_HOLD_S = 8.0  # every kind once: each held past the workers' Kafka sessions (6 s) and Redis Cluster's node timeout (2 s)
LONG_S = 70.0  # past Kafka's transaction timeout (aiokafka's 60 s): a transaction left open is aborted by its coordinator


Fault = tuple[Callable[[], object], Callable[[], object], str, float | None]


def kinds(net: Net, product: Product, rng: random.Random) -> dict[str, Callable[[], Fault]]:
    """Each kind draws its targets and returns (act, undo, what, how long to hold it: None for the schedule's draw)."""
    hosts = [*product.names, *product.workers, *product.parts]

    def isolate():
        a = rng.choice(hosts)
        return (lambda: net.isolate(a)), net.heal, f"{a} isolated", None

    def halves():
        shuffled = rng.sample(hosts, len(hosts))
        left, right = shuffled[: len(hosts) // 2], shuffled[len(hosts) // 2 :]
        return (lambda: net.partition(left, right)), net.heal, f"halves: {' '.join(sorted(left))} | {' '.join(sorted(right))}", None

    def bridge():
        middle, *others = rng.sample(hosts, len(hosts))
        left, right = others[: len(others) // 2], others[len(others) // 2 :]
        return (lambda: net.partition(left, right)), net.heal, f"{middle} bridges {' '.join(sorted(left))} | {' '.join(sorted(right))}", None

    def one_way():
        a, b = rng.sample(hosts, 2)
        return (lambda: net.cut(a, b, one_way=True)), net.heal, f"{a} cannot send to {b}", None

    def loss():
        a, percent = rng.choice(hosts), rng.choice([10, 33, 50])
        if rng.random() < 0.5:
            return (lambda: net.loss(a, percent)), net.heal, f"{a} drops {percent}% of its packets", None
        b = rng.choice([h for h in hosts if h != a])
        return (lambda: net.loss(a, percent, b)), net.heal, f"{a} drops {percent}% of its packets to and from {b}", None

    def slow():
        a, kbit = rng.choice(hosts), rng.choice([64, 256, 1024])
        return (lambda: net.slow(a, kbit)), net.heal, f"{a} sends at most {kbit} kbit/s", None

    def delay():
        a, ms = rng.choice(hosts), rng.choice([50, 200, 1000])
        if rng.random() < 0.5:
            return (lambda: net.delay(a, ms)), net.heal, f"{a}'s packets held {ms} ms", None
        b = rng.choice([h for h in hosts if h != a])
        return (lambda: (net.delay(a, ms, b), net.delay(b, ms, a))), net.heal, f"{a} and {b}'s packets to each other held {ms} ms", None

    def reorder():
        a, jitter = rng.choice(hosts), rng.choice([10, 50])
        return (lambda: net.delay(a, 1, jitter=jitter)), net.heal, f"{a}'s packets held 1 to {1 + jitter} ms each: out of order", None

    def pause():
        name = rng.choice(hosts)
        pid = (product.workers | product.parts)[name].pid if name in product.workers or name in product.parts else product.pids()[name]
        hold = LONG_S if rng.random() < 0.25 else None
        return (lambda: os.kill(pid, signal.SIGSTOP)), (lambda: os.kill(pid, signal.SIGCONT)), f"{name} paused", hold

    def clock():
        name, seconds = rng.choice([*product.workers, *product.kafka]), rng.choice([-600, -60, 60, 3600])
        return (lambda: product.clock(name, seconds)), (lambda: product.clock(name, 0)), f"{name}'s clock {seconds:+d} s", None

    def disk():
        name = rng.choice(product.disks)
        return (lambda: product.fill(name)), (lambda: product.room(name)), f"{name}'s disk full", None

    return {
        "isolate": isolate,
        "halves": halves,
        "bridge": bridge,
        "one way": one_way,
        "loss": loss,
        "slow": slow,
        "delay": delay,
        "reorder": reorder,
        "pause": pause,
        "clock": clock,
        "disk": disk,
    }


def nemesis(net: Net, product: Product, seed: int, seconds: float | None) -> Callable[[list[str]], Awaitable[None]]:
    """The schedule of `seed`: faults drawn and undone one after another for `seconds`; or, with
    `seconds` None, every kind once, in the seed's order, each held EACH_HOLD_S after a rest of
    the shortest (`each_kind_s`)."""

    async def schedule(faults: list[str]) -> None:
        rng = random.Random(seed)
        draw = kinds(net, product, rng)
        order = rng.sample(sorted(draw), len(draw)) if seconds is None else []
        started = time.monotonic()
        while order or (seconds is not None and time.monotonic() - started + REST_S[1] + HOLD_S[1] < seconds):
            await asyncio.sleep(REST_S[0] if seconds is None else rng.uniform(*REST_S))
            act, undo, what, hold = draw[order.pop(0) if order else rng.choice(sorted(draw))]()
            await asyncio.to_thread(act)
            faults.append(f"{time.monotonic() - started:.1f} {what}")
            # drawn whatever the hold, so that a long schedule's draws never depend on the clock
            # (not in the short one, whose holds are all EACH_HOLD_S: its schedule stays the one CI has run)
            drawn = rng.uniform(*HOLD_S) if seconds is not None else EACH_HOLD_S
            if seconds is None:
                hold = EACH_HOLD_S
            elif hold is None or time.monotonic() - started + hold > seconds:  # a long hold only where the schedule has room for it
                hold = drawn
            await asyncio.sleep(hold)
            await asyncio.to_thread(undo)
            faults.append(f"{time.monotonic() - started:.1f} undone")

    return schedule


def each_kind_s(net: Net, product: Product) -> float:
    """How long `nemesis(..., seconds=None)` lasts at most."""
    return len(kinds(net, product, random.Random(0))) * (REST_S[0] + EACH_HOLD_S)

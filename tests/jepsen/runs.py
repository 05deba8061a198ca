"""A schedule's run on the product's hosts: the workload while the faults come and go, the
wait for every outcome once they heal, and the checker's verdict, printed as the run's report
and asserted (`run`); the hosts and the product they run (`deployment`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from checker import REPLY, Sent, check, firsts
from net import Net, sweep
from product import LOGS, STACK_DIR, WEB_PORT, Product, stack_names
from workload import Clients, Saves, kept, read

ANSWERED_S = 60.0  # after the faults heal, the longest the last outcomes may take
RATE, TURNS = 20.0, 25  # turns a second in all; turns of each thread (threads enough for the run's length)
CONVERSATIONS = 10  # threads whose turns echo the agent runner's replies, beside the pipelined ones
CHATS = 5  # threads whose turns go through the gateway (tool calls answered, regenerates)
PARTS = ("sink", "agent", "gateway")
REPORTS = LOGS.parent / "memfilter-jepsen-reports"  # a report per run, kept across runs


@contextlib.contextmanager
def deployment(replicated: bool = False) -> Iterator[tuple[Net, Product]]:
    """Each of the stack's processes on a host of its own (`replicated`: three brokers and a
    Redis Cluster), a worker on each of `worker-1`, `worker-2`, the sink on `sink`, the agent
    runner on `agent` and the gateway on `gateway`."""
    sweep()  # what a killed run left
    shutil.rmtree(LOGS, ignore_errors=True)
    product = None
    try:
        with Net([*stack_names(replicated), "worker-1", "worker-2", *PARTS]) as net:
            product = Product(net, replicated)
            product.up()
            yield net, product
    finally:  # the network's removal killed every process on its hosts (the run's data is thrown away: nothing is stopped in order)
        if product is not None:
            product.unmount()


def workers_ready(net: Net, product: Product) -> None:
    """Both workers, the sink, the agent runner and the gateway running, each having said it is
    ready (one that died is started again)."""
    for name in ("worker-1", "worker-2"):
        process = product.workers.get(name)
        if process is None or process.poll() is not None:
            (LOGS / f"{name}.log").unlink(missing_ok=True)
            product.worker(net[name])
    for part in PARTS:
        if part not in product.parts or product.parts[part].poll() is not None:
            product.start(part, net[part])
    deadline = time.monotonic() + 120
    while not all("memfilter worker ready" in (LOGS / f"{n}.log").read_text(errors="replace") for n in ("worker-1", "worker-2")) or not all(
        ready(net, part) for part in PARTS
    ):
        assert time.monotonic() < deadline, "".join((LOGS / f"{n}.log").read_text()[-2000:] for n in ("worker-1", *PARTS))
        time.sleep(0.5)


def ready(net: Net, part: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{net[part].address}:{WEB_PORT}/readyz", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def run(net: Net, product: Product, schedule: Callable[[list[str]], Awaitable[None]], seconds: float = 25.0, name: str = "") -> list[Sent]:
    """The workload for `seconds` with `schedule`'s faults (it appends what it does to the list
    it is given), then the wait for every outcome and the checker's verdict: printed, written
    to REPORTS (with what each client was told) and asserted; what each client was told."""
    workers_ready(net, product)
    env = product.env
    gateway = f"http://{net['gateway'].address}:{WEB_PORT}"
    clients = Clients(env["KAFKA_BOOTSTRAP_SERVERS"], max(1, round(seconds * RATE / TURNS)), TURNS, CONVERSATIONS, gateway, CHATS)
    faults: list[str] = []
    started, healed = time.monotonic(), 0.0

    async def both() -> None:
        nonlocal healed
        stop = asyncio.Event()
        watching = asyncio.create_task(clients.watch(stop))
        await asyncio.gather(clients.run(RATE, think_s=seconds / TURNS), schedule(faults))
        net.heal()
        healed = time.monotonic()
        acknowledged = {s.at for s in clients.sent if s.at is not None}
        while not acknowledged <= clients.answered.keys() and time.monotonic() - healed < ANSWERED_S:
            await asyncio.sleep(0.5)
        stop.set()
        await watching

    try:
        asyncio.run(both())
    except BaseException:  # the schedule or the clients failed (a process that would not start again, say): the logs, for the finding
        keep_logs(REPORTS / f"{time.strftime('%Y%m%dT%H%M%S')}-{name or 'run'}")
        raise
    answered_s = time.monotonic() - healed
    outcomes, saved, stored, superseded = asyncio.run(read(env["KAFKA_BOOTSTRAP_SERVERS"], env["REDIS_URL"], clients.all))
    while not replies_applied(clients.all, saved, stored, superseded) and time.monotonic() - healed < 2 * ANSWERED_S:
        time.sleep(1)  # the last replies' saves are on the log, and the workers apply them a moment later
        outcomes, saved, stored, superseded = asyncio.run(read(env["KAFKA_BOOTSTRAP_SERVERS"], env["REDIS_URL"], clients.all))
    while (copy := asyncio.run(kept(env["POSTGRES_URL"], clients.all))) != stored and time.monotonic() - healed < 2 * ANSWERED_S:
        time.sleep(1)  # the sink catches up
    waits = [w for s in clients.sent if (w := waits_of(clients, s)) is not None]
    verdict = check(clients.sent, outcomes, saved, stored, copy, superseded)
    told = Counter(s.told.split(" (")[0] for s in clients.sent if s.told is not None)
    report = "\n".join(
        [
            f"--- {name or 'run'}: schedule (t from the first turn, s): {'; '.join(faults)}",
            f"--- {len(clients.sent)} turns, {verdict.unacknowledged} not acknowledged, {verdict.outcomes} outcomes "
            f"({verdict.dead_letters} dead letters), {sum(rid.endswith(REPLY) for t in clients.all for rid, _ in saved.get(t, []))} replies saved; "
            f"{sum(s.waited is not None for s in clients.sent)} turns of conversations, {sum(bool(s.waited) for s in clients.sent)} sent after their last reply; "
            f"through the gateway ({', '.join(f'{n} {k}' for k, n in Counter(s.kind for s in clients.sent if s.told is not None).items())}): "
            f"{', '.join(f'{n} {what}' for what, n in told.most_common())}; "
            f"all answered {answered_s:.1f} s after the heal; "
            f"longest a request waited for its outcome: {max(waits, default=0):.1f} s; {time.monotonic() - started:.0f} s in all",
            "--- verdict: " + ("ok" if verdict.ok else "\n".join(verdict.problems[:20])),
        ]
    )
    print("\n" + report)
    REPORTS.mkdir(parents=True, exist_ok=True)
    stem = REPORTS / f"{time.strftime('%Y%m%dT%H%M%S')}-{name or 'run'}"
    stem.with_suffix(".txt").write_text(report + "\n" + "\n".join(verdict.problems) + "\n")
    lines = (
        {"request": s.request_id, "kind": s.kind, "published": s.at, "told": s.told, "outcome_after_s": waits_of(clients, s), "waited": s.waited}
        for s in clients.sent
    )
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if not verdict.ok:
        keep_logs(stem)
        stem.with_name(stem.name + "-transactions.txt").write_text(product.transactions())
    assert verdict.ok, verdict.problems[:20]
    return clients.sent


def keep_logs(stem: Path) -> None:
    """The processes' logs, the stack's among them, beside the report `stem` (the next
    deployment starts them anew, and the small disks go with their mounts)."""
    kept = stem.with_name(stem.name + "-logs")
    shutil.copytree(LOGS, kept, dirs_exist_ok=True)
    for log in STACK_DIR.glob("*/*.log"):
        shutil.copy(log, kept / f"{log.parent.name}-{log.name}")


def replies_applied(threads: list[str], saved: Saves, stored: dict[str, list[str]], superseded: dict[str, dict[str, list[str]]]) -> bool:
    """Is every reply the log holds for `threads` (the first save of each reply's request id),
    but those a regenerate took out, in Redis?"""
    return all(
        m in stored.get(t, []) or any(m in out for out in superseded.get(t, {}).values())
        for t in threads
        for request_id, ids in firsts(saved.get(t, []))
        if request_id.endswith(REPLY)
        for m in ids
    )


def waits_of(clients: Clients, sent: Sent) -> float | None:
    """How long after its publish a request's outcome arrived, or a gateway turn's answer (None:
    not seen while watching)."""
    if sent.told is not None:
        return round(clients.told_s[sent.request_id], 3) if sent.request_id in clients.told_s else None
    return round(clients.answered[sent.at] - sent.sent_ms / 1000, 3) if sent.at in clients.answered else None


def steps(*plan: tuple[float, Callable[[], object], str]) -> Callable[[list[str]], Awaitable[None]]:
    """A schedule: each step waits its seconds after the one before, then acts, and is noted
    (when, from the first turn, and what) in the list the run gives it."""

    async def schedule(faults: list[str]) -> None:
        started = time.monotonic()
        for wait_s, act, what in plan:
            await asyncio.sleep(wait_s)
            await asyncio.to_thread(act)  # off the loop: the clients publish and watch meanwhile
            faults.append(f"{time.monotonic() - started:.1f} {what}")

    return schedule

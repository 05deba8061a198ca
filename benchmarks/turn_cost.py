"""Benchmark: a chat turn as users make it, beside Mastra's in-process agent: time to first
token and to `finish`, and the CPU per turn of every part.

On the stack's Kafka, Redis and PostgreSQL (`memfilter stack up`), a worker, the echo agent
runner and a gateway (header identity, callers' limits well above the load), and with `--sink`
the sink, on topics of the run's own. The parts first idle for `--idle-s` seconds: each part's
CPU a second then is printed apart. Then `--turns` turns arrive open-loop, `--rate` a second,
each a new user message on one of `--threads` threads (each a user of its own, holding
`--history` messages before its first turn), posted as the AI SDK's `DefaultChatTransport`
posts it (the thread's messages so far, its replies included, as `useChat` holds them) and
read as the UI message stream it answers. Printed: time to the first text delta and to
`finish` (p50, p90, p99, max), and each part's CPU per turn (the worker, the agent runner, the
gateway, the sink, Kafka, Redis, PostgreSQL, all together), the idle CPU of the turns' span
taken out; with `--sink`, PostgreSQL's write-ahead log per turn (every byte it writes to
tables and indexes).

Then the same turns go through Mastra 1.71's `Agent` with `Memory` (`lastMessages: 10`,
LibSQL storage, a mock model answering as the echo runner does, in one Node process:
benchmarks/mastra/turns.mjs, its packages installed on first use) and the ratios are printed.

With `--old REV`, the same run is made alternately with REV's parts (a worktree set up as
`benchmarks.alternate` sets it up) and this checkout's, `--pairs` times (old, new, new, old,
...), on one stack, and each pair's new/old ratios are printed with their medians: a change
on a turn's path, against the commit before it (Mastra is not run).

With `--loaders`, the same alternation is between this checkout without Mastra's memory loaders
and with both: working memory (docs/working-memory.md, scope `resource`: each filtered input
carries the document's instruction; the echo model never updates it) and semantic recall
(docs/recall.md: `memfilter embedder` beside the sink, the agent runner recalling with scope
`resource`, against an embeddings endpoint in this process, `tests/fake_openai.py`: its answers
cost the parts nothing; a real endpoint's time is its own), and the on/off ratios are printed:
what the loaders cost a turn.

    eval "$(memfilter stack up)"
    .venv/bin/python -m benchmarks.turn_cost [--rate 20] [--turns 400] [--threads 20] [--history 1000] [--sink] [--old b70aedd | --loaders] [--pairs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import asyncpg

from benchmarks.alternate import checkout
from benchmarks.worker_throughput import REPO, batch_phases, clean_up, cpu_seconds, free_port, own_env, own_topics, service_cpu_seconds

STARTED_S = 90.0
PARTS = ("worker", "agent", "gateway")


class Thread:
    """One `useChat` conversation: its messages as the client holds them."""

    def __init__(self, chat: str, user: str, history: int = 0):
        self.chat, self.user, self.turns = chat, user, 0
        self.messages: list[dict] = [  # what came before: sent whole with the first turn (the thread is seeded)
            {
                "id": f"{chat}-h{i}",
                "role": "assistant" if i % 2 else "user",
                "parts": [{"type": "text", "text": f"echo: earlier {i - 1}" if i % 2 else f"earlier {i}"}],
            }
            for i in range(history)
        ]
        self.busy = asyncio.Lock()  # a user sends the next message once the reply has ended

    async def turn(self, http: aiohttp.ClientSession, gateway: str) -> tuple[float, float]:
        """One turn: the seconds to its first text delta and to its `finish`."""
        async with self.busy:
            self.turns += 1
            self.messages.append({"id": f"{self.chat}-u{self.turns}", "role": "user", "parts": [{"type": "text", "text": f"turn {self.turns}: and then?"}]})
            body = {"id": self.chat, "messages": self.messages, "trigger": "submit-message"}
            started, first, finished, reply, text = time.perf_counter(), None, None, None, []
            async with http.post(f"{gateway}/api/chat", json=body, headers={"X-Memfilter-Resource": self.user}) as r:
                if r.status != 200:
                    raise SystemExit(f"a turn on {self.chat} was answered {r.status}: {(await r.read())[:300]!r}")
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    kind = chunk.get("type")
                    if kind == "start":
                        reply = chunk.get("messageId")
                    elif kind == "text-delta":
                        first = first or time.perf_counter() - started
                        text.append(chunk["delta"])
                    elif kind == "finish":
                        finished = time.perf_counter() - started
                    elif kind == "error":
                        raise SystemExit(f"a turn on {self.chat} ended in an error: {chunk.get('errorText')}")
            if first is None or finished is None or reply is None:
                raise SystemExit(f"a turn on {self.chat} ended without a text delta or a finish")
            self.messages.append(
                {"id": reply, "role": "assistant", "parts": [{"type": "step-start"}, {"type": "text", "text": "".join(text), "state": "done"}]}
            )
            return first, finished


def percentiles(values: list[float]) -> str:
    return f"p50 {at(values, 0.5) * 1000:.1f} / p90 {at(values, 0.9) * 1000:.1f} / p99 {at(values, 0.99) * 1000:.1f} / max {max(values) * 1000:.1f} ms"


def at(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def caught_up(port: int, quiet_s: float = 2.0, within_s: float = 120.0) -> None:
    """Until the embedder at `port` has embedded nothing more for `quiet_s`."""
    deadline, last, since = time.monotonic() + within_s, -1.0, time.monotonic()
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        done = next((float(line.split()[-1]) for line in text.splitlines() if line.startswith("memfilter_embedder_messages_embedded_total ")), 0.0)
        if done != last:
            last, since = done, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        await asyncio.sleep(0.2)


def cpu(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by the run's parts and the stack's services."""
    return {**{name: cpu_seconds(pid) for name, pid in pids.items()}, **service_cpu_seconds()}


async def wal_bytes(url: str) -> int:
    """How far PostgreSQL's write-ahead log has come: the bytes it has written, every table's and index's."""
    pg = await asyncpg.connect(url)
    try:
        return int(await pg.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')"))
    finally:
        await pg.close()


def hops(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> str:
    """Where a part's batches spent their time over the turns (`memfilter_batch_phase_seconds`):
    each phase's mean, and how many batches. The worker's `waiting` is a request's time in
    Kafka, from the gateway's publish to the worker's fetch; the agent's, a filtered input's,
    from the worker's commit to the agent's fetch; the agent's `handling` holds the model call."""
    spent = {phase: (seconds - before.get(phase, (0.0, 0.0))[0], n - before.get(phase, (0.0, 0.0))[1]) for phase, (seconds, n) in after.items()}
    means = ", ".join(f"{phase} {seconds / n * 1000:.2f}" for phase, (seconds, n) in spent.items() if n > 0)
    return f"{means} ({spent.get('handling', (0.0, 0.0))[1]:.0f} batches)"


def report(args: argparse.Namespace, firsts: list[float], finishes: list[float], span: float) -> dict[str, float]:
    print(f"  {args.turns} turns at {args.rate:g}/s over {span:.1f} s on {args.threads} threads of {args.history}+ messages", flush=True)
    print(f"  first text delta: {percentiles(firsts)}", flush=True)
    print(f"  finish:           {percentiles(finishes)}", flush=True)
    return {"first token p50": at(firsts, 0.5), "first token p99": at(firsts, 0.99)}


async def run(args: argparse.Namespace, path: Path, python: str, embeddings: str = "") -> dict[str, float]:
    """One run with the parts of the checkout at `path` (with working memory, and semantic recall
    against the `embeddings` endpoint, when given): its figures, printed as they come."""
    bootstrap, redis_url = os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["REDIS_URL"]
    postgres = os.environ.get("POSTGRES_URL", "")
    name, topics = await own_topics(bootstrap, "turn")
    lenient = {  # this measures turns, not the limits: callers' rates, and long threads echoed whole
        "MEMFILTER_GATEWAY_CALLER_RATE": "1000",
        "MEMFILTER_GATEWAY_CALLER_BURST": "1000",
        "MEMFILTER_MAX_MESSAGES": str(max(1000, args.history + 4 * (args.turns // args.threads + 2))),
    }
    env = {**own_env(name, topics, os.environ.get("MEMFILTER_SECRET") or secrets.token_hex(32), MEMFILTER_GATEWAY_AUTH="header", **lenient), "PYTHONPATH": ""}
    port, web = free_port(), {"worker": free_port(), "agent": free_port()}
    commands = {
        "worker": ["worker", "--web-port", str(web["worker"])],
        "agent": ["agent", "--web-port", str(web["agent"])],
        "gateway": ["gateway", "--port", str(port)],
    }
    if args.sink:
        if not postgres:
            raise SystemExit("--sink and --loaders need PostgreSQL: POSTGRES_URL, as `memfilter stack up` prints it")
        commands["sink"] = ["sink", "--web-port", str(free_port())]
    if embeddings:
        web["embedder"] = free_port()
        commands["embedder"] = ["embedder", "--web-port", str(web["embedder"])]
        env |= {
            "MEMFILTER_WORKING_MEMORY": "resource",
            "MEMFILTER_RECALL": "resource",
            "MEMFILTER_EMBEDDINGS_BASE_URL": embeddings,
            "MEMFILTER_EMBEDDINGS_MODEL": "fake",
            "OPENAI_API_KEY": "none",
        }
    processes = {
        part: subprocess.Popen([python, "-m", "memfilter", *c], env=env, cwd=path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for part, c in commands.items()
    }
    gateway = f"http://127.0.0.1:{port}"
    threads = [Thread(f"turn-{name}-{n}", f"user-{n}", args.history) for n in range(args.threads)]
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            deadline = time.monotonic() + STARTED_S
            while True:  # the whole loop answers: a turn through worker, agent and gateway
                try:
                    await Thread(f"turn-{name}-warm-up", "warm-up").turn(http, gateway)
                    break
                except aiohttp.ClientError:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the gateway did not answer a turn within {STARTED_S:.0f} s") from None
                    await asyncio.sleep(1)
            for t in threads:  # each thread's first turn, unmeasured: the parts warm up on every thread
                await t.turn(http, gateway)
            if embeddings:  # the embedder done with the threads' histories before its idle CPU is measured
                await caught_up(web["embedder"])
            pids = {part: p.pid for part, p in processes.items()}
            at_, before = time.monotonic(), cpu(pids)
            await asyncio.sleep(args.idle_s)
            idle = {k: (v - before[k]) / (time.monotonic() - at_) for k, v in cpu(pids).items()}
            at_, before, wal = time.monotonic(), cpu(pids), await wal_bytes(postgres) if args.sink else 0
            phases = {part: batch_phases([web[part]]) for part in ("worker", "agent")}

            async def turn(n: int) -> tuple[float, float]:
                await asyncio.sleep(max(0.0, at_ + n / args.rate - time.monotonic()))
                return await threads[n % len(threads)].turn(http, gateway)

            timed = await asyncio.gather(*(turn(n) for n in range(args.turns)))
            span = time.monotonic() - at_
            phases = {part: hops(phases[part], batch_phases([web[part]])) for part in phases}
            if args.sink:  # what the turns gave the sink is written: PostgreSQL's bytes counted whole
                await asyncio.sleep(args.sink_s)
                wal = await wal_bytes(postgres) - wal
            used = {k: (v - before[k] - idle[k] * (time.monotonic() - at_)) / args.turns for k, v in cpu(pids).items()}
    finally:
        for p in processes.values():
            p.terminate()
        for p in processes.values():
            p.wait(30)
        await clean_up(bootstrap, redis_url, list(topics.values()), name)
        if args.sink:
            subprocess.run([python, "-m", "memfilter", "history", "drop", "--prefix", name], env=env, cwd=path, capture_output=True)
    figures = report(args, [f for f, _ in timed], [f for _, f in timed], span)
    print(f"  idle CPU: {', '.join(f'{k} {v * 1000:.1f}' for k, v in idle.items())} ms/s; all {sum(idle.values()) * 1000:.1f} ms/s", flush=True)
    print(f"  CPU per turn: {', '.join(f'{k} {v * 1000:.2f}' for k, v in used.items())} ms; all {sum(used.values()) * 1000:.2f} ms", flush=True)
    for part, hop in phases.items():
        print(f"  the {part}'s batches, mean ms: {hop}", flush=True)
    if args.sink:
        print(f"  PostgreSQL's write-ahead log per turn: {wal / args.turns / 1024:.1f} KiB", flush=True)
    return {**figures, "CPU per turn": sum(used.values()), "idle CPU": sum(idle.values()), **{f"{part} CPU per turn": used[part] for part in PARTS}}


def mastra(args: argparse.Namespace) -> dict[str, float]:
    """The same turns through Mastra's in-process agent (benchmarks/mastra/turns.mjs)."""
    folder = REPO / "benchmarks" / "mastra"
    if not (folder / "node_modules").exists():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=folder, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        options = ["--rate", str(args.rate), "--turns", str(args.turns), "--threads", str(args.threads), "--history", str(args.history)]
        done = subprocess.run(
            ["node", "turns.mjs", *options, "--idle-s", str(args.idle_s), "--db", f"{tmp}/memory.db"], cwd=folder, capture_output=True, text=True
        )
    if done.returncode != 0:
        raise SystemExit(f"Mastra's turns failed: {done.stderr[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    figures = report(args, out["firsts"], out["finishes"], out["span"])
    print(f"  idle CPU: {out['idle'] * 1000:.1f} ms/s; CPU per turn: {out['perTurn'] * 1000:.2f} ms", flush=True)
    return {**figures, "CPU per turn": out["perTurn"], "idle CPU": out["idle"]}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=5.0, help="turns a second, open-loop")
    parser.add_argument("--turns", type=int, default=150)
    parser.add_argument("--threads", type=int, default=20)
    parser.add_argument("--history", type=int, default=10, help="messages each thread holds before its first turn")
    parser.add_argument("--idle-s", type=float, default=5.0, help="seconds the parts idle, measured, before the turns")
    parser.add_argument("--sink", action="store_true", help="run the sink too: PostgreSQL's CPU and write-ahead log per turn")
    parser.add_argument("--sink-s", type=float, default=3.0, help="with --sink, seconds the sink is given after the turns")
    parser.add_argument("--old", help="a git revision: alternate its parts with this checkout's (the module's header)")
    parser.add_argument("--loaders", action="store_true", help="alternate this checkout without working memory and recall and with both (implies --sink)")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    if args.loaders:
        args.sink = True
        sys.path.insert(0, str(REPO / "tests"))
        from fake_openai import FakeOpenAI

        endpoint = FakeOpenAI()
        try:
            await alternate(args, {"off": (REPO, sys.executable, ""), "on": (REPO, sys.executable, endpoint.url)})
        finally:
            endpoint.close()
        return
    if args.old is None:
        print("this checkout:", flush=True)
        ours = await run(args, REPO, sys.executable)
        print("Mastra 1.71's in-process agent with memory (benchmarks/mastra/turns.mjs):", flush=True)
        theirs = mastra(args)
        for figure in ("first token p50", "first token p99", "CPU per turn", "idle CPU"):
            print(f"memfilter/Mastra {figure}: {ours[figure] / theirs[figure]:.2f}")
        return
    await alternate(args, {"old": (checkout(args.old), None, ""), "new": (REPO, None, "")})


async def alternate(args: argparse.Namespace, sides: dict[str, tuple[Path, str | None, str]]) -> None:
    """The runs of two sides (name -> checkout, its Python (None: its own .venv's), the
    embeddings endpoint for recall), alternated `--pairs` times; each pair's second/first
    ratios, with their medians."""
    first, second = sides
    figures: dict[str, list[dict[str, float]]] = {first: [], second: []}
    for pair in range(args.pairs):
        for side in (first, second) if pair % 2 == 0 else (second, first):
            path, python, embeddings = sides[side]
            print(f"pair {pair + 1}, {side} ({args.old if side == 'old' else 'this checkout'}):", flush=True)
            figures[side].append(await run(args, path, python or str(path / ".venv/bin/python"), embeddings))
    for figure in figures[first][0]:
        ratios = [b[figure] / a[figure] for a, b in zip(figures[first], figures[second])]
        print(f"{second}/{first} {figure} by pair: {'  '.join(f'{r:.2f}' for r in ratios)}   median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    asyncio.run(main())

"""Benchmark: one caller's time to first token with and without another caller flooding the gateway.

On the stack's Kafka and Redis (`memfilter stack up`; KAFKA_BOOTSTRAP_SERVERS and REDIS_URL as
it prints), a worker, the echo agent runner and a gateway (header identity, the default fair
limits: `memfilter.gateway.limits`) on topics of the run's own. Calm callers (`--users`, taking
turns) send `--turns` useChat turns, one after the other, `--rate` a second in all, and time
each to its first text delta;
the run alternates phases without and with a flooder, `--flooders` connections sending turns
as fast as the gateway answers them (most answered 429 past the flooder's share), calm, flood,
flood, calm, ... `--pairs` times. Printed: each phase's p50 and p90, the flood's answers by
status, and the ratio flooded/calm of each pair's p50 and p90, and their medians.

    eval "$(memfilter stack up)"
    .venv/bin/python -m benchmarks.gateway_fairness [--turns 30] [--rate 2] [--users 8] [--flooders 20] [--pairs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter

import aiohttp

from benchmarks.worker_throughput import REPO, clean_up, free_port, own_env, own_topics

STARTED_S = 90.0


async def first_token(http: aiohttp.ClientSession, gateway: str, user: str) -> tuple[int, float | None]:
    """A turn's status, and the seconds to its first text delta (None when refused)."""
    chat = f"fair-{uuid.uuid4().hex[:10]}"
    body = {"id": chat, "trigger": "submit-message", "messages": [{"id": f"{chat}-u0", "role": "user", "parts": [{"type": "text", "text": "hello there"}]}]}
    started = time.perf_counter()
    async with http.post(f"{gateway}/api/chat", json=body, headers={"X-Memfilter-Resource": user}) as r:
        if r.status != 200:
            await r.read()
            return r.status, None
        ttft = None
        async for line in r.content:
            if ttft is None and line.startswith(b"data: ") and b'"text-delta"' in line:
                ttft = time.perf_counter() - started
        return 200, ttft


async def calm(http: aiohttp.ClientSession, gateway: str, turns: int, rate: float, users: int) -> list[float]:
    """The calm callers' turns, `rate` a second in all, each user's by turns (each within its share)."""
    times = []
    for n in range(turns):
        at = time.perf_counter()
        status, ttft = await first_token(http, gateway, f"calm-{n % users}")
        assert status == 200 and ttft is not None, f"the calm caller was answered {status}"
        times.append(ttft)
        await asyncio.sleep(max(0.0, 1 / rate - (time.perf_counter() - at)))
    return times


async def flood(http: aiohttp.ClientSession, gateway: str, stop: asyncio.Event, statuses: Counter) -> None:
    while not stop.is_set():
        status, _ = await first_token(http, gateway, "flooder")
        statuses[status] += 1


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--rate", type=float, default=2.0, help="the calm callers' turns a second, in all")
    parser.add_argument("--users", type=int, default=8, help="the calm callers, taking turns (each well within its share)")
    parser.add_argument("--flooders", type=int, default=20, help="the flooder's connections at once")
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    bootstrap, redis_url = os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["REDIS_URL"]
    run, topics = await own_topics(bootstrap, "fair")
    env = own_env(run, topics, os.environ.get("MEMFILTER_SECRET") or secrets.token_hex(32), MEMFILTER_GATEWAY_AUTH="header")
    port = free_port()
    commands = [["worker", "--web-port", str(free_port())], ["agent", "--web-port", str(free_port())], ["gateway", "--port", str(port)]]
    processes = [
        subprocess.Popen([sys.executable, "-m", "memfilter", *c], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands
    ]
    gateway = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            deadline = time.monotonic() + STARTED_S
            while True:  # the whole loop answers: a turn through worker, agent and gateway
                try:
                    if (await first_token(http, gateway, "warm-up"))[0] == 200:
                        break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"the gateway did not answer a turn within {STARTED_S:.0f} s")
                await asyncio.sleep(1)
            ratios: dict[str, list[float]] = {"p50": [], "p90": []}
            order = [flooded for n in range(args.pairs) for flooded in ((False, True) if n % 2 == 0 else (True, False))]
            results: list[tuple[bool, list[float]]] = []
            for flooded in order:
                stop, statuses = asyncio.Event(), Counter()
                flooders = [asyncio.create_task(flood(http, gateway, stop, statuses)) for _ in range(args.flooders if flooded else 0)]
                times = await calm(http, gateway, args.turns, args.rate, args.users)
                stop.set()
                await asyncio.gather(*flooders)
                results.append((flooded, times))
                shown = f"; the flood answered {dict(statuses)}" if flooded else ""
                print(
                    f"{'flooded' if flooded else 'calm   '}: first token p50 {percentile(times, 0.5) * 1000:.1f} ms, p90 {percentile(times, 0.9) * 1000:.1f} ms{shown}",
                    flush=True,
                )
            for n in range(args.pairs):
                pair = dict(results[2 * n : 2 * n + 2])
                for q, name in ((0.5, "p50"), (0.9, "p90")):
                    ratios[name].append(percentile(pair[True], q) / percentile(pair[False], q))
            for name, values in ratios.items():
                print(f"flooded/calm {name} by pair: {'  '.join(f'{v:.2f}' for v in values)}   median {statistics.median(values):.2f}")
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            p.wait(30)
        await clean_up(bootstrap, redis_url, list(topics.values()), run)


if __name__ == "__main__":
    asyncio.run(main())

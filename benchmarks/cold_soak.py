"""Benchmark (soak): Redis holds the active threads, PostgreSQL all of them.

On the stack's Kafka, Redis and PostgreSQL (`memfilter stack up`; KAFKA_BOOTSTRAP_SERVERS,
REDIS_URL and POSTGRES_URL as it prints), one `memfilter worker` and one `memfilter sink`:

1. seed: every thread (`--threads`, 20,000) gets its history in one request (a `useChat`
   client's first request on an empty thread seeds it: `--turns` user questions and answers);
   printed: the worker's requests/s, and the sink's threads/s into PostgreSQL, side by side;
2. idle: `--active` of the threads (10%) get a request more; the others stay idle, and are
   evicted from Redis (`memfilter.store.cold.evict`, run here with the moment between the two
   as its cut-off, as the sink runs it with MEMFILTER_IDLE_S); printed: Redis's `used_memory`
   grown since the run began and the run's keys' bytes (`MEMORY USAGE`), with every thread in
   Redis (today's layout) and after eviction, and their ratio;
3. latency, publish to filtered input at `--rate`: p50 and p99 of warm threads alone, then of
   cold threads' first requests interleaved with warm threads' (a batch waits for its cold
   loads, so the warm ones beside them pay too), and the cold loads the worker made.

    .venv/bin/python -m benchmarks.cold_soak [--threads 20000] [--active 0.1] [--turns 5] [--sample 500] [--rate 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
import uuid

import asyncpg
import msgspec
import redis.asyncio as aioredis

from benchmarks.sample_threads import echo_of, stored_thread
from benchmarks.worker_throughput import REPO, clean_up, count_until, create_topics, free_port, publish, worker_env, worker_metrics
from memfilter.store import cold
from memfilter.store.history import HistoryStore
from memfilter.store.postgres import PostgresHistory

RESOURCE = "soak-user"


def request(thread: str, messages: list[dict], tag: str) -> tuple[bytes, bytes]:
    return thread.encode(), msgspec.json.encode({"threadId": thread, "resourceId": RESOURCE, "requestId": f"{thread}-{tag}", "messages": messages})


async def key_bytes(client: aioredis.Redis, prefix: str) -> int:
    """`MEMORY USAGE` of every key of the run (its threads and its message-id index)."""
    total, batch = 0, []
    async for key in client.scan_iter(f"{prefix}:*", count=2000):
        batch.append(key)
        if len(batch) == 1000:
            total += await _usage(client, batch)
            batch = []
    return total + (await _usage(client, batch) if batch else 0)


async def _usage(client: aioredis.Redis, keys: list[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.memory_usage(k, samples=0)
    return sum(v or 0 for v in await pipe.execute())


async def held_threads(url: str, schema: str, version: int) -> int:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(f'SELECT count(*) FROM "{schema}".mastra_threads WHERE version >= $1', version)
    except asyncpg.UndefinedTableError:
        return 0
    finally:
        await conn.close()


async def until_held(url: str, schema: str, n: int, version: int, timeout: float = 1800) -> float:
    """Until PostgreSQL holds n threads at `version` or later; when (monotonic)."""
    deadline = time.monotonic() + timeout
    while await held_threads(url, schema, version) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"PostgreSQL holds {await held_threads(url, schema, version)} of {n} threads after {timeout:.0f} s")
        await asyncio.sleep(0.25)
    return time.monotonic()


async def paced_latency(args, bootstrap: str, topics: dict[str, str], kinds: dict[str, str], paced: list[tuple[bytes, bytes]]) -> None:
    """Publish at `--rate`; print p50 and p99 of publish -> filtered input by each thread's kind."""
    latencies: dict[str, list[float]] = {kind: [] for kind in kinds.values()}
    positioned = asyncio.Event()
    keyed = {t.encode(): kind for t, kind in kinds.items()}
    reading = asyncio.create_task(
        count_until(
            bootstrap, topics["filtered"], len(paced), from_end=positioned, on_record=lambda r: latencies[keyed[r.key]].append(time.time() * 1000 - r.timestamp)
        )
    )
    await positioned.wait()
    await publish(bootstrap, topics["requests"], paced, rate=args.rate)
    await reading
    for kind, got in latencies.items():
        print(
            f"  {kind}: publish -> filtered input at {args.rate:,.0f} requests/s, p50 {percentile(got, 0.5):.0f} ms, p99 {percentile(got, 0.99):.0f} ms ({len(got)} requests)"
        )


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=20_000)
    parser.add_argument("--active", type=float, default=0.1, help="share of the threads that stay in use")
    parser.add_argument("--turns", type=int, default=5, help="question-and-answer turns of each thread's history")
    parser.add_argument("--sample", type=int, default=500, help="requests to cold threads (and as many to warm ones) in the latency phase")
    parser.add_argument("--rate", type=float, default=100, help="requests/s in the latency phase")
    parser.add_argument("--partitions", type=int, default=8)
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    pg_url = os.environ.get("POSTGRES_URL", "postgresql://memfilter@127.0.0.1:5432/postgres")
    run = uuid.uuid4().hex[:8]
    prefix = f"cold-{run}"
    topics = {k: f"cold-{k}-{run}" for k in ("requests", "filtered", "persist", "dlq")}
    await create_topics(bootstrap, list(topics.values()), args.partitions)
    pg = PostgresHistory(pg_url, prefix)
    try:
        await soak(args, bootstrap, redis_url, pg_url, topics, prefix, pg)
    finally:
        await clean_up(bootstrap, redis_url, list(topics.values()), prefix)
        await pg.drop()
        await pg.close()


async def soak(args, bootstrap: str, redis_url: str, pg_url: str, topics: dict[str, str], prefix: str, pg: PostgresHistory) -> None:
    env = {**worker_env(bootstrap, redis_url, topics, prefix, 10, key=""), "POSTGRES_URL": pg_url}
    port = free_port()
    logs = f"/tmp/{prefix}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "memfilter", "worker", "--web-port", str(port)],
        env=env,
        cwd=REPO,
        stdout=open(f"{logs}-worker.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    sink_env = {**env, "MEMFILTER_SINK_GROUP": f"{prefix}-sink", "MEMFILTER_IDLE_S": "1e9"}  # eviction is this benchmark's, below
    sink = subprocess.Popen(
        [sys.executable, "-m", "memfilter", "sink"], env=sink_env, cwd=REPO, stdout=open(f"{logs}-sink.log", "wb"), stderr=subprocess.STDOUT
    )
    client = aioredis.from_url(redis_url)
    store = HistoryStore(client, prefix)
    try:
        threads = [f"s{i:06d}-{prefix}" for i in range(args.threads)]
        histories = {t: stored_thread(t, RESOURCE, args.turns, pending=False) for t in threads}
        memory_before = (await client.info("memory"))["used_memory"]

        # 1. seed every thread; the worker's rate and the sink's, side by side
        started = time.monotonic()
        reading = asyncio.create_task(count_until(bootstrap, topics["filtered"], len(threads), timeout=1800))
        await publish(bootstrap, topics["requests"], (request(t, histories[t], "seed") for t in threads))
        _, worker_done = await reading
        sink_done = await until_held(pg_url, prefix, len(threads), 1)
        rows = sum(len(h) for h in histories.values())
        print(f"seeded {len(threads):,} threads of {args.turns * 2} messages ({rows:,} rows) through one worker and one sink:")
        print(
            f"  worker {len(threads) / (worker_done - started):,.0f} requests/s; sink {len(threads) / (sink_done - started):,.0f} threads/s into PostgreSQL (from the same start)"
        )

        # 2. the active share gets a request more; the rest stays idle and leaves Redis
        full_used = (await client.info("memory"))["used_memory"] - memory_before
        full_keys = await key_bytes(client, prefix)
        await asyncio.sleep(1.5)
        cutoff_ms = int(time.time() * 1000)
        await asyncio.sleep(1.5)
        active = random.Random(1).sample(threads, int(len(threads) * args.active))
        reading = asyncio.create_task(count_until(bootstrap, topics["filtered"], len(threads) + len(active), timeout=1800))
        await publish(bootstrap, topics["requests"], (request(t, echo_of(histories[t]), "active") for t in active))
        await reading
        await until_held(pg_url, prefix, len(active), 2)
        evicting = time.monotonic()
        evicted = 0
        while (left := await cold.evict(store, pg, cutoff_ms, 1000)) > 0:
            evicted += left
        took = time.monotonic() - evicting
        await asyncio.sleep(1)  # Redis frees lazily deleted keys in the background
        cold_used = (await client.info("memory"))["used_memory"] - memory_before
        cold_keys = await key_bytes(client, prefix)
        print(f"{evicted:,} idle threads evicted in {took:.1f} s ({evicted / max(took, 1e-9):,.0f}/s); {len(active):,} active stay")
        print("  Redis used_memory grown since the run began / the run's keys (MEMORY USAGE):")
        print(f"    every thread in Redis (today's layout): {full_used / 1e6:,.1f} MB / {full_keys / 1e6:,.1f} MB")
        print(f"    active threads in Redis, idle ones in PostgreSQL: {cold_used / 1e6:,.1f} MB / {cold_keys / 1e6:,.1f} MB")
        print(f"    ratio: {cold_used / max(full_used, 1):.2f} / {cold_keys / max(full_keys, 1):.2f}")

        # 3. latency: warm threads alone, then cold threads' first requests interleaved with warm ones
        idle = sorted(set(threads) - set(active))
        sample_cold = random.Random(2).sample(idle, min(args.sample, len(idle)))
        sample_warm = random.Random(3).sample(active, min(2 * args.sample, len(active)))
        alone, mixed = sample_warm[: len(sample_warm) // 2], sample_warm[len(sample_warm) // 2 :]
        await paced_latency(args, bootstrap, topics, {t: "warm, alone" for t in alone}, [request(t, echo_of(histories[t]), "late") for t in alone])
        loads_before = worker_metrics(port).get("memfilter_cold_loads_total", 0)
        kinds = {t: "cold" for t in sample_cold} | {t: "warm, among cold" for t in mixed}
        await paced_latency(args, bootstrap, topics, kinds, [request(t, echo_of(histories[t]), "late") for pair in zip(sample_cold, mixed) for t in pair])
        loads = worker_metrics(port).get("memfilter_cold_loads_total", 0) - loads_before
        print(f"  the worker loaded {loads:,.0f} threads back from PostgreSQL")
    finally:
        await client.aclose()
        for p in (sink, worker):
            p.terminate()
            p.wait(30)


if __name__ == "__main__":
    asyncio.run(main())

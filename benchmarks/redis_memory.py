"""Benchmark (soak): what Redis holds as a conversation log grows, over 200,000 requests.

2,000 threads keep talking through the whole run, 100 requests each, turn by turn. Each request
carries only the user's new message, as a client that trims what it sends (the AI SDK's
`prepareSendMessagesRequest`) does, so the topics stay small and every request saves one row.
One worker processes them from a backlog, on the stack's Kafka and Redis (`memfilter stack
up`; KAFKA_BOOTSTRAP_SERVERS and REDIS_URL as it prints).

After each tenth of the requests comes out, it prints how much Redis memory the run's keys take,
by kind (`MEMORY USAGE` of each key): rows, order lists, meta, processed-request records not yet
dropped (`pending`), retry windows (`recent`), applied-save identities (`saved`), the
message-id index (`ids`); the rows' own JSON bytes; and the share of everything but rows and
order lists, of the keys' bytes and of Redis's `used_memory` (grown since the run began). The
goal (issue 14): that share stays at most 10%, whatever the number of requests. At the end,
the worker's throughput, the bytes per request and the CPU per request of the worker and of
Redis (not counting this benchmark's own reads).

    .venv/bin/python -m benchmarks.redis_memory [--threads 2000] [--turns 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import uuid

import msgspec
import redis.asyncio as aioredis

from benchmarks.worker_throughput import REPO, clean_up, count_until, create_topics, free_port, publish, worker_env
from memfilter.core.filter import HISTORY_MESSAGES

KINDS = ("rows", "order", "meta", "pending", "recent", "saved", "ids", "other")


def requests(threads: int, turns: int):
    for turn in range(turns):
        for t in range(threads):
            thread = f"soak-{t}"
            text = f"Message {turn} of this conversation: what should I pack for three days in Lisbon in March?"
            message = {"id": f"{thread}-u{turn}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": text}]}}
            body = {"requestId": f"{thread}-r{turn}", "threadId": thread, "resourceId": f"user-{t % 500}", "messages": [message]}
            yield thread.encode(), msgspec.json.encode(body)


def kind_of(key: bytes) -> str:
    if b":idx:{" in key:
        return "ids"
    if b":pending:" in key:
        return "pending"
    for kind in ("rows", "order", "meta", "recent", "saved"):
        if key.endswith(b":" + kind.encode()):
            return kind
    return "other"


async def usage(client: aioredis.Redis, prefix: str) -> tuple[dict[str, int], int]:
    """(bytes by kind of key, the rows' own JSON bytes) of the run's keys."""
    keys = [key async for key in client.scan_iter(f"{prefix}:*", count=2000)]
    by_kind, row_bytes = dict.fromkeys(KINDS, 0), 0
    for start in range(0, len(keys), 1000):
        chunk = keys[start : start + 1000]
        async with client.pipeline(transaction=False) as pipe:
            for key in chunk:
                pipe.memory_usage(key, samples=0)
            for key in chunk:
                if key.endswith(b":rows"):
                    pipe.hvals(key)
            results = await pipe.execute()
        for key, size in zip(chunk, results):
            by_kind[kind_of(key)] += size or 0
        row_bytes += sum(len(v) for values in results[len(chunk) :] for v in values)
    return by_kind, row_bytes


def process_cpu(pid: int) -> float:
    """Seconds of CPU a process has used (Linux: /proc/PID/stat, user and system)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def redis_cpu(client: aioredis.Redis) -> float:
    """Seconds of CPU the Redis server has used (INFO cpu: its main thread and the rest)."""
    cpu = await client.info("cpu")
    return cpu["used_cpu_sys"] + cpu["used_cpu_user"]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2_000)
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--partitions", type=int, default=8)
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    run = uuid.uuid4().hex[:8]
    topics = {k: f"soak-{k}-{run}" for k in ("requests", "filtered", "persist", "dlq")}
    prefix = f"soak-{run}"
    await create_topics(bootstrap, list(topics.values()), args.partitions)
    try:
        await soak(args, bootstrap, redis_url, topics, prefix)
    finally:
        await clean_up(bootstrap, redis_url, list(topics.values()), prefix)


async def soak(args, bootstrap: str, redis_url: str, topics: dict[str, str], prefix: str) -> None:
    total = args.threads * args.turns
    await publish(bootstrap, topics["requests"], requests(args.threads, args.turns))
    print(f"workload: {total:,} requests, {args.threads:,} threads of {args.turns} turns, one new user message each")
    env = worker_env(bootstrap, redis_url, topics, prefix, HISTORY_MESSAGES, key="")
    worker = subprocess.Popen(
        [sys.executable, "-m", "memfilter", "worker", "--web-port", str(free_port())],
        env=env,
        cwd=REPO,
        stdout=open(f"/tmp/{prefix}-worker.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    client = aioredis.from_url(redis_url)
    header = f"{'requests':>9} {'used_memory':>12} " + " ".join(f"{k:>8}" for k in KINDS) + f" {'row JSON':>8} {'not rows: keys':>14} {'used':>5}"
    print("Redis bytes of the run's keys, by kind (MB), after each tenth:")
    print(header)
    try:
        reached = asyncio.Queue()
        seen = [0]

        def counted(_record) -> None:
            seen[0] += 1
            if seen[0] % (total // 10) == 0:
                reached.put_nowait(seen[0])

        reading = asyncio.create_task(count_until(bootstrap, topics["filtered"], total, on_record=counted, timeout=3600))
        baseline = (await client.info("memory"))["used_memory"]
        cpu_before = await redis_cpu(client)
        for _ in range(10):
            done = await reached.get()
            used = (await client.info("memory"))["used_memory"] - baseline  # before `usage`, whose replies Redis buffers
            measuring = await redis_cpu(client)
            by_kind, row_bytes = await usage(client, prefix)
            cpu_before += await redis_cpu(client) - measuring  # not the worker's
            whole = sum(by_kind.values())
            history = by_kind["rows"] + by_kind["order"]
            print(
                f"{done:>9,} {used / 1e6:>12.1f} "
                + " ".join(f"{by_kind[k] / 1e6:>8.2f}" for k in KINDS)
                + f" {row_bytes / 1e6:>8.1f} {(whole - history) / max(whole, 1):>14.1%} {(used - history) / max(used, 1):>5.1%}",
                flush=True,
            )
        first, last = await reading
        redis_cpu_s = await redis_cpu(client) - cpu_before
        worker_cpu_s = process_cpu(worker.pid)
        print(
            f"worker: {total / (last - first):,.0f} requests/s over the run ({last - first:.0f} s); "
            f"per request: {whole / total:,.0f} bytes of Redis keys, {row_bytes / total:,.0f} of them row JSON, "
            f"{(whole - history) / total:,.1f} beyond rows and order lists"
        )
        print(
            f"CPU a request: worker {worker_cpu_s / total * 1e6:.0f} µs, Redis {redis_cpu_s / total * 1e6:.0f} µs "
            f"(one Redis core: {total / max(redis_cpu_s, 1e-9):,.0f} requests/s)"
        )
    finally:
        await client.aclose()
        worker.terminate()
        worker.wait(30)


if __name__ == "__main__":
    asyncio.run(main())

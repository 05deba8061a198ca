"""Benchmark: does the store's private reply path still pay? One round trip of a batch's
commands, read by `memfilter.store.redis_driver.send` (straight from the hiredis reader) and by
redis-py's own pipeline (`pipeline(transaction=False).execute(raise_on_error=False)`), side by
side on the same Redis, alternated, the worker's CPU per command printed for each and as a ratio.

The commands are a batch's reads as the processor sends them (per thread: HMGET of the meta,
HLEN, HMGET of rows, HKEYS, GET, LRANGE), on threads written first.

    .venv/bin/python -m benchmarks.redis_replies [--redis-url redis://127.0.0.1:6379/0] [--threads 250] [--rounds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import redis.asyncio as aioredis

from memfilter.store import redis_driver


def commands_for(prefix: str, threads: int) -> list[tuple]:
    out: list[tuple] = []
    for t in range(threads):
        base = f"{prefix}:t:{{t{t}}}"
        out += [
            ("HMGET", f"{base}:meta", "owner", "version", "newest"),
            ("HLEN", f"{base}:rows"),
            ("HMGET", f"{base}:rows", *(f"m{k}" for k in range(6))),
            ("HKEYS", f"{base}:superseded"),
            ("GET", f"{base}:recent"),
            ("LRANGE", f"{base}:order", -10, -1),
        ]
    return out


async def fill(client: aioredis.Redis, prefix: str, threads: int) -> None:
    pipe = client.pipeline(transaction=False)
    row = b'{"id":"m","role":"user","content":{"format":2,"parts":[{"type":"text","text":"' + b"x" * 200 + b'"}]}}'
    for t in range(threads):
        base = f"{prefix}:t:{{t{t}}}"
        pipe.hset(f"{base}:meta", mapping={"owner": "r1", "version": 12, "newest": 1772366400000})
        pipe.hset(f"{base}:rows", mapping={f"m{k}": row for k in range(12)})
        pipe.rpush(f"{base}:order", *(f"m{k}" for k in range(12)))
        pipe.set(f"{base}:recent", b"\x00" * 224)
    await pipe.execute()


async def private_path(client: aioredis.Redis, commands: list[tuple]) -> list:
    return await redis_driver.send(client, commands)


async def redis_py_path(client: aioredis.Redis, commands: list[tuple]) -> list:
    pipe = client.pipeline(transaction=False)
    for c in commands:
        pipe.execute_command(*c)
    return await pipe.execute(raise_on_error=False)


async def main(args: argparse.Namespace) -> None:
    client = redis_driver.connect(args.redis_url)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    await fill(client, prefix, args.threads)
    commands = commands_for(prefix, args.threads)
    assert len(await private_path(client, commands)) == len(await redis_py_path(client, commands)) == len(commands)
    cpu = {"private (hiredis reader)": 0.0, "redis-py pipeline": 0.0}
    paths = {"private (hiredis reader)": private_path, "redis-py pipeline": redis_py_path}
    for _ in range(args.rounds):
        for name, path in paths.items():  # alternated, so drift hits both alike
            start = time.process_time()
            await path(client, commands)
            cpu[name] += time.process_time() - start
    n = args.rounds * len(commands)
    for name, seconds in cpu.items():
        print(f"{name:28s} {seconds / n * 1e6:6.2f} µs of CPU per command ({n:,} commands)")
    print(f"redis-py pipeline / private: {cpu['redis-py pipeline'] / cpu['private (hiredis reader)']:.2f}x")
    keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=1000)]
    for i in range(0, len(keys), 1000):
        await client.unlink(*keys[i : i + 1000])
    await client.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--threads", type=int, default=250, help="threads per batch (6 commands each)")
    parser.add_argument("--rounds", type=int, default=40)
    asyncio.run(main(parser.parse_args()))

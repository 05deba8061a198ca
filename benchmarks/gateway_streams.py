"""Benchmark: many reply streams held by one gateway: its memory per stream, CPU per relayed
chunk and time to first chunk at each count, and what clients that stop reading cost it.

On the stack's Kafka and Redis (`memfilter stack up`), one `memfilter gateway` (header
identity) on topics of the run's own, and no worker or agent runner: this process plays the
agent runner, publishing signed replies on `reply-streams` (`memfilter.core.origin`), so the
gateway alone is measured. For each count N (`--streams`, 100,300,1000): N replies begin, N
clients (each a user of its own) resume them (`GET /api/chat/{id}/stream`, as the AI SDK's
client does on a reload, reading the UI message stream line by line), and each reply goes on
for `--seconds`, `--rate` chunks a second, each carrying the time it was published. Printed
for each N: the time from a resume to its first chunk (p50, p99), a chunk's time from publish
to the client (p50, p99), the gateway's memory (RSS) grown per stream while they are held, and
its CPU per chunk relayed.

Then `--stalled` replies of large chunks (64 KB, 8 a second), followed by clients that read
them, then by clients that never read: the gateway holds every reply being made whole (so a
resume replays it from its start), and what a client that stops reading must not add to that is
compared (a write that waits WRITE_STALL_S for its client ends the stream:
`memfilter_gateway_requests_total{outcome="stalled"}`).

    eval "$(memfilter stack up)"
    .venv/bin/python -m benchmarks.gateway_streams [--streams 100,300,1000] [--seconds 20] [--rate 2] [--stalled 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import aiohttp
import msgspec
from aiokafka import AIOKafkaProducer

from benchmarks.worker_throughput import REPO, clean_up, cpu_seconds, free_port, own_env, own_topics, rss_mb
from memfilter.core import origin
from memfilter.gateway.server import WRITE_STALL_S
from memfilter.schemas.wire import ReplyChunk


class Agent:
    """Replies on `reply-streams`, as the agent runner makes them: each attempt signed."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, secret: bytes):
        self.producer, self.topic, self.secret = producer, topic, secret

    async def send(self, thread: str, user: str, chunk: dict) -> None:
        attempt = origin.attempt(self.secret, f"{thread}-q", thread, user, "n0")
        await self.producer.send(self.topic, msgspec.json.encode(ReplyChunk(f"{thread}-q", thread, user, attempt, chunk)), key=thread.encode())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def follow(http: aiohttp.ClientSession, gateway: str, thread: str, user: str, firsts: list[float], latencies: list[float]) -> None:
    """A client resuming the thread's reply, reading it to its end."""
    started = time.perf_counter()
    for _ in range(100):  # until the gateway has read the reply's start
        async with http.get(f"{gateway}/api/chat/{thread}/stream", headers={"X-Memfilter-Resource": user}) as r:
            if r.status == 204:
                await asyncio.sleep(0.05)
                continue
            assert r.status == 200, r.status
            first = True
            async for line in r.content:
                if not line.startswith(b'data: {"type":"text-delta"'):
                    continue
                if first:
                    firsts.append(time.perf_counter() - started)
                    first = False
                sent = float(json.loads(line[6:])["delta"])
                latencies.append(time.time() - sent)
            return
    raise RuntimeError(f"the gateway never knew the reply in {thread}")


def gateway_port_metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        out = {}
        for line in page.read().decode().splitlines():
            if line.startswith("memfilter_gateway_requests_total"):
                out[line.split("outcome=")[1].split('"')[1]] = float(line.split()[-1])
        return out


async def held(args, agent: Agent, gateway: str, pid: int, n: int) -> None:
    threads = [(f"s{n}-{i}-{uuid.uuid4().hex[:6]}", f"user-{i}") for i in range(n)]
    for thread, user in threads:
        await agent.send(thread, user, {"type": "start", "messageId": f"{thread}-a"})
        await agent.send(thread, user, {"type": "text-start", "id": "t"})
    await agent.producer.flush()
    idle_rss, firsts, latencies = rss_mb(pid), [], []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None)) as http:
        clients = [asyncio.create_task(follow(http, gateway, thread, user, firsts, latencies)) for thread, user in threads]
        cpu_before, peak = cpu_seconds(pid), idle_rss
        for _ in range(int(args.seconds * args.rate)):
            at = time.monotonic()
            for thread, user in threads:
                await agent.send(thread, user, {"type": "text-delta", "id": "t", "delta": repr(time.time())})
            await agent.producer.flush()
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(max(0.0, 1 / args.rate - (time.monotonic() - at)))
        for thread, user in threads:
            await agent.send(thread, user, {"type": "text-end", "id": "t"})
            await agent.send(thread, user, {"type": "error", "errorText": "the benchmark's reply ends here"})
        await agent.producer.flush()
        await asyncio.gather(*clients)
        cpu = cpu_seconds(pid) - cpu_before
    chunks = len(latencies)
    print(
        f"{n:>5} streams: resume to first chunk p50 {percentile(firsts, 0.5) * 1000:.0f} ms, p99 {percentile(firsts, 0.99) * 1000:.0f} ms; "
        f"publish to client p50 {percentile(latencies, 0.5) * 1000:.1f} ms, p99 {percentile(latencies, 0.99) * 1000:.1f} ms; "
        f"memory {(peak - idle_rss) * 1024 / n:.1f} KB a stream (RSS {idle_rss:.0f} -> {peak:.0f} MB); "
        f"CPU {cpu / max(chunks, 1) * 1e6:.0f} us a chunk ({chunks:,} chunks relayed)",
        flush=True,
    )


async def big_replies(args, agent: Agent, gateway: str, port: int, pid: int, reading: bool) -> float:
    """`--stalled` replies of 64 KB chunks, 8 a second, followed by clients that read them or
    that never read (sockets with a small receive buffer, left alone); the gateway's RSS grown
    at most, printed with how many streams were cut as stalled. The gateway holds every reply
    being made whole (a resume replays it from its start): what a client that stops reading
    must not add to that is what this compares."""
    threads = [(f"big-{i}-{uuid.uuid4().hex[:6]}", f"big-{i}-{reading}") for i in range(args.stalled)]
    for thread, user in threads:
        await agent.send(thread, user, {"type": "start", "messageId": f"{thread}-a"})
        await agent.send(thread, user, {"type": "text-start", "id": "t"})
    await agent.producer.flush()
    await asyncio.sleep(1)
    sockets, readers = [], []
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None))
    for thread, user in threads:
        if reading:
            readers.append(asyncio.create_task(drain(http, gateway, thread, user)))
            continue
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(f"GET /api/chat/{thread}/stream HTTP/1.1\r\nHost: x\r\nX-Memfilter-Resource: {user}\r\n\r\n".encode())
        sockets.append(s)
    before, cut_before, peak = rss_mb(pid), gateway_port_metrics(port).get("stalled", 0), 0.0
    big = "x" * 65536
    seconds = WRITE_STALL_S + 10
    for _ in range(int(seconds * 8)):
        for thread, user in threads:
            await agent.send(thread, user, {"type": "text-delta", "id": "t", "delta": big})
        await agent.producer.flush()
        peak = max(peak, rss_mb(pid))
        await asyncio.sleep(1 / 8)
    for thread, user in threads:
        await agent.send(thread, user, {"type": "error", "errorText": "the benchmark's reply ends here"})
    await agent.producer.flush()
    await asyncio.gather(*readers)
    await http.close()
    for s in sockets:
        s.close()
    cut = gateway_port_metrics(port).get("stalled", 0) - cut_before
    made = args.stalled * seconds * 8 * 65536 / 2**20
    print(
        f"{args.stalled} clients {'reading' if reading else 'that never read'}, {made:,.0f} MB of replies ({seconds:.0f} s of 64 KB chunks, 8 a second each): "
        f"gateway RSS grew {peak - before:.0f} MB at most; {cut:.0f} streams cut as stalled",
        flush=True,
    )
    return peak - before


async def drain(http: aiohttp.ClientSession, gateway: str, thread: str, user: str) -> None:
    async with http.get(f"{gateway}/api/chat/{thread}/stream", headers={"X-Memfilter-Resource": user}) as r:
        async for _ in r.content.iter_any():
            pass


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="100,300,1000")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=2.0, help="chunks a second a stream")
    parser.add_argument("--stalled", type=int, default=20)
    args = parser.parse_args()
    bootstrap, redis_url = os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["REDIS_URL"]
    run, topics = await own_topics(bootstrap, "streams")
    secret = secrets.token_hex(32)
    env = own_env(run, topics, secret, MEMFILTER_GATEWAY_AUTH="header")
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, acks=1)
    await producer.start()
    agent = Agent(producer, topics["reply-streams"], secret.encode())

    async def measured(phase):
        """`phase(gateway, port, pid)` on a gateway process of its own (so no phase reuses another's memory)."""
        port = free_port()
        log = open(f"/tmp/{run}-gateway.log", "ab")
        process = subprocess.Popen([sys.executable, "-m", "memfilter", "gateway", "--port", str(port)], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(600):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                        break
                except OSError:
                    await asyncio.sleep(0.1)
            return await phase(f"http://127.0.0.1:{port}", port, process.pid)
        finally:
            process.terminate()
            process.wait(30)

    try:
        for n in (int(x) for x in args.streams.split(",")):
            await measured(lambda gateway, port, pid, n=n: held(args, agent, gateway, pid, n))
        if args.stalled:
            read = await measured(lambda gateway, port, pid: big_replies(args, agent, gateway, port, pid, reading=True))
            stalled = await measured(lambda gateway, port, pid: big_replies(args, agent, gateway, port, pid, reading=False))
            print(f"what clients that stop reading add to the gateway's memory: {stalled - read:+.0f} MB")
    finally:
        await producer.stop()
        await clean_up(bootstrap, redis_url, list(topics.values()), run)


if __name__ == "__main__":
    asyncio.run(main())

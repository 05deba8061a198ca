"""The workload's clients, and what the checker reads after.

`Clients.watch` notes when each outcome arrives, while `Clients.run` publishes turns straight onto `chat-requests` from the test process (a producer
with acks=all and idempotence, as a `useChat` backend publishes): `threads` threads, turn k of
each the full echo of its user messages u0..uk, `rate` turns a second in all, and records what
each publish was told (`checker.Sent`). `read` then takes every record of `filtered-inputs`, the
dead-letter topic (`chat-requests-dlq`) and `persist-messages` (read_committed, as downstream reads), and each
thread's stored order from Redis (`mf:t:{<thread>}:order`, docs: store/layout.py's table);
`kept`, its messages in PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import asyncpg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from checker import Outcome, Sent, outcome_of
from redis.asyncio.cluster import RedisCluster

PUBLISH_TIMEOUT_S = 10.0


class Clients:
    def __init__(self, bootstrap: str, threads: int, turns: int):
        self.bootstrap = bootstrap
        tag = secrets.token_hex(3)
        self.threads = [f"jt-{tag}-{i}" for i in range(threads)]
        self.turns = turns
        self.sent: list[Sent] = []
        self.answered: dict[tuple[int, int], float] = {}  # a request's position -> when its outcome arrived (epoch s)
        self.watching = asyncio.Event()

    def request(self, thread: str, k: int) -> tuple[str, list[str], bytes]:
        ids = [f"{thread}-u{i}" for i in range(k + 1)]
        messages = [{"id": m, "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"question {i}"}]}} for i, m in enumerate(ids)]
        request_id = f"{thread}-r{k}"
        body = {"requestId": request_id, "threadId": thread, "resourceId": f"res-{thread}", "messages": messages}
        return request_id, ids, json.dumps(body).encode()

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: when each outcome arrives (`answered`, by the request's position), read
        as downstream reads, from the topics' ends at the start."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, isolation_level="read_committed", enable_auto_commit=False, group_id=None)
        await consumer.start()
        try:
            kinds = {"filtered-inputs": "filtered", "chat-requests-dlq": "dlq"}
            tps = [TopicPartition(t, p) for t, ps in (await _partitions(self.bootstrap, list(kinds))).items() for p in ps]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            self.watching.set()
            while not stop.is_set():
                for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                    for r in records:
                        headers = {k: v.decode(errors="replace") for k, v in r.headers or ()}
                        if (o := outcome_of(kinds[tp.topic], r.partition, r.offset, r.key, r.value, headers)) is not None:
                            self.answered.setdefault(o.at, time.time())
        finally:
            await consumer.stop()

    async def run(self, rate: float) -> None:
        """Every turn of every thread, in order within a thread, `rate` a second in all."""
        await self.watching.wait()
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True, request_timeout_ms=int(PUBLISH_TIMEOUT_S * 1000))
        await producer.start()
        try:
            started = time.monotonic()
            pending = []
            for n in range(self.turns * len(self.threads)):
                await asyncio.sleep(max(0.0, started + n / rate - time.monotonic()))
                thread, k = self.threads[n % len(self.threads)], n // len(self.threads)
                request_id, ids, value = self.request(thread, k)
                sent = Sent(thread, k, request_id, ids, None, int(time.time() * 1000))
                self.sent.append(sent)
                pending.append(asyncio.create_task(self._publish(producer, sent, value)))
            await asyncio.gather(*pending)
        finally:
            await producer.stop()

    async def _publish(self, producer: AIOKafkaProducer, sent: Sent, value: bytes) -> None:
        try:
            meta = await asyncio.wait_for(await producer.send("chat-requests", value, key=sent.thread.encode()), PUBLISH_TIMEOUT_S * 2)
            sent.at = (meta.partition, meta.offset)
        except Exception:  # not acknowledged: it may or may not be on the topic (the checker allows either)
            sent.at = None


async def read(bootstrap: str, redis_url: str, threads: list[str]) -> tuple[list[Outcome], dict[str, list[tuple[str, list[str]]]], dict[str, list[str]]]:
    """Every outcome of `threads`, their saves (message ids, in log order) and stored orders."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False, group_id=None)
    await consumer.start()
    outcomes: list[Outcome] = []
    ours = set(threads)  # the topics hold earlier runs' too
    saved: dict[str, list[tuple[str, list[str]]]] = {}
    try:
        kinds = {"filtered-inputs": "filtered", "chat-requests-dlq": "dlq", "persist-messages": "persist"}
        tps = [TopicPartition(t, p) for t, ps in (await _partitions(bootstrap, list(kinds))).items() for p in ps]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                for r in records:
                    kind = kinds[tp.topic]
                    if kind == "persist":
                        event = json.loads(r.value)
                        saved.setdefault(event.get("threadId", ""), []).append((event.get("requestId", ""), [m.get("id") for m in event.get("messages", [])]))
                        continue
                    headers = {k: v.decode(errors="replace") for k, v in r.headers or ()}
                    if (o := outcome_of(kind, r.partition, r.offset, r.key, r.value, headers)) is not None and o.thread in ours:
                        outcomes.append(o)
    finally:
        await consumer.stop()
    # a Redis Cluster's URL (`redis+cluster://host:port,...`): redis-py's cluster client, from its first node
    client = (
        RedisCluster.from_url("redis://" + redis_url.split("://", 1)[1].split(",")[0])
        if redis_url.startswith("redis+cluster")
        else aioredis.from_url(redis_url)
    )
    try:
        stored = {t: [m.decode() for m in await client.lrange(f"mf:t:{{{t}}}:order", 0, -1)] for t in threads}
    finally:
        await client.aclose()
    return outcomes, saved, stored


async def kept(postgres_url: str, threads: list[str]) -> dict[str, list[str]]:
    """Each thread's messages in PostgreSQL, in their places (`mf.mastra_messages.position`;
    docs/postgres.md), as the sink wrote them."""
    connection = await asyncpg.connect(postgres_url, timeout=10)
    try:
        rows = await connection.fetch(
            "SELECT thread_id, id FROM mf.mastra_messages WHERE thread_id = ANY($1) AND position IS NOT NULL ORDER BY thread_id, position", threads
        )
    except asyncpg.UndefinedTableError:  # nothing written yet
        rows = []
    finally:
        await connection.close()
    found: dict[str, list[str]] = {t: [] for t in threads}
    for row in rows:
        found[row["thread_id"]].append(row["id"])
    return found


async def _partitions(bootstrap: str, topics: list[str]) -> dict[str, list[int]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {t["topic"]: sorted(p["partition"] for p in t["partitions"]) for t in await admin.describe_topics(topics)}
    finally:
        await admin.close()

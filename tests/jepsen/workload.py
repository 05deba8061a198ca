"""The workload's clients, and what the checker reads after.

`Clients.run` publishes turns straight onto `chat-requests` from the test process (a producer
with acks=all and idempotence, as a `useChat` backend publishes): `threads` threads, turn k of
each the full echo of its user messages u0..uk, `rate` turns a second in all, and records what
each publish was told (`checker.Sent`). `read` then takes every record of `filtered-inputs`, the
dead-letter topic and `persist-messages` (read_committed, as downstream reads), and each
thread's stored order from Redis (`mf:t:{<thread>}:order`, docs: store/layout.py's table).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from checker import Outcome, Sent, outcome_of

PUBLISH_TIMEOUT_S = 10.0


class Clients:
    def __init__(self, bootstrap: str, threads: int, turns: int):
        self.bootstrap = bootstrap
        tag = secrets.token_hex(3)
        self.threads = [f"jt-{tag}-{i}" for i in range(threads)]
        self.turns = turns
        self.sent: list[Sent] = []

    def request(self, thread: str, k: int) -> tuple[str, list[str], bytes]:
        ids = [f"{thread}-u{i}" for i in range(k + 1)]
        messages = [{"id": m, "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"question {i}"}]}} for i, m in enumerate(ids)]
        request_id = f"{thread}-r{k}"
        body = {"requestId": request_id, "threadId": thread, "resourceId": f"res-{thread}", "messages": messages}
        return request_id, ids, json.dumps(body).encode()

    async def run(self, rate: float) -> None:
        """Every turn of every thread, in order within a thread, `rate` a second in all."""
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


async def read(bootstrap: str, redis_url: str, threads: list[str]) -> tuple[list[Outcome], dict[str, list[list[str]]], dict[str, list[str]]]:
    """Every outcome, every thread's saves (message ids, in log order) and stored order."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False, group_id=None)
    await consumer.start()
    outcomes: list[Outcome] = []
    saved: dict[str, list[list[str]]] = {}
    try:
        kinds = {"filtered-inputs": "filtered", "dlq": "dlq", "persist-messages": "persist"}
        tps = [TopicPartition(t, p) for t in kinds for p in sorted(consumer.partitions_for_topic(t) or await _partitions(consumer, t))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while any(await consumer.position(tp) < ends[tp] for tp in tps):
            for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                for r in records:
                    kind = kinds[tp.topic]
                    if kind == "persist":
                        event = json.loads(r.value)
                        saved.setdefault(event.get("threadId", ""), []).append([m.get("id") for m in event.get("messages", [])])
                        continue
                    headers = {k: v.decode(errors="replace") for k, v in r.headers or ()}
                    if (o := outcome_of(kind, r.partition, r.offset, r.key, r.value, headers, r.timestamp)) is not None:
                        outcomes.append(o)
    finally:
        await consumer.stop()
    client = aioredis.from_url(redis_url)
    try:
        stored = {t: [m.decode() for m in await client.lrange(f"mf:t:{{{t}}}:order", 0, -1)] for t in threads}
    finally:
        await client.aclose()
    return outcomes, saved, stored


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await consumer.topics()
    return consumer.partitions_for_topic(topic) or set()

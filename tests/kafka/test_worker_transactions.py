"""What a dead or stalled worker leaves in Kafka: its transactions, aborted or fenced.

A worker sends each batch's outputs and offsets in one transaction per task (partition p of
both input topics), with the task's transactional id; a worker given a task after another so
aborts the transaction the other left open and fences it out. Here the other worker is played
by a bare producer with such an id, whose transaction would otherwise stay open for ten
minutes and hold up every `read_committed` consumer of the partitions it wrote to. And where
a transaction's records land: the worker notes it, to pass over its own events when it reads
them back.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from factories import T0
from pipeline import Collector, publish

from memfilter.runtime.loop import _send
from memfilter.runtime.records import Out
from memfilter.runtime.worker import transactional_id
from memfilter.runtime.written import Written


def requests(n: int) -> list[tuple[bytes, bytes, int]]:
    return [
        (
            f"tx{i}".encode(),
            json.dumps(
                {
                    "requestId": f"tx{i}-r0",
                    "threadId": f"tx{i}",
                    "resourceId": "r1",
                    "messages": [{"id": f"tx{i}-u0", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "hi"}]}}],
                }
            ).encode(),
            T0,
        )
        for i in range(20)
    ]


async def left_open(pipeline, partition: int) -> AIOKafkaProducer:
    """A producer with the transactional id of a task, mid-transaction:
    one record on every `filtered-inputs` partition, not committed."""
    t = pipeline.topics
    group = pipeline.env()["MEMFILTER_GROUP"]
    producer = AIOKafkaProducer(
        bootstrap_servers=pipeline.bootstrap,
        transactional_id=transactional_id(group, partition),
        transaction_timeout_ms=600_000,
    )
    await producer.start()
    await producer.begin_transaction()
    for p in range(pipeline.partitions):
        await producer.send_and_wait(t.filtered, b'{"left": "open"}', partition=p)
    return producer


@pytest.mark.parametrize("partition", [0, 5], ids=["the first task", "another task"])
def test_a_transaction_left_open_is_aborted_when_a_worker_takes_up_its_id(pipeline, partition):
    t = pipeline.topics

    async def run():
        dead = await left_open(pipeline, partition)
        try:
            async with Collector(pipeline.bootstrap, [t.filtered], isolation_level="read_committed") as committed:
                pipeline.start_worker()
                await publish(pipeline.bootstrap, t.requests, requests(20))
                assert await committed.wait_for(lambda recs: len(recs) >= 20), "the open transaction still holds up the topic"
                await asyncio.sleep(1)
                seen = [r.value for r in committed.records]
            with pytest.raises(KafkaError):  # fenced: it can never commit what it sent
                await dead.commit_transaction()
            return seen
        finally:
            await dead.stop()

    seen = asyncio.run(run())
    assert sorted(json.loads(v)["requestId"] for v in seen) == sorted(f"tx{i}-r0" for i in range(20))


def test_the_offsets_a_transaction_notes_are_exactly_where_its_records_are_read(pipeline):
    """The worker passes over its own persist events by the offsets its transactions noted
    (`memfilter.runtime.written`), without verifying them: an offset noted wrongly would pass
    over another writer's save. Here a transaction's records go out in two sends, each split
    into batches by size, with another producer's records appended to the same partitions
    before, between and after; then a read_committed consumer finds the transaction's
    records exactly at the offsets noted, and the other producer's at none."""
    t = pipeline.topics

    async def run():
        mine = AIOKafkaProducer(bootstrap_servers=pipeline.bootstrap, transactional_id=f"{pipeline.prefix}-written", max_batch_size=16 << 10)
        other = AIOKafkaProducer(bootstrap_servers=pipeline.bootstrap)
        await mine.start()
        await other.start()
        written = Written()
        try:

            async def others(tag: str) -> None:
                for p in range(pipeline.partitions):
                    await other.send_and_wait(t.persist, f"other {tag}".encode(), key=b"o", partition=p)

            await others("before")
            await mine.begin_transaction()
            for send in ("first", "second"):
                outs = [Out(t.persist, f"thread-{i}".encode(), f"mine {send} {i} ".encode() * 700, T0) for i in range(40)]
                for tp, first, count in await _send(mine, outs):
                    written.add(tp, first, count)
                await others(f"after the {send} send")
            await mine.commit_transaction()
            await others("after the commit")
        finally:
            await mine.stop()
            await other.stop()
        async with Collector(pipeline.bootstrap, [t.persist], isolation_level="read_committed") as committed:
            assert await committed.wait_for(lambda recs: len(recs) >= 80 + 4 * pipeline.partitions)
            await asyncio.sleep(1)
            return committed.records, written

    records, written = asyncio.run(run())
    ours = {(r.partition, r.offset) for r in records if r.value.startswith(b"mine")}
    assert len(ours) == 80
    assert {(r.partition, r.offset) for r in records if written.holds(TopicPartition(t.persist, r.partition), r.offset)} == ours

"""What a dead or stalled worker leaves in Kafka: its transactions, aborted or fenced.

A worker sends each batch's outputs and offsets in one transaction per task (partition p of
both input topics), with the task's transactional id; a worker given a task after another so
aborts the transaction the other left open and fences it out. Here the other worker is played
by a bare producer with such an id, whose transaction would otherwise stay open for ten
minutes and hold up every `read_committed` consumer of the partitions it wrote to.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from factories import T0
from pipeline import Collector, publish

from memfilter.runtime.worker import transactional_id


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

"""A group's committed offsets are read only once stable (`memfilter.runtime.kafka_driver`).

A member that takes a partition while the previous owner's last transaction still holds offsets
of it, sent and not yet committed, waits for that transaction and starts after its records.
aiokafka's own reading (OffsetFetch version 3, which cannot ask for stable offsets) gives the
offset from before the transaction, so the transaction's records would be handled again.
"""

from __future__ import annotations

import asyncio
import uuid

from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from memfilter.runtime import kafka_driver


async def read_while_a_transaction_holds_an_offset(bootstrap: str) -> tuple[int, bool, int]:
    """Offset 5 committed, then a transaction sends offset 10 and waits: what aiokafka's own
    reading gives meanwhile, whether `committed()` was still waiting a second later, and what
    it gives once the transaction commits."""
    topic, group = f"stable-{uuid.uuid4().hex[:8]}", f"stable-{uuid.uuid4().hex[:8]}"
    tp = TopicPartition(topic, 0)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 1, 1)])
    consumer = kafka_driver.group_consumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"{group}-previous-owner")
    await consumer.start()
    await producer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: 5})
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"handled", partition=0)
        await producer.send_offsets_to_transaction({tp: 10}, group)
        by_aiokafka = await kafka_driver.READS_PARTITIONS_ONLY(consumer._coordinator, [tp])
        asking = asyncio.create_task(consumer.committed(tp))
        await asyncio.sleep(1)
        waited = not asking.done()
        await producer.commit_transaction()
        return by_aiokafka[tp].offset, waited, await asyncio.wait_for(asking, 30)
    finally:
        await producer.stop()
        await consumer.stop()
        await admin.delete_topics([topic])
        await admin.close()


def test_an_offset_a_transaction_holds_is_waited_for_and_read_once_committed(services):
    by_aiokafka, waited, committed = asyncio.run(read_while_a_transaction_holds_an_offset(services.bootstrap))
    assert by_aiokafka == 5  # aiokafka's own: the offset from before (if this fails, aiokafka asks for stable offsets now)
    assert waited
    assert committed == 10

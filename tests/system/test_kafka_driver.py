"""What `memfilter.runtime.kafka_driver` mends in aiokafka, shown on the replicated stack's
three brokers (docs/delivery.md, "Seed 17").

A broker that is not a group's coordinator answers OffsetFetch with NOT_COORDINATOR for the
whole group, at the top of its answer and with no partitions, as a coordinator that has just
lost the group's partition does, or one whose read timed out. aiokafka 0.14 reads that as "the
group never committed"; the driver, which every consumer of a group is made by, takes it for
the error it is: it looks the coordinator up again and asks again.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from memfilter.runtime import kafka_driver

pytestmark = [pytest.mark.replicated, pytest.mark.xdist_group("replicated")]


async def committed_asked_of_another_broker(bootstrap: str) -> tuple[dict, int | None, bool]:
    """A group commits offset 42, and its offset is asked of a broker that is not its
    coordinator: what aiokafka's own reading gives, what a consumer's `committed()` gives,
    and whether the consumer went back to the group's coordinator."""
    topic, group = f"driver-{uuid.uuid4().hex[:8]}", f"driver-{uuid.uuid4().hex[:8]}"
    tp = TopicPartition(topic, 0)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(topic, 1, 3)])
    consumer = kafka_driver.group_consumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: 42})
        coordinator = consumer._coordinator
        right = coordinator.coordinator_id
        wrong = next(broker.nodeId for broker in consumer._client.cluster.brokers() if broker.nodeId != right)
        coordinator.coordinator_id = wrong
        by_aiokafka = await kafka_driver.READS_PARTITIONS_ONLY(coordinator, [tp])
        coordinator.coordinator_id = wrong
        committed = await consumer.committed(tp)
        return by_aiokafka, committed, coordinator.coordinator_id == right
    finally:
        await consumer.stop()
        await admin.delete_topics([topic])
        await admin.close()


def test_a_group_wide_not_coordinator_is_no_offset_to_aiokafka_and_here_an_error_asked_again_of_the_coordinator(cluster_services):
    by_aiokafka, committed, back = asyncio.run(committed_asked_of_another_broker(cluster_services.bootstrap))
    assert by_aiokafka == {}  # aiokafka's own: "never committed" (if this fails, aiokafka reads the error now: the driver's mend can go)
    assert committed == 42
    assert back

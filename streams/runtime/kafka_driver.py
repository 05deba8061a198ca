"""The Kafka driver: consumers of a group, on aiokafka, that read their group's committed
offsets seeing every error Kafka answers, and only once they are stable.

This is the one module of the product that touches aiokafka's private internals, so that an
aiokafka upgrade has one place to look. It was written for the release line `WRITTEN_FOR`
(pyproject bounds aiokafka to it) and refuses to load on another, naming both;
`tests/unit/test_house.py` fails loudly too, and `tests/system/test_kafka_driver.py` and
`tests/kafka/test_stable_offsets.py` show on real brokers both aiokafka's defects and that this
module mends them.

Why it exists. aiokafka 0.14 reads a group's committed offsets (`GroupCoordinator.
_do_fetch_commit_offsets`) with OffsetFetch version 3, and:
- reads the partitions of the answer only. From version 2 on, Kafka answers an error of the
  whole group at the top, with no partitions: NOT_COORDINATOR from a broker that is no longer
  the group's coordinator (Kafka 4 also answers it for a read that timed out),
  COORDINATOR_LOAD_IN_PROGRESS while a new coordinator loads the group, COORDINATOR_NOT_AVAILABLE.
  aiokafka takes that for "the group never committed": `committed()` gives None, and a partition
  with no position starts at `auto_offset_reset`. A worker that took a partition over in that
  moment decided every request of it again from the partition's beginning (docs/delivery.md,
  "Seed 17"); the agent runner, which starts a partition new to it at its end, would skip the
  filtered inputs in between; the sink would apply the whole log again.
- cannot ask for stable offsets (`require_stable`, version 7, KIP-447). Offsets a transaction
  sent and has not yet committed are not in the answer: a member that takes a partition while
  the previous owner's last transaction completes starts before that transaction's records, and
  handles them again (the agent runner once answered an input twice so).

What it promises: every consumer of the process (the mend is aiokafka's class's; `group_consumer`
makes the product's) asks with version 7 and `require_stable`, and takes every error for what it
is. The coordinator is looked up again after NOT_COORDINATOR and COORDINATOR_NOT_AVAILABLE, and the
offsets are asked for again (aiokafka's callers ask again after a retriable error), also while a
transaction's offsets are pending (UNSTABLE_OFFSET_COMMIT): so until the transaction commits or
is aborted. A partition starts at its beginning (or end) only when Kafka says, with no error,
that the group has no offset for it. Brokers older than Kafka 2.5 (no version 7) are refused.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import aiokafka
import aiokafka.errors as Errors
from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.group_coordinator import UNKNOWN_OFFSET, GroupCoordinator
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Boolean, CompactArray, CompactString, Int16, Int32, Int64, Schema, TaggedFields
from aiokafka.structs import OffsetAndMetadata, TopicPartition

log = logging.getLogger(__name__)

WRITTEN_FOR = "0.14"  # aiokafka's release line whose group coordinator this module mends
if aiokafka.__version__.rsplit(".", 1)[0] != WRITTEN_FOR:
    raise ImportError(
        f"memfilter.runtime.kafka_driver was written for aiokafka {WRITTEN_FOR}.x and found {aiokafka.__version__}: "
        "install the aiokafka that pyproject.toml names (aiokafka>=0.14.0,<0.15), or port this module"
    )

READS_PARTITIONS_ONLY = GroupCoordinator._do_fetch_commit_offsets  # aiokafka's own, whose defects the tests show


class OffsetFetchResponse_v7(Response):
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("topic", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition", Int32),
                        ("offset", Int64),
                        ("leader_epoch", Int32),
                        ("metadata", CompactString("utf-8")),
                        ("error_code", Int16),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("error_code", Int16),
        ("tags", TaggedFields),
    )


class OffsetFetchRequest_v7(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 9
    API_VERSION = 7
    RESPONSE_TYPE = OffsetFetchResponse_v7
    SCHEMA = Schema(
        ("group_id", CompactString("utf-8")),
        ("topics", CompactArray(("topic", CompactString("utf-8")), ("partitions", CompactArray(Int32)), ("tags", TaggedFields))),
        ("require_stable", Boolean),
        ("tags", TaggedFields),
    )


class StableOffsetFetch(Request[OffsetFetchRequest_v7]):
    """A group's committed offsets of some partitions, stable ones only."""

    API_KEY = 9

    def __init__(self, group: str, partitions: list[TopicPartition]):
        self.group = group
        self.partitions = partitions

    def build(self, request_struct_class: type[OffsetFetchRequest_v7]) -> OffsetFetchRequest_v7:
        by_topic: dict[str, list[int]] = collections.defaultdict(list)
        for tp in self.partitions:
            by_topic[tp.topic].append(tp.partition)
        return request_struct_class(self.group, [(topic, ps, {}) for topic, ps in by_topic.items()], True, {})


class UnstableOffsetCommitError(Errors.BrokerResponseError):
    """Kafka's UNSTABLE_OFFSET_COMMIT, which aiokafka 0.14 does not know."""

    errno = 88
    message = "UNSTABLE_OFFSET_COMMIT"
    description = "There are unstable offsets that need to be cleared."
    retriable = True


async def fetch_committed(coordinator: GroupCoordinator, partitions: list[TopicPartition]) -> dict[TopicPartition, OffsetAndMetadata]:
    """The group's stable committed offsets of `partitions` (a partition it has none for is
    left out), in place of aiokafka's `_do_fetch_commit_offsets`: every error raised, the
    whole group's and a partition's; retriable ones are asked again by aiokafka's callers."""
    response = await coordinator._send_req(StableOffsetFetch(coordinator.group_id, partitions))
    for code in [response.error_code, *(p[4] for _, ps, _ in response.topics for p in ps)]:
        error = UnstableOffsetCommitError if code == UnstableOffsetCommitError.errno else Errors.for_code(code)
        if error is Errors.NoError:
            continue
        if error in (Errors.NotCoordinatorForGroupError, Errors.GroupCoordinatorNotAvailableError):
            coordinator.coordinator_dead()
        if error is Errors.GroupAuthorizationFailedError:
            raise error(coordinator.group_id)
        log.debug("group %s's committed offsets not given: %s; asking again", coordinator.group_id, error.__name__)
        raise error() if error.retriable else Errors.KafkaError(f"group {coordinator.group_id}'s committed offsets: {error.__name__}")
    return {
        TopicPartition(topic, partition): OffsetAndMetadata(offset, metadata or "")
        for topic, ps, _ in response.topics
        for partition, offset, _, metadata, _, _ in ps
        if offset != UNKNOWN_OFFSET
    }


GroupCoordinator._do_fetch_commit_offsets = fetch_committed


def group_consumer(*topics: str, group_id: str, **settings: Any) -> AIOKafkaConsumer:
    """An aiokafka consumer of `topics` in group `group_id`, with `settings`; its committed
    offsets are read as this module says."""
    return AIOKafkaConsumer(*topics, group_id=group_id, **settings)

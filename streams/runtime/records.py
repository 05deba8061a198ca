"""Records as the runtime handles them: a consumed record, a record to produce, and the
dead letter a rejected record becomes.

The worker, the persister, the agent runner and the audit replay all speak these; they live
here so that none of them imports another for its types. A dead letter carries the rejected
record's bytes unchanged (but for an erased thread's), the reason in `error.type` /
`error.message`, and where it came from.
"""

from __future__ import annotations

import logging

import msgspec

from memfilter.core.filter import Rejection

log = logging.getLogger("memfilter")

# Largest record fetched or sent: a request is at most MEMFILTER_MAX_BYTES (1 MiB), and its
# filtered input adds the context's stored rows and server fields. The stack's broker accepts
# this much. An output that would be larger (a context of very large rows) is refused before
# anything is written, with room left for the key, headers and the record batch's framing.
MAX_RECORD_BYTES = 8 << 20
MAX_OUTPUT_BYTES = MAX_RECORD_BYTES - (64 << 10)


class Record(msgspec.Struct, frozen=True, gc=False):
    """A consumed Kafka record, as the processor needs it."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None  # None: a tombstone, which a client can publish
    headers: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def of(cls, r) -> Record:
        """From an aiokafka `ConsumerRecord`."""
        return cls(r.topic, r.partition, r.offset, r.timestamp, r.key, r.value, tuple(r.headers or ()))


class Out(msgspec.Struct, frozen=True, gc=False):
    """A record to produce."""

    topic: str
    key: bytes | None
    value: bytes
    timestamp_ms: int | None  # None: the time it is sent (a reply's, which orders it after its request)
    headers: tuple[tuple[str, bytes], ...] = ()


def dead_letter(record: Record, dlq_topic: str, error: Rejection, seen: tuple[tuple[str, bytes], ...] = ()) -> Out:
    """The rejected record, bytes unchanged, with the reason, its source and `seen` in headers;
    refused because its thread was erased, without its value: what a stale tab or a late
    writer sends of an erased conversation is not copied again (docs/erasure.md)."""
    headers = (
        *record.headers,
        ("error.type", error.type.encode()),
        ("error.message", error.message.encode()),
        ("source.topic", record.topic.encode()),
        ("source.partition", str(record.partition).encode()),
        ("source.offset", str(record.offset).encode()),
        *seen,
    )
    return Out(dlq_topic, record.key, b"" if error.type == "erased" else record.value, record.timestamp_ms, headers)


def internal_error(record: Record, e: Exception) -> Rejection:
    """An unexpected error while handling one record: logged with the record's position."""
    where = f"{record.topic}-{record.partition}-{record.offset}"
    log.error("record %s: unexpected %s; dead-lettered", where, type(e).__name__, exc_info=e)
    return Rejection("internal", f"unexpected {type(e).__name__} while handling record {where}: {str(e)[:200]}; report it")

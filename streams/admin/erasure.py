"""`memfilter forget`: a resource's threads, or one thread, erased for good, through the log.

An erasure is an event on `persist-messages`, signed as the operator's (`memfilter.core.origin`),
keyed by its thread, with no content: the thread and resource it erases, when, by whom, and the
thread's history version it erases (`Erasure`). The worker that owns the thread's partition
applies it in order with the thread's requests (`HistoryStore.erase`): everything of the
thread leaves Redis but a tombstone, and from then on every request and every event naming
the thread is refused (`erased`). A rebuild or a replay starts the thread at its erasure
(`memfilter.audit.recorded`), so nothing erased is ever applied again.

The version makes the erasure exact in the log: it erases the history as of that version, and
a thread that moved meanwhile (a request decided between this command's read and the
worker's apply) refuses it; this command then reads the thread again and publishes a new
erasure, until one applies. It waits for that, and says what it erased.

A resource's threads are found by scanning the threads' meta keys for their owner
(`memfilter.store.reads.threads_of`): one pass over the store's keys, as long as Redis takes to walk
them (docs/erasure.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

import msgspec
from aiokafka import AIOKafkaProducer

from memfilter.core import origin
from memfilter.schemas.wire import Erasure, PersistMessages
from memfilter.settings import Settings
from memfilter.store import reads
from memfilter.store.history import HistoryStore, holds
from memfilter.store.layout import save_identity


@dataclass
class Erased:
    threads: list[str] = field(default_factory=list)  # erased, and applied by the workers
    already: list[str] = field(default_factory=list)  # erased before
    pending: list[str] = field(default_factory=list)  # published, not applied within the wait
    messages: int = 0  # rows the erased threads held


async def forget(
    settings: Settings, store: HistoryStore, threads: list[str], scope: Literal["thread", "resource"], by: str, reason: str, wait_s: float
) -> Erased:
    """Erase these threads: publish an erasure for each at its version, and again at its new
    version for one that moved before a worker applied it, until every one is applied or
    `wait_s` seconds have passed."""
    out = Erased()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        asked: dict[str, tuple[int, bytes]] = {}  # thread -> (version asked at, the erasure's identity)
        sizes: dict[str, int] = {}
        for thread in threads:
            meta = await reads.meta(store, thread)
            if meta.owner is None and not meta.erased:  # no history at all
                continue
            if meta.erased:
                out.already.append(thread)
                continue
            sizes[thread] = meta.size
            asked[thread] = await _publish(producer, settings, thread, meta.owner or "", meta.version, scope, by, reason)
        await producer.flush()
        deadline = time.monotonic() + wait_s
        while asked and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            for thread, (version, identity) in list(asked.items()):
                meta = await reads.meta(store, thread)
                if holds(meta.erasures, identity):
                    out.threads.append(thread)
                    out.messages += sizes[thread]
                    del asked[thread]
                elif meta.version != version:  # moved before the worker applied it: it will be refused; ask again
                    asked[thread] = await _publish(producer, settings, thread, meta.owner or "", meta.version, scope, by, reason)
            await producer.flush()
        out.pending = sorted(asked)
    finally:
        await producer.stop()
    return out


async def _publish(
    producer: AIOKafkaProducer, settings: Settings, thread: str, owner: str, version: int, scope: Literal["thread", "resource"], by: str, reason: str
) -> tuple[int, bytes]:
    at = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    request_id = f"erase-{uuid.uuid4().hex}"
    event = msgspec.json.encode(PersistMessages(request_id, thread, owner, [], version, erasure=Erasure(at, by, scope, reason)))
    await producer.send(settings.topics.persist, event, key=thread.encode(), headers=list(origin.operator_headers(event, settings.secret)))
    return version, save_identity(owner, request_id)

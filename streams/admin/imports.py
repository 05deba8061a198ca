"""`memfilter history import`: existing threads brought in through the log.

Each thread of an export (`memfilter.core.exports`) becomes one `persist-messages` event,
signed as the operator's (`memfilter.core.origin`), keyed by its thread: the workers apply it
in order with the thread's requests, with the rights of the processor's first save (it sets
the thread's owner), and a rebuild applies it again, so the log holds the import as it holds
every other write. Its `requestId` is a digest of the rows, so the same rows imported twice
are one save (`save_identity`), and a thread whose rows are all stored already is not
published at all.

Before publishing, each thread is checked against what is stored, so that what will not be
written is reported, not sent: a thread of another resource, an erased one, a message id
another thread holds, a row stored under the same id with other content, or an event larger
than a record may be. The workers check again when they apply it (APPLY), so a race between
the check and the write refuses the event (a dead letter) instead of writing over a thread.
Then the command waits until the workers have applied what it published, and says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from aiokafka import AIOKafkaProducer

from memfilter.core import origin
from memfilter.core.exports import ImportedThread, with_created_at
from memfilter.core.working_memory import Template
from memfilter.runtime.records import MAX_OUTPUT_BYTES
from memfilter.schemas.wire import PersistMessagesOf, WorkingMemoryUpdate
from memfilter.settings import Settings
from memfilter.store.history import HistoryStore
from memfilter.store.layout import thread_tag

CHECKED_AT_ONCE = 200  # threads read from Redis in one round trip


@dataclass
class Summary:
    published: list[tuple[str, int]] = field(default_factory=list)  # (thread, rows) sent
    unchanged: int = 0  # threads stored as the export has them already
    refused: list[tuple[str, str]] = field(default_factory=list)  # (thread, why), not written
    applied: int = 0  # of those published, threads the workers applied within the wait
    messages: int = 0  # rows published


def event_of(t: ImportedThread, rows: list[bytes], template: Template | None = None) -> bytes:
    """The thread's import event: its rows, and the working memory it brings as a call of the
    tool (a JSON document as the object it holds: a schema's call merges it into none), under a
    request id that is a digest of them."""
    memory = (
        (msgspec.json.decode(t.working_memory) if template is not None and template.format == "json" else t.working_memory)
        if t.working_memory is not None
        else None
    )
    update = WorkingMemoryUpdate([{"memory": memory}]) if t.working_memory is not None else msgspec.UNSET
    digest = hashlib.blake2b(b"\n".join([t.thread.encode(), *rows, (t.working_memory or "").encode()]), digest_size=12).hexdigest()
    return msgspec.json.encode(
        PersistMessagesOf[msgspec.Raw](f"import-{digest}", t.thread, t.resource or "", [msgspec.Raw(r) for r in rows], workingMemory=update)
    )


async def import_threads(
    settings: Settings, store: HistoryStore, threads: list[ImportedThread], wait_s: float, progress: Callable[[int, int, str], None] | None = None
) -> Summary:
    summary = Summary()
    ready = []
    for t in threads:
        if t.problems:
            summary.refused.append((t.thread or "(no thread)", "; ".join(t.problems)))
        elif t.rows or t.working_memory is not None:
            ready.append(t)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap, acks="all", enable_idempotence=True, max_request_size=MAX_OUTPUT_BYTES + 4096)
    await producer.start()
    sent: list[tuple[ImportedThread, list[str]]] = []
    try:
        for at in range(0, len(ready), CHECKED_AT_ONCE):
            chunk = ready[at : at + CHECKED_AT_ONCE]
            for t, event, ids in await _checked(store, chunk, summary, settings.working_memory.read()):
                await producer.send(settings.topics.persist, event, key=t.thread.encode(), headers=list(origin.operator_headers(event, settings.secret)))
                summary.published.append((t.thread, len(ids)))
                summary.messages += len(ids)
                sent.append((t, ids))
            if progress:
                progress(at + len(chunk), len(ready), "checked")
        await producer.flush()
    finally:
        await producer.stop()
    summary.applied = await _applied(store, sent, wait_s)
    return summary


async def _checked(
    store: HistoryStore, threads: list[ImportedThread], summary: Summary, template: Template | None
) -> list[tuple[ImportedThread, bytes, list[str]]]:
    """The threads' events to publish, after checking them against the store; the others go
    into the summary."""
    states = await store.read({t.thread: [row["id"] for row in t.rows] for t in threads})
    ids = sorted({row["id"] for t in threads for row in t.rows if row["id"] not in states[t.thread].rows})
    holders, _, _ = await store.owners(ids)
    now_ms = int(time.time() * 1000)
    out = []
    for t in threads:
        state = states[t.thread]
        stored = {mid: msgspec.json.decode(row) for mid, row in state.rows.items()}
        rows = with_created_at(t.rows, stored, now_ms, state.newest_ms)
        encoded = [msgspec.json.encode(row) for row in rows]
        tag = thread_tag(t.thread)
        if state.erased:
            summary.refused.append((t.thread, "erased (memfilter forget): it stays erased"))
        elif state.owner is not None and state.owner != t.resource:
            summary.refused.append((t.thread, f"belongs to resource {state.owner}, the export says {t.resource}"))
        elif foreign := [row["id"] for row in rows if holders.get(row["id"], tag) != tag]:
            summary.refused.append((t.thread, f"message id {foreign[0]} belongs to another thread"))
        elif clash := [row["id"] for row, raw in zip(rows, encoded) if row["id"] in state.rows and state.rows[row["id"]] != raw]:
            summary.refused.append((t.thread, f"message {clash[0]} is stored with other content; not overwritten"))
        elif all(row["id"] in state.rows for row in rows) and t.working_memory is None:
            summary.unchanged += 1
        elif template is not None and template.format == "json" and t.working_memory is not None and not _is_json(t.working_memory):
            summary.refused.append((t.thread, "its working memory is not JSON, and MEMFILTER_WORKING_MEMORY_SCHEMA makes it a JSON document"))
        elif len(event := event_of(t, encoded, template)) + len(t.thread) > MAX_OUTPUT_BYTES:
            summary.refused.append((t.thread, f"its {len(rows)} messages are {len(event):,} bytes; a record may have {MAX_OUTPUT_BYTES:,}"))
        else:
            out.append((t, event, [row["id"] for row in rows]))
    return out


def _is_json(text: str) -> bool:
    try:
        msgspec.json.decode(text)
        return True
    except msgspec.DecodeError:
        return False


async def _applied(store: HistoryStore, sent: list[tuple[ImportedThread, list[str]]], wait_s: float) -> int:
    """How many of the published threads hold all their rows, waiting up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    waiting = sent
    while True:
        states = await store.read({t.thread: ids for t, ids in waiting}) if waiting else {}
        waiting = [(t, ids) for t, ids in waiting if len(states[t.thread].rows) < len(ids)]
        if not waiting or time.monotonic() >= deadline:
            return len(sent) - len(waiting)
        await asyncio.sleep(0.2)

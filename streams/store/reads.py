"""The operator's and the gateway's reads of a history store: one thread at a time, and walks
of the store's keys.

The worker reads and writes threads a batch at a time (`memfilter.store.history`); the
commands that show, list, erase or drop threads, and the gateway's reload of a conversation,
read one thread, or walk every key under a prefix. A thread that left Redis for PostgreSQL is
read there (not loaded back: only its worker loads a thread back, between its own reads and
writes), and one that cannot be read raises Unavailable naming the reason. Each read is one
round trip through the store's transport; a walk is as long as Redis takes to scan its keys.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from memfilter.store.history import HistoryStore
from memfilter.store.postgres import Thread, Unavailable
from memfilter.store.transport import Transport


class Meta(msgspec.Struct, frozen=True):
    """A thread's meta (`meta`)."""

    owner: str | None
    version: int
    erased: bool  # erased (`memfilter forget`) and not started again
    erasures: bytes  # the identities of the erasures applied to it (`holds`)
    size: int  # rows stored


async def meta(store: HistoryStore, thread: str) -> Meta:
    """A thread's meta and how many rows it holds (in PostgreSQL if it left Redis)."""
    k = store.keys(thread)
    (owner, version, erased, erasures, cold), size = await store.transport.pipeline(
        [("HMGET", k.meta, "owner", "version", "erased", "erasures", "cold"), ("HLEN", k.rows)]
    )
    if cold is not None:
        size = len((await _postgresql_copy(store, thread)).rows)
    return Meta(owner.decode() if owner is not None else None, int(version or 0), erased is not None, erasures or b"", size)


async def gone(store: HistoryStore, resource: str, threads: list[str]) -> set[str]:
    """Of these threads, those Redis holds as erased (`memfilter forget`) or as another
    resource's: what PostgreSQL's copy may still show until the sink writes it (one round trip)."""
    if not threads:
        return set()
    metas = await store.transport.pipeline([("HMGET", store.keys(t).meta, "owner", "erased") for t in threads])
    return {t for t, (owner, erased) in zip(threads, metas) if erased is not None or (owner is not None and owner.decode() != resource)}


async def threads_of(store: HistoryStore, resource: str) -> list[str]:
    """The threads `resource` owns: a scan of every thread's meta key (an operator's
    command: as long as Redis takes to walk its keys)."""
    found: list[str] = []
    async for threads in thread_batches(store):
        owners = await store.transport.pipeline([("HGET", store.keys(t).meta, "owner") for t in threads])
        found += [t for t, owner in zip(threads, owners) if owner is not None and owner.decode() == resource]
    return sorted(found)


async def thread_batches(store: HistoryStore, size: int = 1000):
    """Every thread under this store's prefix (cold ones too), `size` at a time: a scan of their meta keys."""
    async for keys in _batches(store.transport.scan(f"{_glob_escape(store.prefix)}:t:*:meta"), size):
        yield [store.thread_of_meta(key.decode()) for key in keys]


async def thread_rows(store: HistoryStore, thread: str) -> list[bytes]:
    """A thread's conversation: its rows in save order, without the superseded ones."""
    k = store.keys(thread)
    read = await _read(store, thread, [("LRANGE", k.order, 0, -1), ("HGETALL", k.rows)])
    if isinstance(read, Thread):
        return [read.rows[mid] for mid in read.order]
    ids, rows = read
    return [rows[mid] for mid in ids if mid in rows]


async def row(store: HistoryStore, thread: str, message_id: str) -> bytes | None:
    """One stored row of a thread (superseded or not), by message id."""
    read = await _read(store, thread, [("HGET", store.keys(thread).rows, message_id)])
    return read.rows.get(message_id) if isinstance(read, Thread) else read[0]


async def superseded_rows(store: HistoryStore, thread: str) -> list[tuple[str, bytes]]:
    """A thread's superseded rows, each with the id of the request that superseded it."""
    k = store.keys(thread)
    read = await _read(store, thread, [("HGETALL", k.superseded)])
    if isinstance(read, Thread):
        return [(request, read.rows[mid]) for mid, request in read.superseded.items() if mid in read.rows]
    (by,) = read
    found = (await store.transport.pipeline([("HMGET", k.rows, *by)]))[0] if by else []
    return [(request.decode(), row) for request, row in zip(by.values(), found) if row is not None]


async def drop(store: HistoryStore) -> int:
    """Delete every key under this store's prefix; how many there were."""
    dropped = 0
    async for keys in _batches(store.transport.scan(f"{_glob_escape(store.prefix)}:*"), 1000):
        dropped += await store.transport.unlink(keys)
    return dropped


async def _read(store: HistoryStore, thread: str, commands: list[tuple]) -> list[Any] | Thread:
    """The replies to these commands on one thread, sent with the check that it is in Redis,
    in one round trip; the thread as PostgreSQL holds it instead if it left Redis (read there,
    not loaded back, which only its worker does between its own reads and writes). Raise
    Unavailable naming the reason if it cannot be read."""
    cold, *replies = await store.transport.pipeline([("HEXISTS", store.keys(thread).meta, "cold"), *commands])
    return await _postgresql_copy(store, thread) if cold else replies


async def _postgresql_copy(store: HistoryStore, thread: str) -> Thread:
    """The thread as PostgreSQL holds it (it left Redis); Unavailable naming the reason if it cannot be read."""
    if store.warmer is None:
        raise Unavailable(f"thread {thread} left Redis for PostgreSQL, and this command has no POSTGRES_URL to read it from: set it")
    held = (await store.warmer.pg.load([thread], into_redis=False)).get(thread)
    if held is None:
        raise Unavailable(
            f"thread {thread} left Redis but PostgreSQL holds no copy of it (schema {store.warmer.pg.schema}); rebuild it (memfilter history rebuild)"
        )
    return held


_KEY_PREFIX = re.compile(rb"^(.*?):(?:t:\{|idx:\{|sync:\{|sync$|epoch$)")


async def prefixes(transport: Transport) -> dict[str, int]:
    """The history stores in a Redis: prefix -> how many keys it has (replays and rebuilds
    into new prefixes leave some behind)."""
    found: dict[str, int] = {}
    async for key in transport.scan("*"):
        if m := _KEY_PREFIX.match(key):
            name = m.group(1).decode(errors="replace")
            found[name] = found.get(name, 0) + 1
    return found


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


async def _batches(items, size: int):
    batch = []
    async for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

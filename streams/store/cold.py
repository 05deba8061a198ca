"""Threads between Redis and PostgreSQL: the working set's edge.

Redis holds the threads in use, PostgreSQL (`memfilter.store.postgres`) all of them. This
module moves a thread across, and promises that nothing is decided differently for it:

- `whole` reads threads from Redis as they stand, for the sink (`memfilter.runtime.sink`) and
  a rebuild (`fill`) to write to PostgreSQL.
- `evict` takes threads idle in Redis out of it (EVICT), each only if PostgreSQL holds its
  latest version: never the only copy. What stays is the thread's meta (owner, version,
  erasure, a `cold` mark) and its ids in the message-id index, a few dozen bytes a thread and
  a message: ownership, versions and id claims answer as if it had never left.
- `Warmer.warm` loads cold threads back (RESTORE) before the worker that owns them reads or
  writes them: the history store (`memfilter.store.history`) calls it for every thread it
  finds cold, in the batch's round trips (one PostgreSQL query for all of a batch's cold
  threads, one Redis round trip to restore them). Every writer's script refuses a cold thread,
  so a thread evicted between a read and a write is read again, loaded back, and decided
  again; RESTORE is fenced by the owner epoch, so only the thread's worker loads it back, and
  a thread never turns warm in the middle of its worker's round trip (the commands that read
  one thread, the gateway's and `history show`, read a cold one from PostgreSQL instead).

A load waits for PostgreSQL for MEMFILTER_POSTGRES_TIMEOUT at most; then the thread is
`unavailable`, with the reason, and what needed it is refused with that reason (a request
or save dead-lettered, to publish again); threads in Redis go on as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memfilter.store import reads, scripts
from memfilter.store.history import Fenced, HistoryStore
from memfilter.store.layout import pack
from memfilter.store.postgres import PostgresHistory, Refused, Thread, Unavailable

if TYPE_CHECKING:
    from memfilter.settings import Settings


async def whole(store: HistoryStore, threads: list[str], written_ms: dict[str, int]) -> list[Thread]:
    """These threads as Redis holds them now, whole (one round trip); a thread that is cold
    (PostgreSQL holds its latest already) or unknown is left out. `written_ms`: when each was
    last written, as the caller knows it (else its newest message's time)."""
    commands = []
    for thread in threads:
        k = store.keys(thread)
        commands += [
            ("HMGET", k.meta, "version", "owner", "newest", "erased", "cold"),
            ("HGETALL", k.rows),
            ("LRANGE", k.order, 0, -1),
            ("HGETALL", k.superseded),
            ("GET", k.saved),
        ]
    replies = iter(await store.transport.pipeline(commands))
    out = []
    for thread in threads:
        (version, owner, newest, erased, cold), rows, order, superseded, saved = (next(replies) for _ in range(5))
        if version is None or cold is not None:
            continue
        out.append(
            Thread(
                thread,
                int(version),
                owner.decode() if owner is not None else None,
                int(newest) if newest is not None else None,
                int(erased) if erased is not None else None,
                [mid.decode() for mid in order],
                {mid.decode(): row for mid, row in rows.items()},
                {mid.decode(): by.decode() for mid, by in superseded.items()},
                saved or b"",
                written_ms.get(thread) or int(newest or 0),
            )
        )
    return out


async def fill(store: HistoryStore, pg: PostgresHistory) -> tuple[int, dict[str, str]]:
    """Write every thread of the store's prefix to PostgreSQL (a rebuild's last step): how many
    were written (a thread PostgreSQL holds at its version already is not), and the threads
    PostgreSQL refused, with why (each left in Redis alone; the others written)."""
    written, refused = 0, dict[str, str]()
    async for threads in reads.thread_batches(store, 200):
        done, left_out = await pg.write(await whole(store, threads, {}))
        written, refused = written + done, refused | left_out
    return written, refused


async def evict(store: HistoryStore, pg: PostgresHistory, idle_before_ms: int, limit: int = 500) -> int:
    """Take out of Redis up to `limit` threads not used since `idle_before_ms`, each only at
    the version PostgreSQL holds; how many are out now (an erased thread's tombstone counts:
    nothing of it is left to take, and it is not asked for again). Raises Unavailable if
    PostgreSQL does not answer (eviction pauses; nothing has moved)."""
    idle = await pg.idle(idle_before_ms, limit)
    if not idle:
        return 0
    calls = []
    for thread, version in idle:
        k = store.keys(thread)
        calls.append(
            scripts.EVICT.command(
                rows_key=k.rows,
                order_key=k.order,
                meta_key=k.meta,
                saved_key=k.saved,
                superseded_key=k.superseded,
                tokens_key=k.tokens,
                held_version=str(version),
            )
        )
    left = [thread for (thread, _), done in zip(idle, await store.transport.pipeline(calls)) if done]
    await pg.left_redis(left)
    return len(left)


class Warmer:
    """Loads cold threads back into Redis from PostgreSQL (`warm`)."""

    def __init__(self, pg: PostgresHistory):
        self.pg = pg

    @classmethod
    def of(cls, settings: Settings, prefix: str | None = None) -> Warmer | None:
        """The settings' warmer, for the store of `prefix` (the settings' by default): None
        without POSTGRES_URL (every thread stays in Redis)."""
        p = settings.postgres
        return cls(PostgresHistory(p.url, prefix or settings.redis.prefix, p.timeout)) if p.url else None

    async def warm(self, store: HistoryStore, threads: list[str]) -> dict[str, str]:
        """Load these cold threads back; those that could not be, with the reason (PostgreSQL
        down or slow, or holding an older version than Redis's meta, which eviction never
        leaves). A thread another worker loaded meanwhile is warm all the same."""
        try:
            held = await self.pg.load(threads)
        except (Unavailable, Refused) as e:  # refused: what it asked of PostgreSQL; either way these threads wait, the others go on
            return dict.fromkeys(threads, f"{e}; thread history that left Redis is loaded from there")
        missing = {
            t: f"thread {t} left Redis but PostgreSQL holds no copy of it (schema {self.pg.schema}); rebuild it (memfilter history rebuild)"
            for t in threads
            if t not in held
        }
        calls = []
        loading = [t for t in threads if t in held]
        for thread in loading:
            t = held[thread]
            k = store.keys(thread)
            calls.append(
                scripts.RESTORE.command(
                    epoch=store.epoch,
                    rows_key=k.rows,
                    order_key=k.order,
                    meta_key=k.meta,
                    saved_key=k.saved,
                    superseded_key=k.superseded,
                    held_version=str(t.version),
                    packed_rows=pack([x for mid, row in t.rows.items() for x in (mid, row.decode())]),
                    packed_order=pack(t.order),
                    packed_superseded=pack([x for pair in t.superseded.items() for x in pair]),
                    saved=t.saved,
                )
            )
        for thread, (status, version) in zip(loading, await store.transport.pipeline(calls) if calls else []):
            if status == b"fenced":
                raise Fenced(thread, store.epoch, int(version))
            if status == b"behind":
                missing[thread] = (
                    f"thread {thread} is at version {version.decode()} in Redis but PostgreSQL holds version {held[thread].version}; "
                    "not loaded (the sink has not written its latest): rebuild it (memfilter history rebuild)"
                )
        store.metrics.cold_loads.inc(len(loading))
        return missing

"""The PostgreSQL tier of history: every thread as of the log, queryable with SQL.

Redis holds the threads in use (the working set the worker decides against); PostgreSQL
holds them all. The sink (`memfilter.runtime.sink`) writes each thread here as
`persist-messages` leaves it, a thread at a time as Redis holds it whole, ordered by the
thread's version: a thread is written only over an older version of itself, so writing a
thread again, or an older copy late, changes nothing. Of a thread's messages only those that
differ from what PostgreSQL holds are written, when the writer knows it (`_write`), so a turn
writes what it added, whatever the thread's length. A thread idle in Redis leaves it once this tier holds its
latest version (`memfilter.store.cold`), and is loaded back from here on its next use.

Tables, in the schema named by the store's prefix (`mf` by default; Mastra's `PostgresStore`
takes a `schemaName` too), laid out as Mastra's storage lays out threads and messages, with
what the working set needs beside them (docs/postgres.md says where and why they differ):

| table | holds |
|---|---|
| `mastra_threads` | one row a thread: `id`, `resourceId` (its owner; null once erased), `title`, `metadata`, `createdAt`, `updatedAt` (its last write); and `version`, `newest`, `erased`, `saved` (the identities of the saves applied to it: a save of the log applied again changes nothing), `touched` (its last use in Redis) and `in_redis` |
| `mastra_messages` | one row a stored message: `id`, `thread_id`, `content` (the message's `content`, JSON, as Mastra's format 2), `role`, `type`, `createdAt`, `resourceId`; and `row` (the stored row, byte for byte), `position` (its place in the conversation; null once superseded) and `superseded_by` (the request that took it out) |

An erased thread keeps its `mastra_threads` row (version, when erased, no owner, no title)
and no message. Everything here is I/O on PostgreSQL through asyncpg; what a thread is, and
how Redis gives and takes it, is `memfilter.store.cold`'s.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from datetime import UTC, datetime

import asyncpg
import msgspec

from memfilter.core.filter import parse_ms
from memfilter.settings import without_password


class Unavailable(Exception):
    """PostgreSQL did not answer in time, or failed the call: what needed it waits, or is refused
    with this reason, and is tried again."""


class Refused(Exception):
    """PostgreSQL answered, and refused the data (SQLSTATE class 22, a data exception, or 54, a
    program limit such as an index entry's size): trying again gives the same answer. A data
    error of one thread, not an outage: the thread is reported and left out, the rest go on."""


# What PostgreSQL says of data it cannot take, whatever its state.
_REFUSALS = (asyncpg.exceptions.DataError, asyncpg.exceptions.ProgramLimitExceededError)


class Thread(msgspec.Struct, frozen=True):
    """One thread as Redis holds it, whole: what the sink writes and a cold load gives back."""

    id: str
    version: int
    owner: str | None
    newest_ms: int | None
    erased_ms: int | None
    order: list[str]  # the conversation's ids, in order
    rows: dict[str, bytes]  # every stored row, superseded ones too
    superseded: dict[str, str]  # id -> the request that superseded it
    saved: bytes  # `saved`: identities of the saves applied
    written_ms: int  # when it was last written (the newest record time of its events)


async def guarded(url: str, timeout: float, coro):
    """`coro` within `timeout`. PostgreSQL refusing the data is Refused; not answering, or
    failing the call otherwise (the network, a restart, a full disk), Unavailable."""
    where = without_password(url)
    try:
        return await asyncio.wait_for(coro, timeout)
    except _REFUSALS as e:
        raise Refused(f"PostgreSQL at {where} refused the data: {type(e).__name__}: {e}") from e
    except (OSError, TimeoutError) as e:
        raise Unavailable(f"PostgreSQL at {where} did not answer within {timeout:g} s: {e!r}") from e
    except (asyncpg.PostgresError, asyncpg.InterfaceError) as e:
        raise Unavailable(f"PostgreSQL at {where} failed the call: {type(e).__name__}: {e}") from e


async def open_pool(url: str, timeout: float, ddl: str, max_size: int) -> asyncpg.Pool:
    """A connection pool, its tables made first if missing (`ddl`); closed again if that fails."""
    pool = await asyncpg.create_pool(url, min_size=1, max_size=max_size, command_timeout=timeout)
    try:
        async with pool.acquire() as conn:
            await conn.execute(ddl)
    except BaseException:
        await pool.close()
        raise
    return pool


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


SCHEMA = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.mastra_threads (
    id text PRIMARY KEY,
    "resourceId" text,
    title text NOT NULL DEFAULT '',
    metadata text NOT NULL DEFAULT '{{}}',
    "createdAt" timestamptz NOT NULL,
    "updatedAt" timestamptz NOT NULL,
    version bigint NOT NULL,
    newest bigint,
    erased bigint,
    saved bytea NOT NULL DEFAULT '',
    touched timestamptz NOT NULL,
    in_redis boolean NOT NULL DEFAULT true
);
CREATE INDEX IF NOT EXISTS mastra_threads_resource ON {s}.mastra_threads ("resourceId");
CREATE INDEX IF NOT EXISTS mastra_threads_idle ON {s}.mastra_threads (touched) WHERE in_redis;
CREATE TABLE IF NOT EXISTS {s}.mastra_messages (
    thread_id text NOT NULL,
    id text NOT NULL,
    content text NOT NULL,
    role text NOT NULL,
    type text NOT NULL,
    "createdAt" timestamptz NOT NULL,
    "resourceId" text,
    "row" text NOT NULL,
    position integer,
    superseded_by text,
    PRIMARY KEY (thread_id, id)
);
"""


WRITTEN_ROWS = 200_000  # messages whose fingerprints a writer keeps (~100 bytes each), to write a thread's changes alone
MESSAGE_COLUMNS = ["thread_id", "id", "content", "role", "type", "createdAt", "resourceId", "row", "position", "superseded_by"]  # `_messages`' order


class _Row(msgspec.Struct):
    """What the Mastra columns take from a stored row."""

    role: str
    content: msgspec.Raw
    type: str = "v2"
    createdAt: str | None = None


_ROW = msgspec.json.Decoder(_Row)


def _at(ms: int | None) -> datetime:
    return datetime.fromtimestamp((ms or 0) / 1000, UTC)


def _messages(t: Thread, only: set[str] | None = None) -> list[tuple]:
    """The thread's `mastra_messages` rows (`only` those of these ids)."""
    place = {mid: i for i, mid in enumerate(t.order)}
    out = []
    for mid, raw in t.rows.items():
        if only is not None and mid not in only:
            continue
        row = _ROW.decode(raw)
        created = parse_ms(row.createdAt) if row.createdAt else None
        text = raw.decode()
        out.append(
            (t.id, mid, bytes(row.content).decode(), row.role, row.type, _at(created or t.written_ms), t.owner, text, place.get(mid), t.superseded.get(mid))
        )
    return out


def _fingerprints(t: Thread) -> dict[str, int]:
    """Each message's fingerprint: what its `mastra_messages` row is made of (`_messages`).
    A row without its own createdAt takes the thread's write time, so it counts too."""
    place = {mid: i for i, mid in enumerate(t.order)}
    return {mid: hash((raw, place.get(mid), t.superseded.get(mid), t.owner, None if b'"createdAt"' in raw else t.written_ms)) for mid, raw in t.rows.items()}


class _Written:
    """What this process wrote of each thread lately: its version and its messages'
    fingerprints, at most `rows` messages in all (the threads written longest ago forgotten)."""

    def __init__(self, rows: int):
        self.rows = rows
        self._held: OrderedDict[str, tuple[int, dict[str, int]]] = OrderedDict()
        self._count = 0

    def get(self, thread: str, version: int | None) -> dict[str, int] | None:
        """The fingerprints written of `thread`, if PostgreSQL holds the version they were written at."""
        known = self._held.get(thread)
        return known[1] if known is not None and known[0] == version else None

    def put(self, thread: str, version: int, prints: dict[str, int]) -> None:
        if (old := self._held.pop(thread, None)) is not None:
            self._count -= len(old[1])
        self._held[thread] = (version, prints)
        self._count += len(prints)
        while self._count > self.rows and self._held:
            self._count -= len(self._held.popitem(last=False)[1][1])


class PostgresHistory:
    """Threads in one PostgreSQL database, under the schema `prefix`."""

    def __init__(self, url: str, prefix: str = "mf", timeout: float = 5.0):
        self.url = url
        self.prefix = prefix
        self.schema = quote(prefix)
        self.timeout = timeout  # seconds any call waits for PostgreSQL; then Unavailable
        self._pool: asyncpg.Pool | None = None
        self._starting = asyncio.Lock()
        self._written = _Written(WRITTEN_ROWS)

    async def _ready(self) -> asyncpg.Pool:
        """The connection pool, made on first use with the tables that are missing (a worker
        starts while PostgreSQL is down; only what needs it waits)."""
        async with self._starting:
            if self._pool is None:
                self._pool = await open_pool(self.url, self.timeout, SCHEMA.format(s=self.schema), max_size=4)
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def _call(self, coro):
        return await guarded(self.url, self.timeout, coro)

    async def _fetch(self, query: str, *args) -> list:
        return await (await self._ready()).fetch(query, *args)

    async def _execute(self, query: str, *args) -> str:
        return await (await self._ready()).execute(query, *args)

    async def write(self, threads: list[Thread]) -> tuple[int, dict[str, str]]:
        """Write each thread over an older version of it (or as new), in one transaction: how
        many were written, and the threads PostgreSQL refused, with why. A thread at or below the
        version held already changes nothing. A refused thread holds none of the others back:
        when the batch is refused, each is written on its own and the refused are left out."""
        try:
            return await self._call(self._write(threads)), {}
        except Refused as e:
            if len(threads) == 1:
                return 0, {threads[0].id: str(e)}
        written, refused = 0, dict[str, str]()
        for t in threads:
            try:
                written += await self._call(self._write([t]))
            except Refused as e:
                refused[t.id] = str(e)
        return written, refused

    async def _write(self, threads: list[Thread]) -> int:
        """Four statements whatever the number of threads: the versions held locked, the
        threads' rows written (over older versions only), then the messages that differ from
        what PostgreSQL holds deleted and written. What it holds of a thread is known when this
        process wrote the version PostgreSQL still holds (`_Written`); then only the rows added,
        changed or gone are written, so a turn writes its few rows, not its thread whole (a
        1,000-message thread rewrote 1,000 rows a turn). Otherwise (another sink wrote it, a
        restart, a rebuild) the thread is written whole."""
        s = self.schema
        newest: dict[str, Thread] = {}
        for t in threads:  # a thread once, at its highest version (a scan may give it twice)
            if t.id not in newest or newest[t.id].version < t.version:
                newest[t.id] = t
        given = list(newest.values())
        async with (await self._ready()).acquire() as conn, conn.transaction():
            held = await conn.fetch(f"SELECT id, version FROM {s}.mastra_threads WHERE id = ANY($1) ORDER BY id FOR UPDATE", list(newest))
            written = await conn.fetch(
                f"""INSERT INTO {s}.mastra_threads AS held (id, "resourceId", "createdAt", "updatedAt", version, newest, erased, saved, touched, in_redis)
                    SELECT id, owner, at, at, version, newest, erased, saved, now(), true
                    FROM unnest($1::text[], $2::text[], $3::timestamptz[], $4::bigint[], $5::bigint[], $6::bigint[], $7::bytea[])
                        AS given (id, owner, at, version, newest, erased, saved)
                    ON CONFLICT (id) DO UPDATE SET "resourceId" = EXCLUDED."resourceId", "updatedAt" = greatest(held."updatedAt", EXCLUDED."updatedAt"),
                        version = EXCLUDED.version, newest = EXCLUDED.newest, erased = EXCLUDED.erased, saved = EXCLUDED.saved, touched = now(), in_redis = true
                    WHERE held.version < EXCLUDED.version
                    RETURNING id""",
                [t.id for t in given],
                [t.owner for t in given],
                [_at(t.written_ms) for t in given],
                [t.version for t in given],
                [t.newest_ms for t in given],
                [t.erased_ms for t in given],
                [t.saved for t in given],
            )
            versions = {r["id"]: r["version"] for r in held}
            now = {r["id"]: _fingerprints(newest[r["id"]]) for r in written}
            stale: list[tuple[str, str]] = []  # (thread, message) rows to delete
            whole: list[str] = []  # threads whose messages are all deleted
            fresh: list[tuple] = []  # rows to copy in
            for i, prints in now.items():
                before = self._written.get(i, versions.get(i))
                if before is None:
                    whole.append(i)
                    fresh += _messages(newest[i])
                    continue
                changed = {mid for mid, f in prints.items() if before.get(mid) != f}
                stale += [(i, mid) for mid in before if mid not in prints or mid in changed]
                fresh += _messages(newest[i], changed)
            if whole:
                await conn.execute(f"DELETE FROM {s}.mastra_messages WHERE thread_id = ANY($1)", whole)
            if stale:
                await conn.execute(
                    f"DELETE FROM {s}.mastra_messages m USING unnest($1::text[], $2::text[]) AS gone (thread_id, id) WHERE m.thread_id = gone.thread_id AND m.id = gone.id",
                    [t for t, _ in stale],
                    [m for _, m in stale],
                )
            if fresh:  # COPY: several times faster than INSERTs
                await conn.copy_records_to_table("mastra_messages", schema_name=self.prefix, columns=MESSAGE_COLUMNS, records=fresh)
        for i, prints in now.items():
            self._written.put(i, newest[i].version, prints)
        return len(now)

    async def versions(self, ids: list[str]) -> dict[str, int]:
        """The version held of each of these threads that is held."""
        rows = await self._call(self._fetch(f"SELECT id, version FROM {self.schema}.mastra_threads WHERE id = ANY($1)", ids))
        return {r["id"]: r["version"] for r in rows}

    async def load(self, ids: list[str], into_redis: bool = True) -> dict[str, Thread]:
        """These threads as held, whole (those held): one round trip each for threads and
        messages; `into_redis`: marked as in Redis again (a cold load), else only read."""
        return await self._call(self._load(ids, into_redis))

    async def _load(self, ids: list[str], into_redis: bool) -> dict[str, Thread]:
        s = self.schema
        columns = 'id, version, "resourceId", newest, erased, saved, "updatedAt"'
        async with (await self._ready()).acquire() as conn:
            if into_redis:
                threads = await conn.fetch(f"UPDATE {s}.mastra_threads SET in_redis = true, touched = now() WHERE id = ANY($1) RETURNING {columns}", ids)
            else:
                threads = await conn.fetch(f"SELECT {columns} FROM {s}.mastra_threads WHERE id = ANY($1)", ids)
            messages = await conn.fetch(f"""SELECT thread_id, id, "row", position, superseded_by FROM {s}.mastra_messages WHERE thread_id = ANY($1)""", ids)
        by_thread: dict[str, list] = {}
        for m in messages:
            by_thread.setdefault(m["thread_id"], []).append(m)
        out = {}
        for t in threads:
            held = by_thread.get(t["id"], [])
            out[t["id"]] = Thread(
                t["id"],
                t["version"],
                t["resourceId"],
                t["newest"],
                t["erased"],
                [m["id"] for m in sorted((m for m in held if m["position"] is not None), key=lambda m: m["position"])],
                {m["id"]: m["row"].encode() for m in held},
                {m["id"]: m["superseded_by"] for m in held if m["superseded_by"] is not None},
                bytes(t["saved"]),
                int(t["updatedAt"].timestamp() * 1000),
            )
        return out

    async def idle(self, before_ms: int, limit: int) -> list[tuple[str, int]]:
        """Threads in Redis not used since `before_ms`: (id, version held), oldest first."""
        rows = await self._call(
            self._fetch(
                f"SELECT id, version FROM {self.schema}.mastra_threads WHERE in_redis AND touched < $1 ORDER BY touched LIMIT $2",
                _at(before_ms),
                limit,
            )
        )
        return [(r["id"], r["version"]) for r in rows]

    async def left_redis(self, ids: list[str]) -> None:
        """Mark these threads as evicted from Redis."""
        if ids:
            await self._call(self._execute(f"UPDATE {self.schema}.mastra_threads SET in_redis = false WHERE id = ANY($1)", ids))

    async def drop(self) -> None:
        """Drop the schema and everything in it."""
        await self._call(self._execute(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"))

"""Message vectors in PostgreSQL: what semantic recall searches (`memfilter.core.recall` then
chooses the rows from what it finds).

Why here: every message is in PostgreSQL already (`memfilter.store.postgres`), and a search
is within one resource's or one thread's messages. Debian's PostgreSQL has no pgvector, so a
vector is kept as `real[]` (where pgvector exists, `vector::vector(n)` casts it, and an HNSW
index on that expression can be added without moving the data) and beside it its signs, one
bit a dimension (`bit varying`), for a scan PostgreSQL does fast without an extension.

A search reads the signs of the scope's vectors and takes the CANDIDATES whose signs differ
least from the question's (`bit_count` of their XOR: the Hamming distance, which orders
vectors much as the angle between them does), then scores those exactly (the dot product of
unit vectors: their cosine) and answers the best `k`. Measured (benchmarks/recall_search.py;
the figures and the limits in docs/postgres.md, "Message vectors"): on 10,000 vectors of 1,536
dimensions, tens of milliseconds a search, about a hundredth of the time of exact scores of
them all in SQL.

Table `message_vectors`, in the history's schema:

| column | holds |
|---|---|
| `model` | the embedder's model: a search compares vectors of one model only |
| `resourceId`, `thread_id`, `message_id` | whose message: a search names its resource, always |
| `vector` | the message's embedding, scaled to unit length |
| `signs` | one bit a dimension, set where the vector is positive |

It promises: a search returns only vectors of its resource (and thread, when it names one) and
model; putting a message's vector again replaces it (applying an event twice changes nothing);
`erase` takes a thread's vectors out for good, and `prune` those of messages that left their
thread's conversation (erased, superseded) or whose thread's owner is another resource.

Beside the vectors, it reads the history's messages as the sink wrote them (`mastra_messages`,
`memfilter.store.postgres`): what the embedder embeds (`saved`), and the rows around each match
(`around`), only of the conversation (no superseded row, nothing of an erased thread) and only
of the resource that owns the thread.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import asyncpg
import msgspec

from memfilter.core.recall import Match
from memfilter.store import postgres
from memfilter.store.postgres import guarded, open_pool, quote

CANDIDATES = 64  # vectors scored exactly per search, at least: the nearest by their signs

SCHEMA = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.message_vectors (
    model text NOT NULL,
    "resourceId" text NOT NULL,
    thread_id text NOT NULL,
    message_id text NOT NULL,
    vector real[] NOT NULL,
    signs bit varying NOT NULL,
    PRIMARY KEY (model, thread_id, message_id)
);
CREATE INDEX IF NOT EXISTS message_vectors_resource ON {s}.message_vectors (model, "resourceId");
"""


class Vector(msgspec.Struct, frozen=True):
    """A message's embedding, and whose message it is."""

    model: str
    resource_id: str
    thread_id: str
    message_id: str
    vector: list[float]


def unit(vector: Sequence[float]) -> list[float]:
    """`vector` scaled to length 1 (a zero vector stays zero)."""
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm else list(vector)


def signs(vector: Sequence[float]) -> asyncpg.BitString:
    return asyncpg.BitString.from_int(sum(1 << (len(vector) - 1 - i) for i, x in enumerate(vector) if x > 0), len(vector))


class MessageVectors:
    """Message vectors in one PostgreSQL database, under the schema `prefix` (the history's)."""

    def __init__(self, url: str, prefix: str = "mf", timeout: float = 5.0):
        self.url, self.schema, self.timeout = url, quote(prefix), timeout
        self._pool: asyncpg.Pool | None = None
        self._starting = asyncio.Lock()

    async def _ready(self) -> asyncpg.Pool:
        async with self._starting:  # one pool, however many calls come first
            if self._pool is None:
                # the history's tables too: what `saved` and `around` read, before any sink made them
                ddl = postgres.SCHEMA.format(s=self.schema) + SCHEMA.format(s=self.schema)
                self._pool = await open_pool(self.url, self.timeout, ddl, max_size=2)
        return self._pool

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    async def drop(self) -> None:
        """Drop the table."""

        async def drop() -> None:
            await (await self._ready()).execute(f"DROP TABLE IF EXISTS {self.schema}.message_vectors")

        await guarded(self.url, self.timeout, drop())

    async def put(self, vectors: list[Vector]) -> None:
        """Keep each message's vector (unit length), over any it had of the same model."""

        async def write() -> None:
            rows = [(v.model, v.resource_id, v.thread_id, v.message_id, u, signs(u)) for v in vectors for u in [unit(v.vector)]]
            async with (await self._ready()).acquire() as conn:
                await conn.executemany(
                    f"""INSERT INTO {self.schema}.message_vectors (model, "resourceId", thread_id, message_id, vector, signs)
                        VALUES ($1, $2, $3, $4, $5, $6)
                        ON CONFLICT (model, thread_id, message_id) DO UPDATE SET "resourceId" = $2, vector = $5, signs = $6""",
                    rows,
                )

        await guarded(self.url, self.timeout, write())

    async def search(self, model: str, resource_id: str, question: Sequence[float], k: int, thread_id: str | None = None) -> list[Match]:
        """The `k` vectors of `resource_id` (and of `thread_id`, when given) nearest to
        `question`, best first."""
        q = unit(question)

        async def scan() -> list:
            return await (await self._ready()).fetch(
                f"""WITH candidates AS (
                        SELECT thread_id, message_id, vector FROM {self.schema}.message_vectors
                        WHERE model = $1 AND "resourceId" = $2 AND ($3::text IS NULL OR thread_id = $3) AND length(signs) = $4
                        ORDER BY bit_count(signs # $5) LIMIT $6)
                    SELECT thread_id, message_id, (SELECT sum(a::float8 * b) FROM unnest(vector, $7::real[]) AS t(a, b)) AS score
                    FROM candidates ORDER BY score DESC, message_id LIMIT $8""",
                model,
                resource_id,
                thread_id,
                len(q),
                signs(q),
                max(CANDIDATES, 8 * k),
                q,
                k,
            )

        return [Match(row["message_id"], row["thread_id"], row["score"]) for row in await guarded(self.url, self.timeout, scan())]

    async def erase(self, thread_ids: list[str]) -> None:
        """Take the threads' vectors out, of every model."""

        async def delete() -> None:
            await (await self._ready()).execute(f"DELETE FROM {self.schema}.message_vectors WHERE thread_id = ANY($1)", thread_ids)

        await guarded(self.url, self.timeout, delete())

    async def prune(self, thread_ids: list[str]) -> None:
        """Take out the threads' vectors of messages no longer in their conversation as
        PostgreSQL holds it (erased, superseded), or kept under another resource than the
        thread's owner."""

        async def delete() -> None:
            s = self.schema
            await (await self._ready()).execute(
                f"""DELETE FROM {s}.message_vectors v WHERE v.thread_id = ANY($1) AND NOT EXISTS (
                        SELECT 1 FROM {s}.mastra_messages m JOIN {s}.mastra_threads t ON t.id = m.thread_id
                        WHERE m.thread_id = v.thread_id AND m.id = v.message_id AND m.position IS NOT NULL AND t."resourceId" = v."resourceId")""",
                thread_ids,
            )

        await guarded(self.url, self.timeout, delete())

    async def saved(self, named: list[tuple[str, str]]) -> list[tuple[str, str, str, dict]]:
        """Of the (thread, message id) pairs, the messages in their thread's conversation as
        PostgreSQL holds it: (the thread's owner, thread, id, the stored row)."""

        async def select() -> list:
            s = self.schema
            return await (await self._ready()).fetch(
                f"""SELECT t."resourceId", m.thread_id, m.id, m."row"
                    FROM unnest($1::text[], $2::text[]) AS n(thread_id, id)
                    JOIN {s}.mastra_messages m USING (thread_id, id) JOIN {s}.mastra_threads t ON t.id = m.thread_id
                    WHERE m.position IS NOT NULL AND t."resourceId" IS NOT NULL""",
                [thread for thread, _ in named],
                [mid for _, mid in named],
            )

        return [(r["resourceId"], r["thread_id"], r["id"], msgspec.json.decode(r["row"])) for r in await guarded(self.url, self.timeout, select())]

    async def around(self, resource_id: str, matches: list[Match], before: int, after: int) -> dict[str, list[dict]]:
        """Each match's thread's rows from `before` messages before it to `after` after it in
        the conversation (the union, where matches share a thread), in order: the rows
        `memfilter.core.recall.recall` chooses from. Only of threads `resource_id` owns."""
        if not matches:
            return {}

        async def select() -> list:
            s = self.schema
            return await (await self._ready()).fetch(
                f"""WITH ranked AS (
                        SELECT m.thread_id, m.id, m."row", row_number() OVER (PARTITION BY m.thread_id ORDER BY m.position) AS n
                        FROM {s}.mastra_messages m JOIN {s}.mastra_threads t ON t.id = m.thread_id
                        WHERE m.thread_id = ANY($1) AND t."resourceId" = $2 AND m.position IS NOT NULL),
                    hits AS (SELECT r.thread_id, r.n FROM ranked r JOIN unnest($1::text[], $3::text[]) AS h(thread_id, id) USING (thread_id, id))
                    SELECT DISTINCT r.thread_id, r.n, r."row" FROM ranked r JOIN hits h ON r.thread_id = h.thread_id AND r.n BETWEEN h.n - $4 AND h.n + $5
                    ORDER BY r.thread_id, r.n""",
                [m.thread_id for m in matches],
                resource_id,
                [m.message_id for m in matches],
                before,
                after,
            )

        threads: dict[str, list[dict]] = {}
        for r in await guarded(self.url, self.timeout, select()):
            threads.setdefault(r["thread_id"], []).append({"threadId": r["thread_id"], **msgspec.json.decode(r["row"])})
        return threads

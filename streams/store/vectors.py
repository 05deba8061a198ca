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
`erase` takes a thread's vectors out for good.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import asyncpg
import msgspec

from memfilter.core.recall import Match
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
                self._pool = await open_pool(self.url, self.timeout, SCHEMA.format(s=self.schema), max_size=2)
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

"""What the postgres tier's tests share: a history store with its PostgreSQL tier, on a Redis
key prefix and a PostgreSQL schema of the test's own."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from memfilter.store import reads
from memfilter.store.cold import Warmer
from memfilter.store.history import HistoryStore
from memfilter.store.postgres import PostgresHistory


@pytest.fixture
def tiers(redis_url, postgres_url):
    """Run `fn(make)` in an event loop of its own; `make()` gives a (HistoryStore, PostgresHistory)
    pair on a prefix (and schema) of its own, the store loading cold threads from that schema;
    every prefix's keys and schema are dropped after."""

    def run(fn, pg_url: str | None = None):
        async def go():
            client = aioredis.from_url(redis_url)
            made: list[tuple[HistoryStore, PostgresHistory]] = []

            def make(timeout: float = 5.0) -> tuple[HistoryStore, PostgresHistory]:
                prefix = f"pg-{uuid.uuid4().hex[:8]}"
                pg = PostgresHistory(pg_url or postgres_url, prefix, timeout)
                made.append((HistoryStore(client, prefix, warmer=Warmer(pg)), pg))
                return made[-1]

            try:
                return await fn(make)
            finally:
                for store, pg in made:
                    await reads.drop(store)
                    try:
                        await pg.drop()
                    except Exception:  # a test's stopped PostgreSQL: its schema goes with its server
                        pass
                    await pg.close()
                await client.aclose()

        return asyncio.run(go())

    return run

"""What the redis tier's tests share: a run in an event loop of its own, on key prefixes of its own."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from memfilter.store import reads
from memfilter.store.history import HistoryStore


@pytest.fixture
def redis_run(redis_url):
    """Run `fn(client, prefix)` in an event loop of its own; the prefix's keys are deleted after."""

    def run(fn):
        async def go():
            client = aioredis.from_url(redis_url)
            prefixes = []

            def prefix():
                prefixes.append(f"unit-{uuid.uuid4().hex[:8]}")
                return prefixes[-1]

            try:
                return await fn(client, prefix)
            finally:
                for p in prefixes:
                    await reads.drop(HistoryStore(client, p))
                await client.aclose()

        return asyncio.run(go())

    return run

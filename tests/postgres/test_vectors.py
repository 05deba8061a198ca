"""Message vectors in PostgreSQL (`memfilter.store.vectors`): a search finds the nearest
messages of its resource (and thread), never another resource's or another model's, and a
message put again or erased is as the log says."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from memfilter.store.vectors import MessageVectors, Vector

DIMS = 64


def near(v: list[float], rng: random.Random, noise: float) -> list[float]:
    return [x + rng.gauss(0, noise) for x in v]


@pytest.fixture
def vectors(postgres_url):
    """Run `fn(store)` on a schema of the test's own, dropped after."""

    def run(fn):
        async def go():
            store = MessageVectors(postgres_url, f"vec-{uuid.uuid4().hex[:8]}")
            try:
                return await fn(store)
            finally:
                await store.drop()
                await store.close()

        return asyncio.run(go())

    return run


class TestASearch:
    def test_finds_the_planted_message_first_among_10000_of_its_resource(self, vectors):
        rng = random.Random(59)
        planted = [rng.gauss(0, 1) for _ in range(DIMS)]

        async def go(store: MessageVectors):
            noise = [Vector("m", "r1", f"t{i % 50}", f"m{i}", [rng.gauss(0, 1) for _ in range(DIMS)]) for i in range(10_000)]
            await store.put([*noise, Vector("m", "r1", "t7", "planted", planted)])
            return await store.search("m", "r1", near(planted, rng, 0.5), 4)

        found = vectors(go)
        assert found[0].message_id == "planted" and found[0].thread_id == "t7" and found[0].score > 0.8
        assert [m.score for m in found] == sorted((m.score for m in found), reverse=True)

    def test_never_returns_another_resources_or_another_models_vectors_even_the_same(self, vectors):
        rng = random.Random(1)
        v = [rng.gauss(0, 1) for _ in range(DIMS)]

        async def go(store: MessageVectors):
            await store.put(
                [Vector("m", "r2", "t2", "theirs", v), Vector("other", "r1", "t1", "other-model", v), Vector("m", "r1", "t1", "mine", near(v, rng, 2))]
            )
            return await store.search("m", "r1", v, 4), await store.search("m", "r3", v, 4)

        mine, nobodys = vectors(go)
        assert [m.message_id for m in mine] == ["mine"] and nobodys == []

    def test_within_a_thread_finds_only_that_threads_messages(self, vectors):
        rng = random.Random(2)
        v = [rng.gauss(0, 1) for _ in range(DIMS)]

        async def go(store: MessageVectors):
            await store.put([Vector("m", "r1", "t1", "a", v), Vector("m", "r1", "t2", "b", v)])
            return await store.search("m", "r1", v, 4, thread_id="t2")

        assert [(m.thread_id, m.message_id) for m in vectors(go)] == [("t2", "b")]


class TestWhatTheLogSays:
    def test_a_vector_put_again_replaces_it_and_an_erased_thread_is_never_found(self, vectors):
        rng = random.Random(3)
        first, second = [rng.gauss(0, 1) for _ in range(DIMS)], [rng.gauss(0, 1) for _ in range(DIMS)]

        async def go(store: MessageVectors):
            await store.put([Vector("m", "r1", "t1", "a", first), Vector("m", "r1", "t2", "b", first)])
            await store.put([Vector("m", "r1", "t1", "a", second), Vector("m", "r1", "t1", "a", second)])
            again = await store.search("m", "r1", second, 1)
            await store.erase(["t1"])
            return again, await store.search("m", "r1", second, 4)

        again, after = vectors(go)
        assert again[0].message_id == "a" and again[0].score == pytest.approx(1.0)
        assert [m.message_id for m in after] == ["b"]

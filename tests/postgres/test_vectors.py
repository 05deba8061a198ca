"""Message vectors in PostgreSQL (`memfilter.store.vectors`): a search finds the nearest
messages of its resource (and thread), never another resource's or another model's, and a
message put again or erased is as the log says. The rows around a match, and what is embedded,
come from the conversation as the sink wrote it, only of the resource that owns the thread."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from memfilter.core.recall import Match
from memfilter.store.postgres import PostgresHistory, Thread
from memfilter.store.vectors import MessageVectors, Vector

DIMS = 64


def near(v: list[float], rng: random.Random, noise: float) -> list[float]:
    return [x + rng.gauss(0, noise) for x in v]


@pytest.fixture
def vectors(postgres_url):
    """Run `fn(store)` on a schema of the test's own, dropped after."""

    def run(fn):
        async def go():
            prefix = f"vec-{uuid.uuid4().hex[:8]}"
            store = MessageVectors(postgres_url, prefix)
            store.history = PostgresHistory(postgres_url, prefix)  # the sink's writes, beside
            try:
                return await fn(store)
            finally:
                await store.history.drop()
                await store.history.close()
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


def thread(tid: str, owner: str | None, n: int, superseded: tuple[int, ...] = ()) -> Thread:
    """A thread of `n` user messages `<tid>-m<i>`, some taken out of the conversation, as the sink writes it."""
    ids = [f"{tid}-m{i}" for i in range(n)]
    rows = {
        mid: f'{{"id":"{mid}","role":"user","content":{{"format":2,"parts":[{{"type":"text","text":"say {mid}"}}]}},"createdAt":"2026-01-01T00:00:0{i % 10}.000Z"}}'.encode()
        for i, mid in enumerate(ids)
    }
    gone = {ids[i]: "q9" for i in superseded}
    return Thread(tid, n, owner, None, None, [m for m in ids if m not in gone], rows if owner else {}, gone, b"", 1)


class TestTheRowsAroundAMatch:
    def test_are_its_neighbours_in_the_conversation_superseded_rows_skipped(self, vectors):
        async def go(store: MessageVectors):
            await store.history.write([thread("t1", "r1", 10, superseded=(5,))])
            return await store.around("r1", [Match("t1-m4", "t1", 0.9), Match("t1-m0", "t1", 0.5)], 1, 1)

        assert [r["id"] for r in vectors(go)["t1"]] == ["t1-m0", "t1-m1", "t1-m3", "t1-m4", "t1-m6"]

    def test_are_never_of_another_resources_thread_nor_of_an_erased_one(self, vectors):
        async def go(store: MessageVectors):
            await store.history.write([thread("theirs", "r2", 3), thread("erased", None, 3)])
            return await store.around("r1", [Match("theirs-m1", "theirs", 0.9), Match("erased-m1", "erased", 0.9)], 1, 1)

        assert vectors(go) == {}


class TestWhatIsEmbeddedAndKept:
    def test_only_messages_of_the_conversation_under_the_threads_owner(self, vectors):
        async def go(store: MessageVectors):
            await store.history.write([thread("t1", "r1", 3, superseded=(1,)), thread("erased", None, 2)])
            return await store.saved([("t1", "t1-m0"), ("t1", "t1-m1"), ("t1", "nope"), ("erased", "erased-m0"), ("t2", "t1-m2")])

        assert [(owner, t, mid, row["id"]) for owner, t, mid, row in vectors(go)] == [("r1", "t1", "t1-m0", "t1-m0")]

    def test_pruning_takes_out_what_left_the_conversation_or_sits_under_another_resource(self, vectors):
        v = [1.0] * DIMS

        async def go(store: MessageVectors):
            await store.history.write([thread("t1", "r1", 3, superseded=(1,)), thread("erased", None, 2)])
            await store.put(
                [
                    Vector("m", "r1", "t1", "t1-m0", v),  # kept
                    Vector("m", "r1", "t1", "t1-m1", v),  # superseded since
                    Vector("m", "r9", "t1", "t1-m2", v),  # under another resource than the owner
                    Vector("m", "r1", "erased", "erased-m0", v),
                    Vector("m", "r1", "t2", "t2-m0", v),  # a thread not named: untouched
                ]
            )
            await store.prune(["t1", "erased"])
            return [m.message_id for m in await store.search("m", "r1", v, 10)] + [m.message_id for m in await store.search("m", "r9", v, 10)]

        assert sorted(vectors(go)) == ["t1-m0", "t2-m0"]

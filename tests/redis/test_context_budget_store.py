"""The context's token budget against a real Redis: counts written beside the rows by both
writers and by a rebuild, read back in the batch's round trips and weighed as stored, and
every context the processor emits within the budget."""

from __future__ import annotations

import json

import pytest
from factories import SECRET, T0, msg

from memfilter.audit.recorded import Recorded
from memfilter.audit.replay import apply_log
from memfilter.core.filter import Policy
from memfilter.core.tokens import ESTIMATE
from memfilter.core.window import Budget
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store import reads
from memfilter.store.history import HistoryStore

TOPICS = Topics()
BUDGET = Policy(budget=Budget(200))


def request(thread: str, messages: list, offset: int, **fields) -> Record:
    value = {"requestId": f"q{offset}", "threadId": thread, "resourceId": "r1", "messages": messages, **fields}
    return Record(TOPICS.requests, 0, offset, T0 + offset, thread.encode(), json.dumps(value).encode())


def reply(thread: str, mid: str, text: str, offset: int) -> Record:
    """The agent runner's save of an answer (another service's event)."""
    row = msg(mid, role="assistant", text=text, threadId=thread, resourceId="r1", createdAt=f"2026-03-01T12:00:{offset:02d}.000Z")
    value = json.dumps({"requestId": f"reply-{mid}", "threadId": thread, "resourceId": "r1", "messages": [row]}).encode()
    return Record(TOPICS.persist, 0, offset, T0 + offset, thread.encode(), value)


def as_record(out, offset: int) -> Record:
    return Record(out.topic, 0, offset, out.timestamp_ms or T0, out.key, out.value, out.headers)


def on(topic: str, outs) -> list[dict]:
    return [json.loads(o.value) for o in outs if o.topic == topic]


@pytest.fixture
def store_run(redis_run):
    """Run `fn(store, make_store)`: a store counting as the budget does, and a maker of more
    (given a counter, or None), each on a prefix of its own (`redis_run`)."""

    def run(fn):
        async def go(client, prefix):
            def make(counter=ESTIMATE):
                return HistoryStore(client, prefix(), counter=counter)

            return await fn(make(), make)

        return redis_run(go)

    return run


async def conversation(store: HistoryStore, turns: int) -> tuple[list, list[Record]]:
    """`turns` useChat turns on thread t: each request echoes everything, each answer is saved by
    the runner's event; the filtered inputs, and every persist event in log order."""
    processor, persister = Processor(store, TOPICS, BUDGET, secret=SECRET), Persister(store, TOPICS.dlq, SECRET)
    said, filtered, log = [], [], []
    for n in range(turns):
        said.append(msg(f"u{n}", text=f"question number {n}, " + "with some words " * (n % 4)))
        outs = await processor.process([request("t", said, 2 * n)])
        filtered += on(TOPICS.filtered, outs)
        log += [as_record(o, len(log)) for o in outs if o.topic == TOPICS.persist]
        answer = reply("t", f"a{n}", f"answer {n}: " + "and so on " * (3 * (n % 3)), len(log))
        assert await persister.process([answer]) == []
        log.append(answer)
        said.append(json.loads(answer.value)["messages"][0])
    return filtered, log


async def stored_counts(store: HistoryStore, thread: str) -> dict[str, bytes]:
    return {k.decode(): v for k, v in (await store.redis.hgetall(store.keys(thread).tokens)).items()}


class TestCountsStoredWithTheRows:
    def test_both_writers_store_each_rows_count_and_a_rebuild_stores_the_same(self, store_run):
        async def go(store, make):
            _, log = await conversation(store, 6)
            rows = {json.loads(r)["id"]: r for r in await reads.thread_rows(store, "t")}
            live = await stored_counts(store, "t")
            rebuilt = make()
            with Recorded.temporary(TOPICS, SECRET) as recorded:
                recorded.add_persisted(log)
                await apply_log(recorded, rebuilt)
            return rows, live, await stored_counts(rebuilt, "t")

        rows, live, rebuilt = store_run(go)
        assert sorted(live) == sorted(rows) and len(rows) == 12  # the processor's user rows and the runner's answers
        assert live == {mid: f"e{ESTIMATE.row(row)!r}".encode() for mid, row in rows.items()}
        assert rebuilt == live

    def test_without_a_budget_nothing_is_counted_or_stored(self, store_run):
        async def go(store, make):
            plain = make(counter=None)
            outs = await Processor(plain, TOPICS, Policy(), secret=SECRET).process([request("t", [msg("u0")], 0)])
            return on(TOPICS.filtered, outs), await stored_counts(plain, "t")

        (filtered,), counts = store_run(go)
        assert "contextTokens" not in filtered and counts == {}

    def test_a_processor_with_a_budget_refuses_a_store_that_does_not_count(self, store_run):
        async def go(store, make):
            with pytest.raises(ValueError, match="needs a HistoryStore made with that counter"):
                Processor(make(counter=None), TOPICS, BUDGET, secret=SECRET)

        store_run(go)


class TestTheWindowWeighsStoredCounts:
    def test_every_context_fits_the_budget_and_starts_on_a_user_row(self, store_run):
        filtered, _ = store_run(lambda store, make: conversation(store, 12))
        assert len(filtered) == 12
        for f in filtered:
            conversation_ = [m for m in f["context"] if m["role"] != "system"]
            assert f["contextTokens"] <= 200 and conversation_[0]["role"] == "user"
            assert f["contextTokens"] == pytest.approx(24 + sum(ESTIMATE.message(m) for m in f["context"]))
        assert len(filtered[-1]["context"]) < 23  # the budget, not the row cap, cut the late ones

    def test_a_count_is_read_from_the_store_not_made_again(self, store_run):
        async def go(store, make):
            await conversation(store, 3)
            said = [json.loads(r) for r in await reads.thread_rows(store, "t")]
            processor = Processor(store, TOPICS, BUDGET, secret=SECRET)
            before = on(TOPICS.filtered, await processor.process([request("t", [*said, msg("u3", text="next")], 100)]))[0]
            await store.redis.hset(store.keys("t").tokens, "a1", "e150.0")  # as if a1 weighed 150 tokens when saved
            trips = processor.metrics.value("memfilter_redis_round_trips_total")
            after = on(TOPICS.filtered, await processor.process([request("t", [*said, msg("u3", text="next"), msg("u4", text="and then")], 101)]))
            return before, after, processor.metrics.value("memfilter_redis_round_trips_total") - trips

        before, (after,), trips = store_run(go)
        assert [m["id"] for m in before["context"]] == ["u0", "a0", "u1", "a1", "u2", "a2", "u3"]
        assert [m["id"] for m in after["context"]] == ["u2", "a2", "u3", "u4"]  # a1 now too heavy: u1 and a1 leave
        assert trips == 4  # read, id owners, claim, commit: the counts came with the rows

    def test_a_request_whose_own_part_is_over_the_budget_is_a_dead_letter_and_writes_nothing(self, store_run):
        async def go(store, make):
            await conversation(store, 2)
            version = await store.redis.hget(store.keys("t").meta, "version")
            said = [json.loads(r) for r in await reads.thread_rows(store, "t")]
            outs = await Processor(store, TOPICS, BUDGET, secret=SECRET).process([request("t", [*said, msg("u9", text="word " * 400)], 50)])
            return outs, version, await store.redis.hget(store.keys("t").meta, "version")

        outs, before, after = store_run(go)
        (letter,) = outs
        headers = dict(letter.headers)
        assert letter.topic == TOPICS.dlq and headers["error.type"] == b"context-budget"
        assert b"the context budget is 200" in headers["error.message"] and b"come to 4" in headers["error.message"]
        assert before == after

    def test_a_context_no_turn_of_history_fits_is_marked_and_counted_or_refused_as_set(self, store_run):
        """The last answer is too heavy for the budget beside the new question: the filtered input
        says the history was left out (and the metric counts it); MEMFILTER_CONTEXT_NO_HISTORY=refuse
        dead-letters it instead, writing nothing."""

        async def go(store, make):
            await conversation(store, 1)
            await store.redis.hset(store.keys("t").tokens, "a0", "e190.0")  # as if a0 weighed 190 tokens when saved
            said = [json.loads(r) for r in await reads.thread_rows(store, "t")]
            sent = Processor(store, TOPICS, BUDGET, secret=SECRET)
            outs = await sent.process([request("t", [*said, msg("u1", text="next")], 10)])
            refusing = Processor(store, TOPICS, Policy(budget=Budget(200, ESTIMATE, "refuse")), secret=SECRET)
            refused = await refusing.process([request("t", [*said, msg("u1", text="next"), msg("u2", text="again")], 11)])
            return on(TOPICS.filtered, outs), sent.metrics.value("memfilter_context_history_left_out_total"), refused

        (filtered,), counted, refused = store_run(go)
        assert [m["id"] for m in filtered["context"]] == ["u1"] and filtered["historyLeftOut"] is True and counted == 1
        (letter,) = refused
        assert letter.topic == TOPICS.dlq and dict(letter.headers)["error.type"] == b"context-budget"
        assert b"not even the newest whole turn" in dict(letter.headers)["error.message"]

"""A second message while the reply to the first is still being made (MEMFILTER_CONCURRENT_TURNS):
the processor and the persister against a real Redis, without Kafka.

A decision that asks the model for an answer marks its thread replying to its request; the
save of that reply (`<requestId>/reply`, applied by the persister) ends the mark. Under
`reject`, a request in between is refused (`busy-thread`) and writes nothing; under
`concurrent`, today's behaviour, it is decided at once; under `enqueue` it waits, emitting
nothing, until a wake (`memfilter.runtime.turns`, here called as the worker calls it) decides
it after the reply; `interrupt` waits the same and stops that reply first.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import msgspec
import pytest
import redis.asyncio as aioredis
from factories import SECRET, T0, msg

from memfilter.audit.recorded import Recorded
from memfilter.audit.replay import replay_log
from memfilter.core import origin, replies
from memfilter.core.filter import Policy
from memfilter.metrics import Metrics
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Out, Record
from memfilter.runtime.turns import Turns
from memfilter.schemas.wire import FilteredInput, StopReply
from memfilter.settings import Topics
from memfilter.store import reads
from memfilter.store.history import HistoryStore

TOPICS = Topics()


def request(n: int, messages: list, at_ms: int | None = None, **fields) -> Record:
    """Request q<n> of thread t, at offset n (record time T0 + n s, unless `at_ms`)."""
    value = {"requestId": f"q{n}", "threadId": "t", "resourceId": "r1", "messages": messages, **fields}
    return Record(TOPICS.requests, 0, n, T0 + n * 1000 if at_ms is None else at_ms, b"t", json.dumps(value).encode())


def reply(n: int, mid: str, offset: int = 0) -> Record:
    """The agent runner's save of its reply to request q<n>."""
    row = msg(mid, role="assistant", text="echo", threadId="t", createdAt="2026-03-01T10:00:00Z")
    value = {"requestId": f"q{n}/reply", "threadId": "t", "resourceId": "r1", "messages": [row]}
    return Record(TOPICS.persist, 0, offset, T0, b"t", json.dumps(value).encode())


def filtered(outs) -> list[FilteredInput]:
    return [msgspec.json.decode(o.value, type=FilteredInput) for o in outs if o.topic == TOPICS.filtered]


def context_ids(outs) -> list[str]:
    [decided] = [msgspec.json.decode(o.value) for o in outs if o.topic == TOPICS.filtered]
    return [m["id"] for m in decided["context"]]


def as_records(outs: list[Out], offset: int, at_ms: int) -> list[Record]:
    """Records sent by the worker, as consumed: from `offset` on, at `at_ms`."""
    return [Record(o.topic, 0, offset + n, at_ms, o.key, o.value, o.headers) for n, o in enumerate(outs)]


def refusals(outs) -> list[str]:
    return [dict(o.headers)["error.type"].decode() for o in outs if o.topic == TOPICS.dlq]


def why(outs) -> str:
    [letter] = [o for o in outs if o.topic == TOPICS.dlq]
    return dict(letter.headers)["error.message"].decode()


def accepted(outs) -> int:
    return len([o for o in outs if o.topic == TOPICS.filtered])


@pytest.fixture
def turns(redis_url):
    """Run `fn(processor, persister, store)` with the processor deciding under `policy`."""

    def run(policy: Policy, fn):
        async def go():
            client = aioredis.from_url(redis_url)
            store = HistoryStore(client, f"turns-{uuid.uuid4().hex[:8]}")
            try:
                processor = Processor(store, TOPICS, policy, secret=SECRET)
                processor.turns = Turns(store, TOPICS, SECRET, policy.turn_wait_ms, Metrics())  # the worker's, beside it
                return await fn(processor, Persister(store, TOPICS.dlq, SECRET), store)
            finally:
                await reads.drop(store)
                await client.aclose()

        return asyncio.run(go())

    return run


FIRST = [msg("u0", text="first")]
SECOND = [msg("u0", text="first"), msg("u1", text="second")]  # sent before the reply to the first came


class TestReject:
    def test_a_request_while_the_reply_is_being_made_is_refused_naming_it_and_writes_nothing(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            version = (await reads.meta(store, "t")).version
            outs = await processor.process([request(1, SECOND)])
            return outs, version, (await reads.meta(store, "t")).version

        outs, before, after = turns(Policy(turns="reject"), go)
        assert refusals(outs) == ["busy-thread"] and accepted(outs) == 0 and before == after
        assert "answering request q0; request q1 refused" in why(outs) and "send it again once that reply ends" in why(outs)

    def test_once_the_reply_is_saved_the_next_request_is_decided_after_it(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            assert await persister.process([reply(0, "a0")]) == []
            outs = await processor.process([request(1, [*FIRST, msg("a0", role="assistant", text="echo"), msg("u1", text="second")])])
            return outs, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t")]

        outs, order = turns(Policy(turns="reject"), go)
        assert accepted(outs) == 1 and order == ["u0", "a0", "u1"]

    def test_a_reply_not_saved_within_the_wait_holds_the_thread_no_longer(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST, at_ms=T0)])
            early = await processor.process([request(1, SECOND, at_ms=T0 + 59_999)])
            late = await processor.process([request(2, SECOND, at_ms=T0 + 60_000)])
            then = await processor.process([request(3, [*SECOND, msg("u3")], at_ms=T0 + 60_001)])  # the late one is being answered now
            return early, late, then

        early, late, then = turns(Policy(turns="reject", turn_wait_ms=60_000), go)
        assert refusals(early) == ["busy-thread"] and accepted(late) == 1 and refusals(then) == ["busy-thread"]
        assert "answering request q2" in why(then)

    def test_a_request_that_asks_for_no_answer_leaves_the_thread_free(self, turns):
        async def go(processor, persister, store):
            # the client saves an answer it made itself: the model is not asked
            await processor.process([request(0, [msg("u0"), msg("a0", role="assistant", text="mine")])])
            return await processor.process([request(1, [msg("u0"), msg("a0", role="assistant", text="mine"), msg("u1")])])

        assert accepted(turns(Policy(turns="reject"), go)) == 1

    def test_a_reply_that_will_not_come_ends_the_wait_when_the_runner_says_so(self, turns):
        async def go(processor, persister, store):
            [decided] = [o for o in await processor.process([request(0, FIRST)]) if o.topic == TOPICS.filtered]
            # the runner dead-lettered the input (the model refused it): it saves an empty reply
            ended = replies.no_reply_event(msgspec.json.decode(decided.value, type=FilteredInput))
            assert await persister.process([Record(TOPICS.persist, 0, 0, T0, b"t", ended)]) == []
            return await processor.process([request(1, SECOND)]), (await reads.meta(store, "t")).size

        outs, rows = turns(Policy(turns="reject"), go)
        assert accepted(outs) == 1 and rows == 2  # the empty reply saved nothing

    def test_a_reply_to_another_request_ends_nothing(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            await persister.process([reply(7, "a7")])  # a late reply to an older request
            return await processor.process([request(1, [*FIRST, msg("u1")])])

        assert refusals(turns(Policy(turns="reject"), go)) == ["busy-thread"]


async def save_reply(processor: Processor, persister: Persister, n: int, mid: str, offset: int = 0) -> set[str]:
    """The runner's reply to q<n> saved, as the worker applies it: the threads it makes due."""
    due: set[str] = set()
    assert not [r for r in await persister.apply([reply(n, mid, offset)], due) if not isinstance(r, int)]
    return due


async def wake(processor: Processor, threads: set[str], at_ms: int, offset: int) -> list[Out]:
    """What the worker does after a batch: wake the due threads, then decide the wakes."""
    wakes = (await processor.turns.wake(dict.fromkeys(threads, 0), at_ms)).get(0, [])
    return await processor.process(as_records(wakes, offset, at_ms)) if wakes else []


ENQUEUE = Policy(turns="enqueue", turn_wait_ms=60_000)
AFTER_A0 = [*FIRST, msg("a0", role="assistant", text="echo"), msg("u1", text="second")]  # what the second tab sends once it sees the reply


class TestEnqueue:
    def test_a_request_while_the_reply_is_being_made_waits_and_emits_nothing(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            outs = await processor.process([request(1, SECOND)])
            return outs, await reads.meta(store, "t")

        outs, meta = turns(ENQUEUE, go)
        assert outs == [] and meta.size == 1  # u1 not stored yet: it is decided after the reply

    def test_once_the_reply_is_saved_the_waiting_request_is_decided_after_it_with_the_reply_in_its_context(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            await processor.process([request(1, SECOND)])
            due = await save_reply(processor, persister, 0, "a0")
            outs = await wake(processor, due, T0 + 5_000, offset=10)
            return due, outs, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t")]

        due, outs, order = turns(ENQUEUE, go)
        assert due == {"t"} and order == ["u0", "a0", "u1"] and context_ids(outs) == ["u0", "a0", "u1"]
        [decided] = filtered(outs)
        assert decided.source.offset == 1 and decided.waited.ms == 4_000 and not decided.waited.lapsed  # q1 at T0 + 1 s, woken at T0 + 5 s

    def test_requests_waiting_are_decided_one_reply_after_the_other_in_their_order(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            third = [*SECOND, msg("u2", text="third")]
            assert await processor.process([request(1, SECOND), request(2, third)]) == []
            first = await wake(processor, await save_reply(processor, persister, 0, "a0"), T0 + 5_000, offset=10)
            early = await wake(processor, {"t"}, T0 + 5_001, offset=11)  # q1 is being answered now: q2 waits on
            second = await wake(processor, await save_reply(processor, persister, 1, "a1", offset=1), T0 + 6_000, offset=12)
            return first, early, second, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t")]

        first, early, second, order = turns(ENQUEUE, go)
        assert [f.requestId for f in filtered(first)] == ["q1"] and early == [] and [f.requestId for f in filtered(second)] == ["q2"]
        assert order == ["u0", "a0", "u1", "a1", "u2"] and context_ids(second) == order

    def test_a_reply_not_saved_within_the_wait_lets_the_waiting_request_go_and_says_so(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST, at_ms=T0)])
            await processor.process([request(1, SECOND, at_ms=T0 + 1_000)])
            before = await wake(processor, {"t"}, T0 + 59_999, offset=10)
            after = await wake(processor, {"t"}, T0 + 60_000, offset=11)
            return before, after

        before, after = turns(ENQUEUE, go)
        [decided] = filtered(after)
        assert before == [] and decided.waited.lapsed and decided.waited.ms == 59_000 and context_ids(after) == ["u0", "u1"]

    def test_the_metrics_count_waits_interruptions_lapses_and_refusals(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST, at_ms=T0)])
            await processor.process([request(1, SECOND, at_ms=T0 + 1_000)])
            await wake(processor, {"t": 0}, T0 + 60_000, offset=10)  # lapsed: q1 answered now
            await processor.process([request(2, [*SECOND, msg("u2")], at_ms=T0 + 60_001, concurrentTurns="interrupt")])
            await processor.process([request(3, [*SECOND, msg("u3")], at_ms=T0 + 60_002, concurrentTurns="reject")])
            m = processor.metrics
            return {how: m.value("memfilter_turns_total", how=how) for how in ("waited", "interrupted", "lapsed", "rejected")}, m.value(
                "memfilter_turn_waited_seconds_sum"
            )

        counts, waited = turns(ENQUEUE, go)
        assert counts == {"waited": 2, "interrupted": 0, "lapsed": 1, "rejected": 1} and waited == 59.0

    def test_a_wake_consumed_again_emits_the_same_bytes_and_another_wake_nothing(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            await processor.process([request(1, SECOND)])
            await save_reply(processor, persister, 0, "a0")
            wakes = as_records((await processor.turns.wake({"t": 0}, T0 + 5_000))[0], 10, T0 + 5_000)
            first = await processor.process(wakes)
            again = await processor.process(wakes)  # its transaction aborted: consumed again
            other = await processor.process(
                as_records(
                    (await processor.turns.wake({"t": 0}, T0 + 5_000)).get(0, []) or [Out(TOPICS.requests, b"t", wakes[0].value, None, wakes[0].headers)],
                    11,
                    T0 + 5_001,
                )
            )
            return first, again, other, (await reads.meta(store, "t")).version

        first, again, other, version = turns(ENQUEUE, go)
        assert first and [o.value for o in again] == [o.value for o in first] and other == [] and version == 3

    def test_a_request_refused_once_woken_leaves_the_queue_and_its_dead_letter_comes_again_the_same(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            await processor.process([request(1, [*FIRST, msg("shared")]), request(2, [*FIRST, msg("u2")])])
            other = {"requestId": "x", "threadId": "t2", "resourceId": "r1", "messages": [msg("shared")]}
            await processor.process([Record(TOPICS.requests, 0, 3, T0 + 3_000, b"t2", json.dumps(other).encode())])  # takes the id meanwhile
            await save_reply(processor, persister, 0, "a0")
            wakes = as_records((await processor.turns.wake({"t": 0}, T0 + 5_000))[0], 10, T0 + 5_000)
            first, again = await processor.process(wakes), await processor.process(wakes)
            return first, again, await processor.turns.wake({"t": 0}, T0 + 5_001)

        first, again, next_wake = turns(ENQUEUE, go)
        assert refusals(first) == ["foreign-message-id"] and [(o.value, o.headers) for o in again] == [(o.value, o.headers) for o in first]
        assert "memfilter.waited" in dict(first[0].headers) and "memfilter.history-version" in dict(first[0].headers)
        assert next_wake  # q2's turn: it no longer waits behind the refused one

    def test_a_forged_wake_is_refused_and_wakes_nothing(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            await processor.process([request(1, SECOND)])
            [head] = await store.transport.pipeline([("LINDEX", store.keys("t").waiting, 0)])
            forged = Record(TOPICS.requests, 0, 9, T0 + 2_000, b"t", head, origin.wake_headers(b"t", head, b"not-the-secret"))
            return await processor.process([forged]), (await reads.meta(store, "t")).size

        outs, size = turns(ENQUEUE, go)
        assert refusals(outs) == ["origin"] and size == 1

    def test_another_thread_is_never_held_by_a_waiting_one(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            other = Record(
                TOPICS.requests, 0, 2, T0, b"t2", json.dumps({"requestId": "x", "threadId": "t2", "resourceId": "r1", "messages": [msg("v0")]}).encode()
            )
            return await processor.process([request(1, SECOND), other])

        assert [f.threadId for f in filtered(turns(ENQUEUE, go))] == ["t2"]

    def test_a_batch_of_many_lanes_indexes_every_thread_that_waits(self, turns):
        async def go(processor, persister, store):
            records = []
            for i in range(150):  # 300 records: several lanes
                for n, messages in ((0, [msg(f"x{i}")]), (1, [msg(f"x{i}"), msg(f"y{i}")])):
                    value = {"requestId": f"q{n}", "threadId": f"t{i}", "resourceId": "r1", "messages": messages}
                    records.append(Record(TOPICS.requests, 0, len(records), T0 + n, f"t{i}".encode(), json.dumps(value).encode()))
            return await processor.decide_batch(records)

        decided = turns(ENQUEUE, go)
        assert len({o.value for outs in decided.outs for o in outs if o.topic == TOPICS.filtered}) == 150  # the first of each thread
        assert decided.waits == {f"t{i}": (0, T0 + 60_000) for i in range(150)}

    def test_an_erasure_drops_what_waits_with_the_thread(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            await processor.process([request(1, SECOND)])
            meta = await reads.meta(store, "t")
            await store.erase("t", meta.version, b"erasure1", 1)
            return await store.transport.pipeline([("EXISTS", store.keys("t").waiting)])

        assert turns(ENQUEUE, go) == [0]


class TestInterrupt:
    def test_a_request_stops_the_reply_being_made_then_is_decided_after_what_it_saved(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            waits = await processor.process([request(1, SECOND, concurrentTurns="interrupt")])
            # the runner stops and saves what it made, finish reason `interrupted`
            outs = await wake(processor, await save_reply(processor, persister, 0, "a0"), T0 + 2_000, offset=10)
            return waits, outs

        waits, outs = turns(Policy(turns="interrupt"), go)
        [stop] = [msgspec.json.decode(o.value, type=StopReply) for o in waits if o.topic == TOPICS.stops]
        assert [o.topic for o in waits] == [TOPICS.stops] and (stop.threadId, stop.resourceId, stop.requestId) == ("t", "r1", "q0")
        assert context_ids(outs) == ["u0", "a0", "u1"]

    def test_a_reply_that_goes_on_is_stopped_again_by_the_sweep(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST, at_ms=T0)])
            await processor.process([request(1, SECOND, at_ms=T0 + 1_000)])
            return await processor.turns.wake({"t": 0}, T0 + 7_000)

        outs = turns(Policy(turns="interrupt"), go)
        assert [o.topic for o in outs[0]] == [TOPICS.stops]

    def test_a_request_behind_waiting_ones_does_not_stop_their_turn(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            first = await processor.process([request(1, SECOND, concurrentTurns="enqueue")])
            second = await processor.process([request(2, [*SECOND, msg("u2")])])
            return first, second

        first, second = turns(Policy(turns="interrupt"), go)
        assert first == [] and second == []


class TestConcurrentAndNarrowing:
    def test_concurrent_decides_the_second_request_at_once_as_before(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            return await processor.process([request(1, SECOND)])

        assert accepted(turns(Policy(), go)) == 1

    def test_a_request_may_ask_for_reject_on_a_concurrent_deployment(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            return await processor.process([request(1, SECOND, concurrentTurns="reject")])

        assert refusals(turns(Policy(), go)) == ["busy-thread"]

    def test_a_request_cannot_ask_for_concurrent_on_a_reject_deployment(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            return await processor.process([request(1, SECOND, concurrentTurns="concurrent")])

        assert refusals(turns(Policy(turns="reject"), go)) == ["busy-thread"]

    def test_a_request_may_ask_to_wait_on_a_concurrent_deployment_but_not_to_interrupt_an_enqueue_one(self, turns):
        async def go(processor, persister, store):
            await processor.process([request(0, FIRST)])
            return await processor.process([request(1, SECOND, concurrentTurns="enqueue")])

        async def louder(processor, persister, store):
            await processor.process([request(0, FIRST)])
            return await processor.process([request(1, SECOND, concurrentTurns="interrupt")])

        assert turns(Policy(), go) == [] and turns(ENQUEUE, louder) == []  # waits, and stops nothing

    def test_an_unknown_policy_on_a_request_is_refused_as_a_schema_error(self, turns):
        async def go(processor, persister, store):
            return await processor.process([request(0, FIRST, concurrentTurns="whenever")])

        assert refusals(turns(Policy(), go)) == ["schema"]


class TestReplay:
    """A replay decides each request again on the history its recorded decision saw: a refusal
    for a busy thread comes out the same, in a whole log and in a range that begins after the
    request whose reply was being made."""

    @staticmethod
    async def live(processor: Processor, persister: Persister) -> tuple[list[Record], list[Record], list[Record], list[Record]]:
        """q0 answered, q1 refused while its reply was being made, the reply saved, q2 decided:
        the requests, and the filtered inputs, dead letters and persist events recorded."""
        requests = [request(0, FIRST), request(1, SECOND), request(2, [*FIRST, msg("a0", role="assistant", text="echo"), msg("u2")])]
        outs = await processor.process(requests[:2])
        answer = reply(0, "a0", offset=1)
        assert await persister.process([answer]) == []
        outs += await processor.process(requests[2:])
        as_record = [Record(o.topic, 0, n, o.timestamp_ms, o.key, o.value, o.headers) for n, o in enumerate(outs)]
        persisted = [r for r in as_record if r.topic == TOPICS.persist]
        log = [msgspec.structs.replace(persisted[0], offset=0), answer, msgspec.structs.replace(persisted[1], offset=2)]  # as appended
        return requests, [r for r in as_record if r.topic == TOPICS.filtered], [r for r in as_record if r.topic == TOPICS.dlq], log

    @pytest.mark.parametrize("first", [0, 1], ids=["the whole log", "from the refused request on"])
    def test_a_busy_thread_refusal_replays_identical(self, turns, redis_url, first):
        async def go(processor, persister, store):
            requests, filtered, dead, log = await self.live(processor, persister)
            assert refusals(dead) == ["busy-thread"]
            client = aioredis.from_url(redis_url)
            replay_store = HistoryStore(client, f"replay-{uuid.uuid4().hex[:8]}")

            async def batches():
                yield requests[first:]

            try:
                with Recorded.temporary(TOPICS, SECRET) as recorded:
                    recorded.add_filtered(filtered)
                    recorded.add_dead(dead)
                    recorded.add_persisted(log)
                    return await replay_log(recorded, replay_store, batches(), Policy(turns="reject"))
            finally:
                await reads.drop(replay_store)
                await client.aclose()

        report = turns(Policy(turns="reject"), go)
        assert report.requests == 3 - first and report.differences == []

    def test_a_request_that_waited_replays_identical_after_the_same_save_and_its_wake_is_no_request(self, turns, redis_url):
        async def go(processor, persister, store):
            requests = [request(0, FIRST), request(1, SECOND)]
            outs = await processor.process(requests)
            answer = reply(0, "a0", offset=1)
            due: set[str] = set()
            await persister.apply([answer], due)
            [wake_out] = (await processor.turns.wake(dict.fromkeys(due, 0), T0 + 5_000))[0]
            [woken] = as_records([wake_out], 2, T0 + 5_000)
            outs += await processor.process([woken])
            as_record = [Record(o.topic, 0, n, o.timestamp_ms, o.key, o.value, o.headers) for n, o in enumerate(outs)]
            persisted = [r for r in as_record if r.topic == TOPICS.persist]
            log = [msgspec.structs.replace(persisted[0], offset=0), answer, msgspec.structs.replace(persisted[1], offset=2)]
            client = aioredis.from_url(redis_url)
            replay_store = HistoryStore(client, f"replay-{uuid.uuid4().hex[:8]}")

            async def batches():
                yield [*requests, woken]  # the wake is on chat-requests, after the request it woke

            try:
                with Recorded.temporary(TOPICS, SECRET) as recorded:
                    recorded.add_filtered([r for r in as_record if r.topic == TOPICS.filtered])
                    recorded.add_persisted(log)
                    return filtered(outs), await replay_log(recorded, replay_store, batches(), ENQUEUE)
            finally:
                await reads.drop(replay_store)
                await client.aclose()

        decided, report = turns(ENQUEUE, go)
        assert [f.requestId for f in decided] == ["q0", "q1"] and decided[1].waited is not msgspec.UNSET
        assert report.requests == 2 and report.differences == []

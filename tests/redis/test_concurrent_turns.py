"""A second message while the reply to the first is still being made (MEMFILTER_CONCURRENT_TURNS):
the processor and the persister against a real Redis, without Kafka.

A decision that asks the model for an answer marks its thread replying to its request; the
save of that reply (`<requestId>/reply`, applied by the persister) ends the mark. Under
`reject`, a request in between is refused (`busy-thread`) and writes nothing; under
`concurrent`, today's behaviour, it is decided at once.
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
from memfilter.core import replies
from memfilter.core.filter import Policy
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.schemas.wire import FilteredInput
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
                return await fn(Processor(store, TOPICS, policy, secret=SECRET), Persister(store, TOPICS.dlq, SECRET), store)
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

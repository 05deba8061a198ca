"""The processor and the persister against a real Redis, without Kafka: the batch rules.

Concurrency the end-to-end tests cannot time reliably is provoked here by hand: another
writer saving between a batch's read and its commit, two threads claiming one new id, the
same request twice in one batch, and the persister applying events twice.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import msgspec
import pytest
import redis.asyncio as aioredis
from factories import SECRET, T0, msg
from redis.exceptions import BusyLoadingError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from memfilter.core import origin
from memfilter.core.filter import Policy
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store import reads
from memfilter.store.history import HistoryStore, Save
from memfilter.store.layout import WINDOW_ENTRY, save_identity
from memfilter.store.transport import UNAVAILABLE, Refusing, Resharded


def record(thread: str, messages: list, offset: int = 0, request_id: str | None = None, **fields) -> Record:
    value = {"threadId": thread, "resourceId": "r1", "messages": messages, **fields}
    if request_id:
        value["requestId"] = request_id
    return Record("chat-requests", 0, offset, T0 + offset, thread.encode(), json.dumps(value).encode())


def outputs(outs, topic):
    return [json.loads(o.value) for o in outs if o.topic == topic]


async def committed(p: Processor, records: list[Record]) -> list:
    """A batch decided and its outputs committed to Kafka: its records dropped, as the worker drops them."""
    decided = await p.decide_batch(records)
    await p.store.drop_records(decided.recorded)
    return [out for outs in decided.outs for out in outs]


@pytest.fixture
def with_store(redis_url):
    """Run `fn(store)` in an event loop of its own, on a key prefix of its own."""
    prefix = f"unit-{uuid.uuid4().hex[:8]}"

    def run(fn):
        async def go():
            client = aioredis.from_url(redis_url)
            try:
                return await fn(HistoryStore(client, prefix))
            finally:
                await client.aclose()

        return asyncio.run(go())

    return run


class TestBatches:
    def test_requests_of_one_thread_in_one_batch_see_each_others_writes(self, with_store):
        async def go(store):
            p = Processor(store)
            outs = await p.process([record("t", [msg("u0")], 0, "q0"), record("t", [msg("u0"), msg("u1")], 1, "q1")])
            trips = p.metrics.value("memfilter_redis_round_trips_total")
            return outs, [json.loads(r) for r in await reads.thread_rows(store, "t")], trips

        outs, rows, trips = with_store(go)
        persisted = outputs(outs, Topics().persist)
        assert [[m["id"] for m in p["messages"]] for p in persisted] == [["u0"], ["u1"]]
        assert [r["id"] for r in rows] == ["u0", "u1"]
        assert trips == 4  # read, id owners, claim, commit: for the whole batch

    def test_the_same_request_twice_is_decided_once_and_emitted_twice_identically(self, with_store):
        async def go(store):
            p = Processor(store)
            first = await p.process([record("t", [msg("u0")], 0, "q0"), record("t", [msg("u0")], 0, "q0")])
            again = await p.process([record("t", [msg("u0")], 0, "q0")])
            return first, again

        first, again = with_store(go)
        filtered = [o.value for o in first + again if o.topic == Topics().filtered]
        assert len(filtered) == 3 and len(set(filtered)) == 1

    def test_a_write_by_another_writer_between_read_and_commit_is_seen_by_a_second_decision(self, with_store):
        """The persister saves the assistant's reply while a batch is being decided."""

        async def go(store):
            p = Processor(store)
            await p.process([record("t", [msg("u0")], 0, "q0")])
            reply = msg("a0", role="assistant", text="answer", threadId="t", resourceId="r1")
            commit = store.commit

            async def commit_after_a_concurrent_save(writes):
                if not getattr(commit_after_a_concurrent_save, "done", False):
                    commit_after_a_concurrent_save.done = True
                    await store.apply([Save("t", "r1", T0, [("a0", msgspec.json.encode(reply))], ["assistant"], save_identity("r1", "reply-a0"))])
                return await commit(writes)

            store.commit = commit_after_a_concurrent_save
            echo = [msg("u0"), msg("a0", role="assistant", text="answer "), msg("u1")]
            outs = await p.process([record("t", echo, 1, "q1")])
            return outs, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t")]

        outs, ids = with_store(go)
        [filtered] = outputs(outs, Topics().filtered)
        assert filtered["historyVersion"] == 2  # decided again, on the version with the reply
        assert [d["reason"] for d in filtered["dropped"]] == ["echo of a stored message"] * 2
        assert ids == ["u0", "a0", "u1"]

    def test_a_new_id_claimed_by_another_thread_meanwhile_rejects_the_request(self, with_store):
        async def go(store):
            p = Processor(store)
            claim = store.claim

            async def claim_after_another_thread(claims):
                await claim([("shared", "other-thread")])
                return await claim(claims)

            store.claim = claim_after_another_thread
            return await p.process([record("t", [msg("shared")], 0, "q0")])

        [dead] = with_store(go)
        assert dict(dead.headers)["error.type"] == b"foreign-message-id"


def dead_letters(outs) -> list[dict[str, str]]:
    return [{k: v.decode() for k, v in o.headers} for o in outs if o.topic == Topics().dlq]


class TestRedelivery:
    """A request committed in Redis whose outputs were not committed to Kafka (a crash) comes
    again from the same position: it emits what it emitted, byte for byte, until the worker
    drops its record once the outputs are committed."""

    def test_a_request_redelivered_before_its_outputs_were_committed_emits_the_same_bytes(self, with_store):
        async def go(store):
            p = Processor(store)
            request = record("t", [msg("u0"), msg("a0", role="assistant"), msg("u1")], 0, "q0")
            return await p.process([request]), await p.process([request]), p.metrics.value("memfilter_requests_total", outcome="redelivered")

        first, again, redelivered = with_store(go)
        assert again == first and outputs(first, Topics().filtered)[0]["outcome"] == "seeded"
        assert redelivered == 1

    def test_redelivered_after_its_outputs_were_committed_it_emits_nothing_again(self, with_store):
        """A worker given the partition may read a committed offset older than the last owner's
        transaction (a broker killed during the rebalance): the request's record is dropped
        (only done once its outputs are committed) and its window entry names this very
        position, so it is not decided again, nor taken for a client's retry of itself."""

        async def go(store):
            p = Processor(store)
            first = [record("t", [msg("u0")], 0, "q0"), record("t", [msg("u0"), msg("a0", role="assistant"), msg("u1")], 1, "q1")]
            emitted = await committed(p, first)
            again = await p.process(first)
            retry = await p.process([record("t", [msg("u0")], 2, "q0")])  # a client's retry, elsewhere: still a duplicate
            return emitted, again, retry, p.metrics.value("memfilter_requests_total", outcome="redelivered"), len(await reads.thread_rows(store, "t"))

        emitted, again, retry, redelivered, rows = with_store(go)
        assert len(outputs(emitted, Topics().filtered)) == 2 and again == [] and redelivered == 2 and rows == 2
        assert [letter["error.type"] for letter in dead_letters(retry)] == ["duplicate"]

    def test_once_dropped_a_record_leaves_only_its_entry_in_the_retry_window(self, with_store):
        async def go(store):
            p = Processor(store)
            decided = await p.decide_batch([record("t", [msg("u0")], 0, "q0"), record("t", [msg("u0"), msg("u1")], 1, "q1")])
            records = [k async for k in store.redis.scan_iter(match=f"{store.prefix}:t:{{t}}:pending:*")]
            await store.drop_records(decided.recorded)
            left = [k async for k in store.redis.scan_iter(match=f"{store.prefix}:t:{{t}}:pending:*")]
            return len(records), len(decided.recorded), left, len(await store.redis.get(store.keys("t").recent))

        records, to_drop, left, window_bytes = with_store(go)
        assert records == to_drop == 2 and left == []
        assert window_bytes == 2 * WINDOW_ENTRY.size

    def test_a_record_never_dropped_expires_the_ttl_after_its_request_and_the_window_after_the_threads_last(self, with_store):
        async def go(store):
            store = HistoryStore(store.redis, store.prefix, processed_ttl=100)
            window = store.keys("t").recent
            await Processor(store).process([record("t", [msg("u0")], 0, "q0")])
            [first] = [k async for k in store.redis.scan_iter(match=f"{store.prefix}:t:{{t}}:pending:*")]
            for key in (window, first):
                await store.redis.pexpire(key, 5_000)  # as if 95 s had passed
            await Processor(store).process([record("t", [msg("u0"), msg("a0", role="assistant"), msg("u1")], 1, "q1")])
            return await store.redis.pttl(window), await store.redis.pttl(first)

        window, first = with_store(go)
        assert 99_000 < window <= 100_000 and first <= 5_000


class TestRetries:
    """A client publishing a request id again (at another position): inside its thread's
    retry window, a `duplicate` dead letter naming the original; outside, decided again."""

    def test_a_retry_inside_the_window_is_a_duplicate_naming_the_original_and_no_second_filtered_input(self, with_store):
        async def go(store):
            p = Processor(store)
            first = await committed(p, [record("t", [msg("u0")], 0, "q0"), record("t", [msg("u0")], 1, "q0")])  # a retry in the same batch
            later = await p.process([record("t", [msg("u0")], 2, "q0")])
            return first, later, p.metrics.value("memfilter_requests_total", outcome="duplicate")

        first, later, duplicates = with_store(go)
        assert len(outputs(first, Topics().filtered)) == 1 and outputs(later, Topics().filtered) == []
        for letters in (dead_letters(first), dead_letters(later)):
            [letter] = letters
            assert letter["error.type"] == "duplicate" and letter["memfilter.duplicate-of"] == "chat-requests-0-0"
            assert letter["error.message"].startswith("request q0 was processed already, at chat-requests-0-0; a retry is not decided again")
        assert duplicates == 2

    def test_a_retry_of_a_request_older_than_the_window_is_decided_again(self, with_store):
        async def go(store):
            store = HistoryStore(store.redis, store.prefix, retry_window=2)
            p = Processor(store)
            echo = []
            for k in range(3):  # q0, q1, q2: q0 leaves the window of two
                echo.append(msg(f"u{k}"))
                await p.process([record("t", list(echo), k, f"q{k}")])
            again = await p.process([record("t", [msg("u0")], 3, "q0")])
            once_more = await p.process([record("t", [msg("u0")], 4, "q0")])
            return again, once_more

        again, once_more = with_store(go)
        [filtered] = outputs(again, Topics().filtered)
        assert filtered["source"]["offset"] == 3 and filtered["historyVersion"] == 3
        assert outputs(again, Topics().persist) == []  # its message is stored: nothing saved twice
        assert [letter["memfilter.duplicate-of"] for letter in dead_letters(once_more)] == ["chat-requests-0-3"]

    @pytest.mark.parametrize("later_s, decided_again", [(59, False), (61, True)])
    def test_a_retry_published_later_than_the_ttl_after_its_original_is_decided_again(self, with_store, later_s, decided_again):
        async def go(store):
            p = Processor(HistoryStore(store.redis, store.prefix, processed_ttl=60))
            await p.process([record("t", [msg("u0")], 0, "q0")])
            retry = record("t", [msg("u0")], 1, "q0")
            return await p.process([msgspec.structs.replace(retry, timestamp_ms=T0 + later_s * 1000)])

        outs = with_store(go)
        assert bool(outputs(outs, Topics().filtered)) == decided_again
        assert bool(dead_letters(outs)) != decided_again

    def test_another_resources_request_with_the_same_id_is_not_a_retry_and_learns_nothing(self, with_store):
        async def go(store):
            p = Processor(store)
            await p.process([record("t", [msg("u0")], 0, "q0")])
            intruder = record("t", [msg("x0")], 1, "q0")
            value = json.loads(intruder.value) | {"resourceId": "r2"}
            return await p.process([msgspec.structs.replace(intruder, value=json.dumps(value).encode())])

        [letter] = dead_letters(with_store(go))
        assert letter["error.type"] == "ownership" and "memfilter.duplicate-of" not in letter

    def test_the_window_holds_the_threads_last_n_requests(self, with_store):
        async def go(store):
            store = HistoryStore(store.redis, store.prefix, retry_window=5)
            p = Processor(store)
            await p.process([record("t", [msg(f"u{k}")], k, f"q{k}") for k in range(12)])
            return await store.redis.get(store.keys("t").recent)

        window = with_store(go)
        assert [WINDOW_ENTRY.unpack_from(window, at)[2] for at in range(0, len(window), WINDOW_ENTRY.size)] == [7, 8, 9, 10, 11]


class TestLanes:
    def test_a_large_batch_keeps_each_threads_order_across_lanes(self, with_store):
        """600 requests over 40 threads in one batch (several lanes): each thread's requests
        are decided in offset order, each seeing what the one before saved."""
        threads = [f"lane-t{i}" for i in range(40)]
        batch = [
            record(thread, [msg(f"{thread}-u{j}") for j in range(k + 1)], 40 * k + n, f"{thread}-q{k}") for k in range(15) for n, thread in enumerate(threads)
        ]

        async def go(store):
            p = Processor(store)
            outs = await p.process(batch)
            return outs, {t: [json.loads(r)["id"] for r in await reads.thread_rows(store, t)] for t in threads}

        outs, stored = with_store(go)
        filtered = outputs(outs, Topics().filtered)
        assert len(filtered) == len(batch)
        for thread in threads:
            mine = [f for f in filtered if f["threadId"] == thread]
            assert [f["requestId"] for f in mine] == [f"{thread}-q{k}" for k in range(15)]
            assert [f["historyVersion"] for f in mine] == list(range(15))  # each saw the one before
            saved = [[m["id"] for m in e["messages"]] for e in outputs(outs, Topics().persist) if e["threadId"] == thread]
            assert saved == [[f"{thread}-u{k}"] for k in range(15)]  # only what the one before had not saved
            assert stored[thread] == [f"{thread}-u{k}" for k in range(15)]

    def test_a_record_without_a_key_is_a_dead_letter_and_its_threads_next_request_is_decided(self, with_store):
        keyed = record("t", [msg("u0")], 0, "q0")
        unkeyed = Record("chat-requests", 0, 1, T0, None, record("t", [msg("u1")], 1, "q1").value)
        after = record("t", [msg("u2")], 2, "q2")

        async def go(store):
            return await Processor(store).process([keyed, unkeyed, after])

        outs = with_store(go)
        assert [dict(o.headers)["error.type"] for o in outs if o.topic == Topics().dlq] == [b"key-mismatch"]
        assert [e["requestId"] for e in outputs(outs, Topics().filtered)] == ["q0", "q2"]


class TestRedisTrouble:
    def test_an_error_reply_of_any_kind_is_raised_and_loading_counts_as_an_outage(self, with_store):
        """A Redis loading its data after a restart answers LOADING, which redis-py makes a
        BusyLoadingError: a ConnectionError, not a ResponseError. It must be raised (the worker
        retries the batch), never handed back as if it were a reply."""

        async def go(store):
            loading = ("EVAL", "return redis.error_reply('LOADING Redis is loading the dataset in memory')", 0)
            with pytest.raises(BusyLoadingError):
                await store.transport.pipeline([("PING",), loading, ("PING",)])
            return await store.transport.pipeline([("PING",)])  # every reply was read: still in step

        assert with_store(go) == [b"PONG"]
        assert issubclass(BusyLoadingError, RedisConnectionError)

    @pytest.mark.parametrize(
        "answer",
        [
            "MISCONF Errors writing to the AOF file: No space left on device",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "READONLY You can't write against a read only replica.",
            "NOREPLICAS Not enough good replicas to write.",
            "UNBLOCKED force unblock from blocking operation, instance state changed (master -> replica?)",
        ],
    )
    def test_a_redis_refusing_writes_for_its_disk_its_memory_or_a_failover_is_an_outage(self, with_store, answer):
        """Found by the Jepsen tier (tests/jepsen: Redis's disk full): MISCONF was raised as an
        error of the batch and stopped every worker; and UNBLOCKED, a WAIT cut short by its
        master's demotion in a failover (the nemesis's short schedule). Such answers are outages
        (`Refusing`, a ConnectionError): the worker waits them out and loses nothing."""

        async def go(store):
            with pytest.raises(Refusing) as refused:
                await store.transport.pipeline([("EVAL", f"return redis.error_reply({answer!r})", 0)])
            return refused.value

        assert isinstance(with_store(go), RedisConnectionError)

    def test_every_error_of_a_redis_that_does_not_answer_is_an_outage_and_an_error_reply_is_not(self):
        """redis-py raises its own TimeoutError when a round trip's deadline comes mid-write (a
        slow link): the sink took it for an error of its batch and exited (found by the Jepsen
        tier's nemesis, seed 3). The sink, the gateway and the cluster's map read it as one."""
        answering = [RedisTimeoutError("Timeout writing to socket"), TimeoutError(), RedisConnectionError("refused"), Refusing("MISCONF"), Resharded("MOVED")]
        assert all(isinstance(e, UNAVAILABLE) for e in answering)
        assert not isinstance(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), UNAVAILABLE)

    def test_a_refusals_code_inside_an_errors_text_is_not_an_outage(self, with_store):
        """Only the code an answer begins with counts: an error's text may quote a key, and so
        a client's thread id, which must not turn a data error into an outage waited on forever."""

        async def go(store):
            with pytest.raises(ResponseError) as raised:
                await store.transport.pipeline([("EVAL", "return redis.error_reply('ERR thread MISCONF of OOM is READONLY')", 0)])
            return raised.value

        assert not isinstance(with_store(go), RedisConnectionError)

    def test_after_redis_dropped_its_connections_only_the_first_round_trip_fails(self, redis_url, with_store):
        """A Redis restart closes every connection, and the pool cannot tell a closed idle one
        from a live one until it is used. One failure must clear them all: otherwise each
        batch after the restart could fail again on the next stale connection."""
        name = f"drop-{uuid.uuid4().hex[:8]}"

        async def go(store):
            store.redis.connection_pool.connection_kwargs["client_name"] = name
            await asyncio.gather(*(store.transport.pipeline([("PING",)]) for _ in range(6)))  # six idle connections
            admin = aioredis.from_url(redis_url)
            try:
                for client in await admin.client_list():
                    if client["name"] == name:
                        await admin.client_kill_filter(_id=client["id"])
            finally:
                await admin.aclose()
            with pytest.raises(RedisConnectionError):
                await store.transport.pipeline([("PING",)])
            return await asyncio.gather(*(store.transport.pipeline([("PING",)]) for _ in range(6)))

        assert with_store(go) == [[b"PONG"]] * 6

    def test_when_one_lane_fails_the_other_lanes_of_the_batch_stop_before_it_is_retried(self, with_store):
        """Redis goes away under one lane: the batch is retried as a whole, so a lane still
        running from the failed attempt would save beside the retry."""
        batch = [record(f"fail-t{i}", [msg(f"fail-t{i}-u0")], i, f"fail-q{i}") for i in range(400)]

        async def go(store):
            read, commit, committed = store.read, store.commit, []

            async def first_read_fails(wanted, tail=0, **more):
                if not committed and not getattr(first_read_fails, "failed", False):
                    first_read_fails.failed = True
                    raise RedisConnectionError("Connection closed by server.")
                await asyncio.sleep(0.3)
                return await read(wanted, tail, **more)

            async def recorded_commit(writes):
                committed.append(writes)
                return await commit(writes)

            store.read, store.commit = first_read_fails, recorded_commit
            with pytest.raises(RedisConnectionError):
                await Processor(store).process(batch)
            await asyncio.sleep(1)
            return committed

        assert with_store(go) == []


class TestPersister:
    def event(self, thread, rows, resource="r1", processors=False, headers=()):
        """A persist-messages record; `processors`: signed as the processor signs its own."""
        value = json.dumps({"requestId": "x", "threadId": thread, "resourceId": resource, "messages": rows}).encode()
        headers = origin.headers(value, SECRET) if processors else headers
        return Record("persist-messages", 0, 0, T0, thread.encode(), value, tuple(headers))

    def test_applying_an_event_twice_changes_nothing(self, with_store):
        async def go(store):
            persister = Persister(store, "dlq", SECRET)
            rows = [msg("a0", role="assistant", threadId="t", createdAt="2026-03-01T10:00:00Z")]
            assert await persister.process([self.event("t", rows, processors=True)]) == []
            version = await store.redis.hget(store.keys("t").meta, "version")
            assert await persister.process([self.event("t", rows, processors=True)]) == []
            return version, await store.redis.hget(store.keys("t").meta, "version"), await reads.thread_rows(store, "t")

        before, after, rows = with_store(go)
        assert before == after == b"1" and len(rows) == 1

    def test_saves_an_assistant_turn_whose_tool_call_carries_arguments_and_a_result(self, with_store):
        call = {"state": "result", "toolCallId": "c1", "toolName": "book", "args": {"seats": 2}, "result": {"ok": True}}
        turn = {"id": "a1", "role": "assistant", "content": {"format": 2, "parts": [{"type": "tool-invocation", "toolInvocation": call}]}}

        first = msg("u0", threadId="t")

        async def go(store):
            letters = await Persister(store, "dlq", SECRET).process([self.event("t", [first], processors=True), self.event("t", [turn])])
            return letters, [json.loads(r) for r in await reads.thread_rows(store, "t")]

        letters, rows = with_store(go)
        assert letters == [] and rows == [first, turn]

    def test_the_processors_own_events_applied_again_change_nothing(self, with_store):
        async def go(store):
            outs = await Processor(store, secret=SECRET).process([record("t", [msg("u0")], 0, "q0")])
            [persist] = [o for o in outs if o.topic == Topics().persist]
            version = await store.redis.hget(store.keys("t").meta, "version")
            letters = await Persister(store, "dlq", SECRET).process([Record("persist-messages", 0, 0, T0, b"t", persist.value, persist.headers)])
            return letters, version, await store.redis.hget(store.keys("t").meta, "version")

        letters, before, after = with_store(go)
        assert letters == [] and before == after

    def test_a_batch_takes_three_round_trips_and_ends_as_if_applied_one_by_one(self, with_store):
        """Later events of the batch see what earlier ones claimed and saved, and what earlier
        ones were refused for did not claim their ids."""
        batch = [
            self.event("other", [msg("e1", threadId="other")], processors=True),
            self.event("t", [msg("t0", threadId="t")], processors=True),
            self.event("t", [msg("x1", threadId="t"), msg("e1", threadId="t")]),  # e1: claimed by the first event
            self.event("t", [msg("n1", threadId="t")], resource="intruder"),  # t is r1's since the second
            Record("persist-messages", 0, 4, T0, b"t", b"{not json"),
            self.event("t", [msg("t1", threadId="t")]),
            self.event("u", [msg("x1", threadId="u"), msg("n1", threadId="u")], processors=True),  # ids of refused events: free
        ]

        async def go(store):
            letters = await Persister(store, "dlq", SECRET).process(batch)
            trips = store.metrics.value("memfilter_redis_round_trips_total")
            rows = {t: [json.loads(r)["id"] for r in await reads.thread_rows(store, t)] for t in ("t", "other", "u")}
            return letters, rows, trips

        letters, rows, trips = with_store(go)
        assert [dict(d.headers)["error.type"] for d in letters] == [b"foreign-message-id", b"ownership", b"decode"]
        assert [d.value for d in letters] == [batch[2].value, batch[3].value, batch[4].value]
        assert rows == {"t": ["t0", "t1"], "other": ["e1"], "u": ["x1", "n1"]}
        assert trips == 3

    @pytest.mark.parametrize(
        "refused, resource",
        [([msg("n1", threadId="t")], "intruder"), ([msg("n1", threadId="t"), msg("e1", threadId="t")], "r1")],
        ids=["for its thread's owner", "for another of its ids"],
    )
    def test_an_event_refused_claims_none_of_its_ids(self, with_store, refused, resource):
        """Else the id would count as thread t's for good, and a request of another thread
        that sends it would be refused as reusing t's message."""

        async def go(store):
            persister = Persister(store, "dlq", SECRET)
            assert await persister.process([self.event("other", [msg("e1", threadId="other")], processors=True)]) == []
            assert await persister.process([self.event("t", [msg("t0", threadId="t")], processors=True)]) == []
            assert len(await persister.process([self.event("t", refused, resource)])) == 1
            outs = await Processor(store).process([record("v", [msg("n1")], 0, "q0")])
            return [o.topic for o in outs], [json.loads(r)["id"] for r in await reads.thread_rows(store, "v")]

        topics, saved = with_store(go)
        assert topics == [Topics().filtered, Topics().persist] and saved == ["n1"]

    @pytest.mark.parametrize(
        "rows, resource, error",
        [
            ([msg("e1", threadId="t")], "r1", "foreign-message-id"),
            ([msg("n1", threadId="t")], "intruder", "ownership"),
            ([msg("n2", threadId="elsewhere")], "r1", "thread-mismatch"),
            ([{"role": "user", "content": {"format": 2, "parts": []}}], "r1", "schema"),
            ([msg("d1", threadId="t"), msg("d1", role="assistant", threadId="t")], "r1", "schema"),
        ],
        ids=["a message of another thread", "a thread of another resource", "a row naming another thread", "a row without id", "one id twice"],
    )
    def test_rows_it_must_not_save_are_dead_letters(self, with_store, rows, resource, error):
        async def go(store):
            persister = Persister(store, "dlq", SECRET)
            assert await persister.process([self.event("other", [msg("e1", threadId="other")], processors=True)]) == []
            assert await persister.process([self.event("t", [msg("t0", threadId="t")], processors=True)]) == []
            letters = await persister.process([self.event("t", rows, resource)])
            return letters, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t")]

        [letter], ids = with_store(go)
        assert dict(letter.headers)["error.type"] == error.encode()
        assert ids == ["t0"]

    def test_an_event_for_a_thread_without_owner_is_refused_and_the_owners_first_request_goes_through(self, with_store):
        """No writer can take a thread before its resource's first request does."""

        async def go(store):
            letters = await Persister(store, "dlq", SECRET).process([self.event("t", [msg("x0", threadId="t")], resource="squatter")])
            outs = await Processor(store, secret=SECRET).process([record("t", [msg("u0")], 0, "q0")])
            stored = [json.loads(r)["id"] for r in await reads.thread_rows(store, "t")]
            return letters, [o.topic for o in outs], stored, (await store.owners(["x0"], ["t"]))[:2]

        [letter], topics, stored, (holders, owners) = with_store(go)
        assert dict(letter.headers)["error.type"] == b"ownership" and b"no owner yet" in dict(letter.headers)["error.message"]
        assert topics == [Topics().filtered, Topics().persist] and stored == ["u0"]
        assert holders == {} and owners == {"t": "r1"}

    def test_an_event_cannot_change_the_role_of_a_stored_message(self, with_store):
        async def go(store):
            persister = Persister(store, "dlq", SECRET)
            assert await persister.process([self.event("t", [msg("u0", threadId="t", text="mine")], processors=True)]) == []
            letters = await persister.process([self.event("t", [msg("u0", role="assistant", threadId="t", text="forged")])])
            return letters, [json.loads(r) for r in await reads.thread_rows(store, "t")]

        [letter], rows = with_store(go)
        assert dict(letter.headers)["error.type"] == b"role"
        assert rows == [msg("u0", threadId="t", text="mine")]

    @pytest.mark.parametrize("signature", [None, b"00" * 32, "another secret's"])
    def test_an_event_claiming_the_processors_origin_without_its_signature_is_refused(self, with_store, signature):
        async def go(store):
            value = json.dumps({"requestId": "x", "threadId": "t", "resourceId": "r1", "messages": [msg("u0", threadId="t")]}).encode()
            if signature is None:
                headers = [origin.ORIGIN]
            elif isinstance(signature, bytes):
                headers = [origin.ORIGIN, (origin.SIGNATURE, signature)]
            else:
                headers = origin.headers(value, b"not the deployment's secret")
            letters = await Persister(store, "dlq", SECRET).process([Record("persist-messages", 0, 0, T0, b"t", value, tuple(headers))])
            return letters, await reads.thread_rows(store, "t")

        [letter], rows = with_store(go)
        assert dict(letter.headers)["error.type"] == b"origin" and rows == []


class TestAnUnexpectedErrorStopsOneRecordOnly:
    def test_a_record_whose_decision_raises_is_an_internal_dead_letter_and_the_rest_go_on(self, with_store, monkeypatch):
        import memfilter.runtime.processor

        decide = memfilter.runtime.processor.decide

        def fails_for_q1(request, view, ts, *settings):
            if request.request_id == "q1":
                raise KeyError("a bug")
            return decide(request, view, ts, *settings)

        monkeypatch.setattr(memfilter.runtime.processor, "decide", fails_for_q1)
        batch = [record("t", [msg("u0")], 0, "q0"), record("t", [msg("u1")], 1, "q1"), record("t", [msg("u2")], 2, "q2")]

        async def go(store):
            outs = await Processor(store).process(batch)
            return outs, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t")]

        outs, stored = with_store(go)
        [letter] = [o for o in outs if o.topic == Topics().dlq]
        assert dict(letter.headers)["error.type"] == b"internal" and letter.value == batch[1].value
        assert b"chat-requests-0-1" in dict(letter.headers)["error.message"]
        assert [e["requestId"] for e in outputs(outs, Topics().filtered)] == ["q0", "q2"] and stored == ["u0", "u2"]


class TestContext:
    """The context's window comes from Redis in the batch's round trips."""

    def conversation(self, n):
        return [msg(f"u{i}", text=f"q{i}") if i % 2 == 0 else msg(f"a{i}", role="assistant", text=f"r{i}") for i in range(n)]

    async def stored(self, store, messages, thread="t"):
        rows = [(m["id"], msgspec.json.encode({**m, "threadId": thread, "resourceId": "r1", "createdAt": "2026-03-01T10:00:00.000Z"})) for m in messages]
        await store.apply([Save(thread, "r1", T0, rows, [m["role"] for m in messages], b"", writer="processor")])

    def context_ids(self, outs):
        return [[m["id"] for m in f["context"]] for f in outputs(outs, Topics().filtered)]

    def test_an_echo_of_the_whole_conversation_costs_no_round_trip_more(self, with_store):
        async def go(store):
            await self.stored(store, self.conversation(14))
            p = Processor(store)
            before = p.metrics.value("memfilter_redis_round_trips_total")
            outs = await p.process([record("t", [*self.conversation(14), msg("u14")], 0, "q0")])
            return outs, p.metrics.value("memfilter_redis_round_trips_total") - before

        outs, trips = with_store(go)
        assert self.context_ids(outs) == [["u4", "a5", "u6", "a7", "u8", "a9", "u10", "a11", "u12", "a13", "u14"]]
        assert trips == 4

    def test_rows_the_client_did_not_send_are_read_in_one_round_trip_more(self, with_store):
        async def go(store):
            await self.stored(store, self.conversation(4))
            p = Processor(store, policy=Policy(history=3))
            before = p.metrics.value("memfilter_redis_round_trips_total")
            outs = await p.process([record("t", [msg("u4")], 0, "q0")])
            return outs, p.metrics.value("memfilter_redis_round_trips_total") - before

        outs, trips = with_store(go)
        [filtered] = outputs(outs, Topics().filtered)
        assert [m["id"] for m in filtered["context"]] == ["a1", "u2", "a3", "u4"]
        assert filtered["context"][0]["content"]["parts"][0]["text"] == "r1"  # the stored row itself
        assert trips == 5

    def test_the_second_request_of_a_thread_in_a_batch_has_the_firsts_rows_in_its_context(self, with_store):
        async def go(store):
            return await Processor(store, policy=Policy(history=2)).process([record("t", [msg("u0")], 0, "q0"), record("t", [msg("u1")], 1, "q1")])

        assert self.context_ids(with_store(go)) == [["u0"], ["u0", "u1"]]

    def test_a_stored_row_kept_from_before_the_last_n_rows_starts_the_window(self, with_store):
        async def go(store):
            await self.stored(store, self.conversation(8))
            return await Processor(store, policy=Policy(history=2)).process(
                [record("t", [*self.conversation(8)[2:4], msg("u8")], 0, "q0", retainFullInput=True)]
            )

        assert self.context_ids(with_store(go)) == [["u2", "a3", "u4", "a5", "u6", "a7", "u8"]]

    def test_a_context_larger_than_a_record_may_be_is_refused_and_saves_nothing(self, with_store):
        async def go(store):
            await self.stored(store, [msg(f"big{i}", text="x" * (1 << 20)) for i in range(9)])
            outs = await Processor(store).process([record("t", [msg("u9")], 0, "q0")])
            return outs, await reads.thread_rows(store, "t")

        outs, rows = with_store(go)
        [dead] = outs
        assert dict(dead.headers)["error.type"] == b"too-large"
        assert b"MEMFILTER_HISTORY_MESSAGES" in dict(dead.headers)["error.message"]
        assert len(rows) == 9


class TestFilteredInputFormats:
    """MEMFILTER_FILTERED_FORMAT: 2 writes each contributed message once, 1 twice; the same decision."""

    def test_format_two_refers_into_the_context_and_format_one_writes_every_message_whole(self, with_store):
        async def go(store):
            by_format = {}
            for f in (1, 2):
                thread = f"t{f}"
                await TestContext().stored(store, [msg("u0"), msg("a1", role="assistant")], thread)
                request = record(thread, [msg("u0"), msg("a1", role="assistant"), msg(f"u2-{f}")], 0, f"q{f}")
                [by_format[f]] = [o.value for o in await Processor(store, filtered_format=f).process([request]) if o.topic == Topics().filtered]
            return by_format

        by_format = with_store(go)
        one, two = (json.loads(by_format[f]) for f in (1, 2))
        assert "format" not in one and two["format"] == 2
        assert [m["id"] for m in one["context"]] == ["u0", "a1", "u2-1"] and one["messages"] == [one["context"][-1]]
        assert [m["id"] for m in two["context"]] == ["u0", "a1", "u2-2"] and two["messages"] == [{"$ref": "#/context/2"}]
        assert len(by_format[2]) < len(by_format[1]) - len(json.dumps(one["messages"])) // 2


class TestSuperseding:
    """Regenerate and edit take rows out of the conversation, atomically with the request's
    other writes; the rows stay stored, and nothing brings them back."""

    def conversation(self):
        return [msg("u1", text="q1"), msg("a1", role="assistant", text="r1"), msg("u2", text="q2"), msg("a2", role="assistant", text="r2")]

    async def seeded(self, store):
        await TestContext().stored(store, self.conversation())

    def test_a_regenerate_supersedes_the_answer_and_a_stale_tabs_echo_of_it_does_not_bring_it_back(self, with_store):
        async def go(store):
            await self.seeded(store)
            p = Processor(store)
            first = await p.process([record("t", self.conversation()[:3], 0, "regen", trigger="regenerate-message")])
            stale = await p.process([record("t", self.conversation(), 1, "stale")])
            return first, stale, await reads.thread_rows(store, "t"), await reads.superseded_rows(store, "t")

        first, stale, rows, superseded = with_store(go)
        [filtered] = outputs(first, Topics().filtered)
        [persisted] = outputs(first, Topics().persist)
        assert (filtered["outcome"], filtered["superseded"], persisted["messages"], persisted["superseded"]) == ("regenerated", ["a2"], [], ["a2"])
        assert [m["id"] for m in filtered["context"]] == ["u1", "a1", "u2"]
        [again] = outputs(stale, Topics().filtered)
        assert (again["outcome"], again["messages"], outputs(stale, Topics().persist)) == ("stored-echo-dropped", [], [])
        assert [m["id"] for m in again["context"]] == ["u1", "a1", "u2"]
        assert [json.loads(r)["id"] for r in rows] == ["u1", "a1", "u2"]
        assert [(by, json.loads(row)["id"]) for by, row in superseded] == [("regen", "a2")]

    def test_a_request_of_another_resource_cannot_supersede_anything(self, with_store):
        async def go(store):
            await self.seeded(store)
            value = json.dumps({"threadId": "t", "resourceId": "r2", "messages": self.conversation()[:1], "trigger": "regenerate-message"})
            outs = await Processor(store).process([Record("chat-requests", 0, 0, T0, b"t", value.encode())])
            return outs, await reads.thread_rows(store, "t"), await reads.superseded_rows(store, "t")

        outs, rows, superseded = with_store(go)
        assert [dict(o.headers)["error.type"] for o in outs] == [b"ownership"]
        assert (len(rows), superseded) == (4, [])

    def test_another_services_event_supersedes_once_and_a_later_save_of_the_row_leaves_it_out(self, with_store):
        async def go(store):
            await self.seeded(store)
            event = Save("t", "r1", T0, [], [], save_identity("r1", "agent-1"), superseded=["a2", "not-here"], request_id="agent-1")
            versions = await store.apply([event, event])
            late = msgspec.json.encode({**msg("a2", role="assistant", text="r2, finished"), "threadId": "t", "resourceId": "r1"})
            await store.apply([Save("t", "r1", T0, [("a2", late)], ["assistant"], save_identity("r1", "agent-2"))])
            return versions, await reads.thread_rows(store, "t"), await reads.superseded_rows(store, "t")

        versions, rows, superseded = with_store(go)
        assert versions[0] == versions[1]  # the same event again changes nothing
        assert [json.loads(r)["id"] for r in rows] == ["u1", "a1", "u2"]
        [(by, row)] = superseded
        assert (by, json.loads(row)["content"]["parts"][0]["text"]) == ("agent-1", "r2, finished")

    def test_an_edit_saves_the_new_text_and_supersedes_what_followed_in_one_commit(self, with_store):
        async def go(store):
            await self.seeded(store)
            edited = [*self.conversation()[:2], msg("u2", text="q2, changed")]
            p = Processor(store)
            before = p.metrics.value("memfilter_redis_round_trips_total")
            outs = await p.process([record("t", edited, 0, "edit", trigger="submit-message", messageId="u2")])
            trips = p.metrics.value("memfilter_redis_round_trips_total") - before
            return outs, trips, await reads.thread_rows(store, "t"), await store.redis.hget(store.keys("t").meta, "version")

        outs, trips, rows, version = with_store(go)
        [filtered] = outputs(outs, Topics().filtered)
        assert (filtered["outcome"], filtered["superseded"]) == ("edited", ["a2"])
        assert [json.loads(r)["content"]["parts"][0]["text"] for r in rows] == ["q1", "r1", "q2, changed"]
        assert json.loads(rows[2])["createdAt"] == "2026-03-01T10:00:00.000Z"  # the stored row's, kept
        assert int(version) == 2 and trips == 3  # one version step; the read, the row of a2 (the client dropped it), the commit

    def test_a_redelivered_regenerate_emits_the_same_bytes_and_supersedes_nothing_more(self, with_store):
        async def go(store):
            await self.seeded(store)
            p = Processor(store)
            regenerate = record("t", self.conversation()[:3], 0, "regen", trigger="regenerate-message")
            first = await p.process([regenerate])
            version = await store.redis.hget(store.keys("t").meta, "version")
            again = await Processor(store).process([regenerate])  # its batch's Kafka commit never came: consumed again
            return first, again, version, await store.redis.hget(store.keys("t").meta, "version"), await reads.superseded_rows(store, "t")

        first, again, version, after, superseded = with_store(go)
        assert [o.value for o in first] == [o.value for o in again]
        assert version == after and [by for by, _ in superseded] == ["regen"]

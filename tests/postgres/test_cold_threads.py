"""Threads out of Redis and back: the PostgreSQL tier against a real PostgreSQL and Redis.

The promise pinned here: a thread that left Redis (evicted once PostgreSQL held its latest
version) and came back is decided exactly as one that never left, any number of times;
eviction never takes the only copy; PostgreSQL holds each thread as of its version, written
again or late without effect; and PostgreSQL down costs the cold threads alone, with the reason.
"""

from __future__ import annotations

import json
import os
import random
import signal
import string
import time

import msgspec
import pytest
from factories import CASES, SECRET, T0, msg
from pipeline import save_case_history

from memfilter.core.filter import HISTORY_MESSAGES, Policy
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store import cold, reads
from memfilter.store.history import Fenced, HistoryStore
from memfilter.store.postgres import PostgresHistory, Unavailable

FAR_FUTURE_MS = 253_000_000_000_000  # the year 9987: `evict` takes every thread PostgreSQL holds


async def sink(store: HistoryStore, pg: PostgresHistory, threads: list[str]) -> tuple[int, dict[str, str]]:
    """What `memfilter sink` does for events naming these threads: how many it wrote, and those PostgreSQL refused."""
    return await pg.write(await cold.whole(store, threads, dict.fromkeys(threads, T0)))


async def to_postgresql(store: HistoryStore, pg: PostgresHistory, thread: str) -> None:
    """The thread written to PostgreSQL as the sink writes it, then evicted: the only thread out."""
    await sink(store, pg, [thread])
    assert await cold.evict(store, pg, FAR_FUTURE_MS) == 1


def ask(thread: str, messages: list[dict], offset: int, at: int) -> Record:
    """A request of resource r1 in `thread`, at `offset` of partition 0, stamped `at`."""
    return Record("chat-requests", 0, offset, at, thread.encode(), json.dumps({"threadId": thread, "resourceId": "r1", "messages": messages}).encode())


def request_record(case: dict, offset: int = 0) -> Record:
    r = case["request"]
    return Record("chat-requests", 0, offset, case["timestamp"], r["threadId"].encode(), json.dumps(r).encode())


def policy_of(case: dict) -> Policy:
    return Policy(history=case.get("historyMessages", HISTORY_MESSAGES), edits=case.get("edits", "on") == "on")


def emitted(outs) -> list[tuple]:
    return [(o.topic, o.key, o.value, o.headers) for o in outs]


async def redis_keys(store: HistoryStore) -> set[bytes]:
    return {k async for k in store.redis.scan_iter(match=f"{store.prefix}:t:*")}


class TestDecisionsOnThreadsThatLeftRedis:
    @pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
    def test_a_conformance_case_on_an_evicted_thread_is_decided_as_on_one_that_never_left(self, index, tiers):
        case = CASES[index]["case"]

        async def go(make):
            (stayed, _), (left, pg) = make(), make()
            await save_case_history(stayed, case)
            threads = await save_case_history(left, case)
            await sink(left, pg, threads)
            evicted = await cold.evict(left, pg, FAR_FUTURE_MS)
            keys_cold = await redis_keys(left)
            policy = policy_of(case)
            want = await Processor(stayed, policy=policy, secret=SECRET).process([request_record(case)])
            got = await Processor(left, policy=policy, secret=SECRET).process([request_record(case)])
            return threads, evicted, keys_cold, emitted(want), emitted(got), left.metrics.value("memfilter_cold_loads_total")

        threads, evicted, keys_cold, want, got, loads = tiers(go)
        if case["stored"] or case["storedElsewhere"]:
            assert evicted == len(threads)
            assert all(k.endswith(b":meta") for k in keys_cold)  # only the meta stayed
        if any(topic == Topics().filtered for topic, *_ in want) and case["stored"]:
            assert loads >= 1  # decided on its thread loaded back
        assert got == want

    def test_a_thread_evicted_and_loaded_back_again_and_again_keeps_every_row_and_decision(self, tiers):
        async def go(make):
            (stayed, _), (left, pg) = make(), make()
            outs = ([], [])
            history: list[dict] = []
            for turn in range(6):
                history = [*history, msg(f"u{turn}", text=f"question {turn}")]
                rec = Record(
                    "chat-requests", 0, turn, T0 + turn * 1000, b"t1", json.dumps({"threadId": "t1", "resourceId": "r1", "messages": history}).encode()
                )
                for store, out in zip((stayed, left), outs):
                    out.extend(emitted(await Processor(store, secret=SECRET).process([rec])))
                await sink(left, pg, ["t1"])
                assert await cold.evict(left, pg, FAR_FUTURE_MS) == 1  # out between the request and its reply
                reply = Record(
                    "persist-messages",
                    0,
                    turn,
                    T0 + turn * 1000 + 500,
                    b"t1",
                    json.dumps(
                        {"requestId": f"a{turn}", "threadId": "t1", "resourceId": "r1", "messages": [msg(f"a{turn}", "assistant", f"answer {turn}")]}
                    ).encode(),
                )
                for store in (stayed, left):
                    assert await Persister(store, Topics().dlq, SECRET).process([reply]) == []
                history = [*history, msg(f"a{turn}", "assistant", f"answer {turn}")]
                await sink(left, pg, ["t1"])
                assert await cold.evict(left, pg, FAR_FUTURE_MS) == 1
            return outs, await reads.thread_rows(stayed, "t1"), await reads.thread_rows(left, "t1"), left.metrics.value("memfilter_cold_loads_total")

        (want, got), rows_stayed, rows_left, loads = tiers(go)
        assert got == want
        assert rows_left == rows_stayed and len(rows_left) == 12
        assert loads == 11  # every request but the first and every reply found the thread cold (the last read reads PostgreSQL)

    def test_a_clients_retry_after_its_thread_left_is_the_same_duplicate_as_before(self, tiers):
        async def go(make):
            store, pg = make()
            p = Processor(store, secret=SECRET)
            value = json.dumps({"threadId": "t1", "resourceId": "r1", "requestId": "q0", "messages": [msg("u0")]}).encode()
            await p.process([Record("chat-requests", 0, 0, T0, b"t1", value)])
            await to_postgresql(store, pg, "t1")
            return await p.process([Record("chat-requests", 0, 1, T0 + 1000, b"t1", value)])  # published again, within the retry window

        (dead,) = tiers(go)
        assert dead.topic == Topics().dlq and dict(dead.headers)["error.type"] == b"duplicate"

    def test_a_save_on_a_cold_thread_is_applied_once_and_its_repeat_changes_nothing(self, tiers):
        async def go(make):
            store, pg = make()
            await Processor(store, secret=SECRET).process([ask("t1", [msg("u0")], 0, T0)])
            reply = json.dumps({"requestId": "a0", "threadId": "t1", "resourceId": "r1", "messages": [msg("a0", "assistant", "answer")]}).encode()
            first = Record("persist-messages", 0, 0, T0 + 1, b"t1", reply)
            assert await Persister(store, Topics().dlq, SECRET).process([first]) == []
            await to_postgresql(store, pg, "t1")
            again = Record("persist-messages", 0, 1, T0 + 2, b"t1", reply)  # the same event published twice
            results = await Persister(store, Topics().dlq, SECRET).apply([again])
            return results, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t1")]

        results, ids = tiers(go)
        assert results == [2]  # the version it was at: nothing applied a second time
        assert ids == ["u0", "a0"]

    def test_an_erasure_of_a_cold_thread_frees_its_ids_and_leaves_no_message_in_postgresql(self, tiers):
        async def go(make):
            store, pg = make()
            await Processor(store, secret=SECRET).process([ask("t1", [msg("u0")], 0, T0)])
            await to_postgresql(store, pg, "t1")
            result = await store.erase("t1", 1, b"erasure1", T0)
            await sink(store, pg, ["t1"])
            owners, _, _ = await store.owners(["u0"])
            async with (await pg._ready()).acquire() as conn:
                messages = await conn.fetchval(f"SELECT count(*) FROM {pg.schema}.mastra_messages WHERE thread_id = 't1'")
                thread = await conn.fetchrow(f"SELECT version, \"resourceId\", erased FROM {pg.schema}.mastra_threads WHERE id = 't1'")
            return result, owners, messages, dict(thread)

        result, owners, messages, thread = tiers(go)
        assert result == 2
        assert owners == {}  # u0 is no thread's any more
        assert messages == 0
        assert thread == {"version": 2, "resourceId": None, "erased": T0}


class TestReadersOfOneThread:
    def test_a_cold_thread_is_read_from_postgresql_and_stays_out_of_redis(self, tiers):
        async def go(make):
            store, pg = make()
            p = Processor(store, secret=SECRET)
            await p.process([ask("t1", [msg("u0"), msg("u1")], 0, T0)])
            before = (await reads.thread_rows(store, "t1"), await reads.row(store, "t1", "u1"), await reads.meta(store, "t1"))
            await to_postgresql(store, pg, "t1")
            after = (await reads.thread_rows(store, "t1"), await reads.row(store, "t1", "u1"), await reads.meta(store, "t1"))
            return before, after, await store.redis.hexists(store.keys("t1").meta, "cold")

        before, after, still_cold = tiers(go)
        assert after == before and len(before[0]) == 2
        assert still_cold  # only the thread's worker loads it back, between its own reads and writes

    def test_a_worker_fenced_out_cannot_load_a_thread_back(self, tiers):
        async def go(make):
            store, pg = make()
            await Processor(store, secret=SECRET).process([ask("t1", [msg("u0")], 0, T0)])
            await to_postgresql(store, pg, "t1")
            await store.redis.hset(store.keys("t1").meta, "epoch", 7)  # another worker, given the partition since, wrote it
            store.epoch = 3
            with pytest.raises(Fenced):
                await store.read({"t1": []})
            return await store.redis.hexists(store.keys("t1").meta, "cold")

        assert tiers(go)


class TestEvictionNeverTakesTheOnlyCopy:
    def test_a_thread_written_after_postgresql_took_it_stays_in_redis(self, tiers):
        async def go(make):
            store, pg = make()
            p = Processor(store, secret=SECRET)
            await p.process([ask("t1", [msg("u0")], 0, T0)])
            await sink(store, pg, ["t1"])
            await p.process([ask("t1", [msg("u0"), msg("u1")], 1, T0 + 1)])
            first = await cold.evict(store, pg, FAR_FUTURE_MS)
            await sink(store, pg, ["t1"])
            second = await cold.evict(store, pg, FAR_FUTURE_MS)
            return first, second

        assert tiers(go) == (0, 1)

    def test_an_erased_threads_tombstone_is_not_asked_for_again(self, tiers):
        async def go(make):
            store, pg = make()
            await Processor(store, secret=SECRET).process([ask("t1", [msg("u0")], 0, T0)])
            assert await store.erase("t1", 1, b"erasure1", T0) == 2
            await sink(store, pg, ["t1"])
            first = await cold.evict(store, pg, FAR_FUTURE_MS)
            meta = await store.redis.hgetall(store.keys("t1").meta)
            return first, await cold.evict(store, pg, FAR_FUTURE_MS), meta

        first, again, meta = tiers(go)
        assert (first, again) == (1, 0)
        assert b"cold" not in meta and meta[b"erased"] == str(T0).encode()  # still refused as erased, not loaded from anywhere

    def test_a_thread_used_within_the_idle_time_stays(self, tiers):
        async def go(make):
            store, pg = make()
            await Processor(store, secret=SECRET).process([ask("t1", [msg("u0")], 0, T0)])
            await sink(store, pg, ["t1"])
            return await cold.evict(store, pg, int(time.time() * 1000) - 60_000)

        assert tiers(go) == 0

    def test_a_decision_made_before_its_thread_left_is_made_again_on_the_thread_loaded_back(self, tiers):
        async def go(make):
            store, pg = make()
            p = Processor(store, secret=SECRET)
            await p.process([ask("t1", [msg("u0")], 0, T0)])
            await sink(store, pg, ["t1"])
            commit = store.commit

            async def evicted_meanwhile(writes):  # the thread leaves between the batch's read and its commit
                await cold.evict(store, pg, FAR_FUTURE_MS)
                store.commit = commit
                return await commit(writes)

            store.commit = evicted_meanwhile
            outs = await p.process([ask("t1", [msg("u0"), msg("u1")], 1, T0 + 1)])
            return [json.loads(o.value) for o in outs if o.topic == Topics().filtered], [json.loads(r)["id"] for r in await reads.thread_rows(store, "t1")]

        (filtered,), ids = tiers(go)
        assert [m["id"] for m in filtered["context"]] == ["u0", "u1"]
        assert ids == ["u0", "u1"]


class TestPostgresqlHoldsEachThreadAsOfItsVersion:
    def test_writing_a_thread_again_or_an_older_copy_late_changes_nothing(self, tiers):
        async def go(make):
            store, pg = make()
            p = Processor(store, secret=SECRET)
            await p.process([ask("t1", [msg("u0")], 0, T0)])
            old = await cold.whole(store, ["t1"], {"t1": T0})
            await p.process([ask("t1", [msg("u0"), msg("u1")], 1, T0 + 1)])
            new = await cold.whole(store, ["t1"], {"t1": T0 + 1})
            counts = [(await pg.write(new))[0], (await pg.write(new))[0], (await pg.write(old))[0]]
            return counts, await pg.load(["t1"]), new

        counts, held, new = tiers(go)
        assert counts == [1, 0, 0]
        assert held["t1"].version == 2 and held["t1"].order == ["u0", "u1"] and held["t1"].rows == new[0].rows

    def test_the_tables_answer_sql_as_mastra_lays_them_out(self, tiers):
        async def go(make):
            store, pg = make()
            await Processor(store, secret=SECRET).process([ask("t1", [msg("u0", text="hello")], 0, T0)])
            await sink(store, pg, ["t1"])
            async with (await pg._ready()).acquire() as conn:
                return await conn.fetch(
                    f'SELECT m.id, m.role, m.content, m."resourceId", t."resourceId" AS owner FROM {pg.schema}.mastra_messages m '
                    f'JOIN {pg.schema}.mastra_threads t ON t.id = m.thread_id ORDER BY m."createdAt"'
                )

        (row,) = tiers(go)
        assert (row["id"], row["role"], row["resourceId"], row["owner"]) == ("u0", "user", "r1", "r1")
        assert json.loads(row["content"])["parts"] == [{"type": "text", "text": "hello"}]


class TestATurnWritesWhatItChanged:
    """The sink writes a thread's messages that differ from what PostgreSQL holds, not the
    thread whole (a long thread would be rewritten at every turn); what PostgreSQL holds is
    the same as a whole write's."""

    @staticmethod
    async def rewritten(pg: PostgresHistory, thread: str) -> int:
        """Rows of the thread's messages the last write wrote (its transaction's, as the thread's row)."""
        async with (await pg._ready()).acquire() as conn:
            return await conn.fetchval(
                f"SELECT count(*) FROM {pg.schema}.mastra_messages WHERE thread_id = $1 AND xmin = (SELECT xmin FROM {pg.schema}.mastra_threads WHERE id = $1)",
                thread,
            )

    @staticmethod
    async def held(pg: PostgresHistory, thread: str) -> list[tuple]:
        async with (await pg._ready()).acquire() as conn:
            rows = await conn.fetch(f"SELECT * FROM {pg.schema}.mastra_messages WHERE thread_id = $1 ORDER BY id", thread)
        return [tuple(r.values()) for r in rows]

    def test_a_turn_on_a_long_thread_writes_its_new_rows_alone_and_an_edit_what_it_changed(self, tiers, postgres_url):
        async def go(make):
            store, pg = make()
            whole = PostgresHistory(postgres_url, f"{pg.prefix}-whole")  # a writer that knows nothing: writes threads whole
            p = Processor(store, secret=SECRET)
            history = [msg(f"m{i}", "assistant" if i % 2 else "user", f"said {i}") for i in range(300)]
            await p.process([ask("t1", history, 0, T0)])
            await sink(store, pg, ["t1"])
            first = await self.rewritten(pg, "t1")
            await p.process([ask("t1", [*history, msg("u300", text="and then?")], 1, T0 + 1)])
            await sink(store, pg, ["t1"])
            turn = await self.rewritten(pg, "t1")
            edited = {
                "threadId": "t1",
                "resourceId": "r1",
                "messages": [*history[:100], msg("m100", text="said otherwise")],
                "trigger": "submit-message",
                "messageId": "m100",
            }
            await p.process([Record("chat-requests", 0, 2, T0 + 2, b"t1", json.dumps(edited).encode())])  # m100 edited: the rows after it superseded
            await sink(store, pg, ["t1"])
            edit, order = await self.rewritten(pg, "t1"), (await pg.load(["t1"], into_redis=False))["t1"].order
            try:
                await whole.write(await cold.whole(store, ["t1"], {"t1": T0}))
                return first, turn, edit, order, await self.held(pg, "t1"), await self.held(whole, "t1")
            finally:
                await whole.drop()
                await whole.close()

        first, turn, edit, order, incremental, written_whole = tiers(go)
        assert (first, turn) == (300, 1)
        assert order[-1] != "u300" and 1 <= edit <= 202  # the edit's new row, the rows it superseded, none before m100
        assert incremental == written_whole


class TestPostgresqlDown:
    def test_stopped_it_costs_the_cold_threads_alone_with_the_reason(self, tiers, tmp_path):
        from stacks import REPO, signal_postgres, start_postgres

        folder = REPO / ".stack" / f"postgres-fault-{os.getpid()}-{time.monotonic_ns()}"
        server, url = start_postgres(folder)

        async def go(make):
            store, pg = make(timeout=1.0)
            p = Processor(store, secret=SECRET)
            first = [ask(t, [msg(f"{t}-u0")], i, T0) for i, t in enumerate(("cold", "warm", "idle"))]
            await p.process(first)
            await to_postgresql(store, pg, "cold")
            await sink(store, pg, ["idle"])  # written to PostgreSQL and not used since: what eviction would take next
            signal_postgres(server.pid, signal.SIGSTOP)  # PostgreSQL hangs: every connection waits
            try:
                started = time.monotonic()
                outs = await p.process([ask(t, [msg(f"{t}-u0"), msg(f"{t}-u1")], 10 + i, T0 + 1) for i, t in enumerate(("cold", "warm"))])
                took = time.monotonic() - started
                with pytest.raises(Unavailable):  # eviction pauses: nothing moves
                    await cold.evict(store, pg, FAR_FUTURE_MS)
                paused = not await store.redis.hexists(store.keys("idle").meta, "cold")
            finally:
                signal_postgres(server.pid, signal.SIGCONT)
            later = await p.process([ask("cold", [msg("cold-u0"), msg("cold-u1")], 20, T0 + 2)])
            return outs, took, later, paused

        try:
            outs, took, later, paused = tiers(go, pg_url=url)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(30)
        by_thread = {o.key: o for o in outs if o.topic != Topics().persist}
        dead = by_thread[b"cold"]
        assert dead.topic == Topics().dlq and dict(dead.headers)["error.type"] == b"unavailable"
        assert b"did not answer within 1 s" in dict(dead.headers)["error.message"]
        assert by_thread[b"warm"].topic == Topics().filtered
        assert took < 5  # one bounded wait, not one per request or a hang
        assert paused
        (decided,) = [o for o in later if o.topic == Topics().filtered]  # PostgreSQL back: the request published again is decided
        assert [m["id"] for m in json.loads(decided.value)["context"]] == ["cold-u0", "cold-u1"]


class TestADataErrorIsNotAnOutage:
    """What PostgreSQL cannot hold (U+0000 in a text column, a key past an index entry's
    size) never reaches it from a client (`wire.Id`), but a thread stored before that rule, or
    written by a bug, must not stop the durable tier: PostgreSQL's refusal is the thread's data
    error, reported with the reason, and every other thread is written."""

    @staticmethod
    async def copied(store: HistoryStore, source: str, target: str) -> None:
        """Thread `source`'s keys renamed to `target`'s (a thread id the edge would now refuse)."""
        for old, new in zip(msgspec.structs.astuple(store.keys(source)), msgspec.structs.astuple(store.keys(target))):
            if await store.redis.exists(old):
                await store.redis.rename(old, new)

    @pytest.mark.parametrize(
        "bad, refusal",
        [("t\x00x", "CharacterNotInRepertoireError"), ("".join(random.Random(6).choices(string.ascii_letters, k=6000)), "ProgramLimitExceededError")],
        ids=["U+0000 in the thread id", "a thread id of 6,000 random letters"],
    )
    def test_a_thread_postgresql_refuses_is_named_with_its_reason_and_the_others_are_written(self, tiers, bad, refusal):
        async def go(make):
            store, pg = make()
            p = Processor(store, secret=SECRET)
            await p.process([ask(name, [msg(f"{name}-u0"), msg(f"{name}-u1")], i, T0) for i, name in enumerate(["before", "source", "after"])])
            await self.copied(store, "source", bad)
            written, refused = await sink(store, pg, ["before", bad, "after"])
            held = await pg.load(["before", "after"], into_redis=False)
            return written, refused, sorted(held), await cold.evict(store, pg, FAR_FUTURE_MS)

        written, refused, held, evicted = tiers(go)
        assert (written, held) == (2, ["after", "before"])
        [(thread, why)] = refused.items()
        assert thread == bad and why.startswith("PostgreSQL at postgresql://") and f"refused the data: {refusal}" in why
        assert evicted == 2  # the refused thread stays in Redis: eviction takes only what PostgreSQL holds

    def test_postgresql_not_answering_is_an_outage_named_as_one(self, tiers):
        async def go(make):
            store, pg = make(timeout=0.5)
            await Processor(store, secret=SECRET).process([ask("t1", [msg("u0")], 0, T0)])
            threads = await cold.whole(store, ["t1"], {})
            unreachable = PostgresHistory("postgresql://memfilter@127.0.0.1:9/postgres", pg.prefix, 0.5)
            with pytest.raises(Unavailable, match="did not answer within 0.5 s"):
                await unreachable.write(threads)
            return True

        assert tiers(go)

"""Import and erasure in the store, against a real Redis: the persister applies an operator's
import only where it agrees with the stored thread, an erasure leaves a tombstone and nothing
else, and every writer but the processor is refused on an erased thread; a rebuild starts an
erased thread at its erasure, never applying what it erased, and ends where the live store is."""

from __future__ import annotations

import json

from factories import SECRET, T0, msg

from memfilter.audit.recorded import Recorded
from memfilter.audit.replay import apply_log
from memfilter.core import origin
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store import reads
from memfilter.store.history import HistoryStore

TOPICS = Topics()


def event(thread: str, rows: list[dict], offset: int, headers=(), resource: str = "r1", **fields) -> Record:
    value = json.dumps({"requestId": f"e{offset}", "threadId": thread, "resourceId": resource, "messages": rows, **fields}).encode()
    if headers == "operator":
        headers = origin.operator_headers(value, SECRET)
    return Record(TOPICS.persist, 0, offset, T0 + offset, thread.encode(), value, tuple(headers))


def erasure(thread: str, version: int, offset: int, resource: str = "r1") -> Record:
    return event(thread, [], offset, "operator", resource, historyVersion=version, erasure={"at": "2026-03-01T12:00:00.000Z", "by": "dpo", "scope": "thread"})


def request(thread: str, messages: list, offset: int) -> Record:
    value = {"requestId": f"q{offset}", "threadId": thread, "resourceId": "r1", "messages": messages}
    return Record(TOPICS.requests, 0, offset, T0 + offset, thread.encode(), json.dumps(value).encode())


def row(mid: str, role: str = "user", text: str = "hi") -> dict:
    return msg(mid, role, text, threadId="t1", resourceId="r1", createdAt="2026-03-01T11:00:00.000Z")


async def keys_of(store: HistoryStore, thread: str) -> list[str]:
    return sorted(k.decode() for k in await store.redis.keys(f"{store.prefix}:t:{{{thread}}}:*"))


class TestAnImport:
    def test_sets_the_owner_of_a_new_thread_and_again_changes_nothing(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            persister = Persister(store, TOPICS.dlq, SECRET)
            assert await persister.apply([event("t1", [row("u1"), row("a1", "assistant")], 0, "operator")]) == [1]
            assert await persister.apply([event("t1", [row("u1"), row("a1", "assistant")], 1, "operator")]) == [1]
            meta = await reads.meta(store, "t1")
            return meta.owner, meta.size, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t1")]

        assert redis_run(go) == ("r1", 2, ["u1", "a1"])

    def test_without_the_operators_signature_is_another_services_save_and_may_not_take_a_thread(self, redis_run):
        async def go(client, prefix):
            persister = Persister(HistoryStore(client, prefix()), TOPICS.dlq, SECRET)
            forged = event("t1", [row("u1")], 0, [origin.OPERATOR, (origin.SIGNATURE, b"00" * 32)])
            return [r.type for r in await persister.apply([event("t1", [row("u1")], 1), forged])]

        assert redis_run(go) == ["ownership", "origin"]

    def test_continues_a_thread_it_agrees_with_and_refuses_one_it_does_not(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            persister = Persister(store, TOPICS.dlq, SECRET)
            await persister.apply([event("t1", [row("u1"), row("a1", "assistant")], 0, "operator")])
            results = await persister.apply(
                [
                    event("t1", [row("u1"), row("a1", "assistant"), row("u2")], 1, "operator"),  # the same, and more
                    event("t1", [row("u1"), row("u9")], 2, "operator"),  # another order
                    event("t1", [row("u1", text="changed")], 3, "operator"),  # other content under a stored id
                ]
            )
            return [r if isinstance(r, int) else r.type for r in results], [json.loads(r)["id"] for r in await reads.thread_rows(store, "t1")]

        assert redis_run(go) == ([2, "clash", "clash"], ["u1", "a1", "u2"])


class TestAnErasure:
    def test_leaves_only_a_tombstone_and_its_ids_free(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            processor = Processor(store, TOPICS, secret=SECRET)
            await processor.process([request("t1", [msg("u1")], 0)])
            await processor.process([request("t1", [msg("u1"), msg("a1", "assistant"), msg("u2")], 1)])
            before = await keys_of(store, "t1")
            persister = Persister(store, TOPICS.dlq, SECRET)
            version = (await reads.meta(store, "t1")).version
            assert await persister.apply([erasure("t1", version, 5)]) == [version + 1]
            after = await keys_of(store, "t1")
            held, _, erased = await store.owners(["u1", "u2"], ["t1"])
            return before, after, held, erased, await client.hkeys(f"{store.prefix}:t:{{t1}}:meta")

        before, after, held, erased, meta = redis_run(go)
        assert any(":pending:" in k for k in before) and any(k.endswith(":recent") for k in before)  # what it had
        assert [k.rsplit(":", 1)[1] for k in after] == ["meta"] and held == {} and erased == {"t1"}
        assert sorted(meta) == [b"epoch", b"erased", b"erasures", b"version"]

    def test_is_seen_by_recall_before_postgresql_hears_of_it_as_is_another_resources_thread(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            processor = Processor(store, TOPICS, secret=SECRET)
            await processor.process([request(t, [msg(f"{t}-u1")], n) for n, t in enumerate(("kept", "erased"))])
            theirs = {"requestId": "q3", "threadId": "theirs", "resourceId": "r2", "messages": [msg("x1")]}
            await processor.process([Record(TOPICS.requests, 0, 3, T0 + 3, b"theirs", json.dumps(theirs).encode())])
            version = (await reads.meta(store, "erased")).version
            await Persister(store, TOPICS.dlq, SECRET).apply([erasure("erased", version, 5)])
            return await reads.gone(store, "r1", ["kept", "erased", "theirs", "never-stored"])

        assert redis_run(go) == {"erased", "theirs"}

    def test_asked_at_an_older_version_erases_nothing_and_again_changes_nothing(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            persister = Persister(store, TOPICS.dlq, SECRET)
            await persister.apply([event("t1", [row("u1")], 0, "operator"), event("t1", [row("u1"), row("u2")], 1, "operator")])
            stale = await persister.apply([erasure("t1", 1, 2)])
            rows = len(await reads.thread_rows(store, "t1"))
            once = erasure("t1", 2, 3)
            return stale[0].type, rows, await persister.apply([once, once])

        assert redis_run(go) == ("stale", 2, [3, 3])

    def test_refuses_every_writer_after_it_but_the_processors_own(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            persister = Persister(store, TOPICS.dlq, SECRET)
            await persister.apply([event("t1", [row("u1")], 0, "operator")])
            await persister.apply([erasure("t1", 1, 1)])
            service, imported = await persister.apply([event("t1", [row("u1")], 2), event("t1", [row("u1")], 3, "operator")])
            own = event("t1", [row("n1")], 4, origin.headers(json.dumps({}).encode(), SECRET))  # placeholder, signed below
            value = json.dumps({"requestId": "q9", "threadId": "t1", "resourceId": "r1", "messages": [row("n1")], "historyVersion": 2}).encode()
            own = Record(TOPICS.persist, 0, 4, T0, b"t1", value, origin.headers(value, SECRET))
            return service.type, imported.type, await persister.apply([own]), (await reads.meta(store, "t1")).erased

        assert redis_run(go) == ("erased", "erased", [3], False)  # the processor's own: a thread its resource started again


def test_a_rebuild_starts_an_erased_thread_at_its_erasure_and_agrees_with_the_live_store(redis_run):
    """The log holds the thread's saves, its erasure, a stray save refused live, and the saves
    of a new conversation the operator let start it again: a rebuild applies only the erasure
    and what came after, and stores what the live store holds."""

    async def go(client, prefix):
        live = HistoryStore(client, prefix())
        processor = Processor(live, TOPICS, secret=SECRET)
        persister = Persister(live, TOPICS.dlq, SECRET)
        log: list[Record] = []
        dead: list[Record] = []
        offset = 0

        async def through(records: list[Record], applying: bool) -> None:
            nonlocal offset
            for r in records:
                r = Record(r.topic, 0, offset, r.timestamp_ms, r.key, r.value, r.headers)
                offset += 1
                if not applying:  # the processor's request: its own events land on the log
                    for out in await processor.process([r]):
                        if out.topic == TOPICS.persist:
                            log.append(Record(TOPICS.persist, 0, len(log), T0, out.key, out.value, out.headers))
                    continue
                at = len(log)
                log.append(Record(TOPICS.persist, 0, at, r.timestamp_ms, r.key, r.value, r.headers))
                [result] = await persister.apply([log[-1]])
                if not isinstance(result, int):
                    headers = (("source.topic", TOPICS.persist.encode()), ("source.partition", b"0"), ("source.offset", str(at).encode()))
                    dead.append(Record(TOPICS.dlq, 0, len(dead), T0, r.key, b"", headers))

        await through([request("t1", [msg("u1")], 0), request("t1", [msg("u1"), msg("a1", "assistant"), msg("u2")], 0)], False)
        await through([event("t1", [row("a2", "assistant")], 0)], True)
        await through([erasure("t1", (await reads.meta(live, "t1")).version, 0), event("t1", [row("late", "assistant")], 0)], True)
        processor.policy = processor.policy.__class__(reopen_erased=True)
        await through([request("t1", [msg("n1")], 0)], False)
        await through([event("t1", [row("n2", "assistant")], 0)], True)

        rebuilt = HistoryStore(client, prefix())
        with Recorded.temporary(TOPICS, SECRET) as recorded:
            recorded.add_persisted(log)
            recorded.add_dead(dead)
            applied = await apply_log(recorded, rebuilt)

        async def state(store):
            meta = await reads.meta(store, "t1")
            return meta.version, meta.owner, meta.erased, [json.loads(r)["id"] for r in await reads.thread_rows(store, "t1")]

        return applied, await state(live), await state(rebuilt), len(log)

    applied, live, rebuilt, logged = redis_run(go)
    assert live == rebuilt == (5, "r1", False, ["n1", "n2"])  # u1, u2, a2, the erasure (at 3), n1, n2
    assert applied == (3, 1, logged - 4)  # the erasure, n1, n2; never u1, u2, a2; the late save refused live

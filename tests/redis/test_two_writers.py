"""A thread's two writers, requests and other services' saves, against a real Redis: the rules
that make their order, and re-delivery, harmless.

A conversation here is what a `useChat` client and an agent runner produce: each turn, a
request with the echo of the conversation and the user's new message, then the agent's reply
saved through `persist-messages`; a reply may be a pending client tool call, whose result the
client sends in its next request.
"""

from __future__ import annotations

import json

import pytest
from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from factories import SECRET, T0
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfilter.audit.recorded import Recorded
from memfilter.core import origin
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.runtime.worker import in_order
from memfilter.runtime.written import Written
from memfilter.settings import Topics
from memfilter.store import reads
from memfilter.store.history import Fenced, HistoryStore, Save

TOPICS = Topics()


def text(mid: str, role: str, words: str) -> dict:
    return {"id": mid, "role": role, "createdAt": "2026-03-01T10:00:00.000Z", "content": {"format": 2, "parts": [{"type": "text", "text": words}]}}


def tool_call(mid: str, call_id: str, state: str = "call", **extra) -> dict:
    invocation = {"state": state, "toolCallId": call_id, "toolName": "confirm", "args": {"q": "ok?"}, **extra}
    return {
        "id": mid,
        "role": "assistant",
        "createdAt": "2026-03-01T10:00:00.000Z",
        "content": {"format": 2, "parts": [{"type": "tool-invocation", "toolInvocation": invocation}]},
    }


def request(thread: str, request_id: str, messages: list[dict], offset: int) -> Record:
    value = {"requestId": request_id, "threadId": thread, "resourceId": "r1", "messages": messages}
    return Record(TOPICS.requests, 0, offset, T0 + offset, thread.encode(), json.dumps(value).encode())


def save(thread: str, request_id: str, messages: list[dict], offset: int) -> Record:
    value = {"requestId": request_id, "threadId": thread, "resourceId": "r1", "messages": messages}
    return Record(TOPICS.persist, 0, offset, T0 + offset, thread.encode(), json.dumps(value).encode())


def conversation(thread: str, replies: list[str]) -> list[Record]:
    """A thread's records in the order they happen: per turn a request, then the agent's reply:
    "text"; "draft", saved once as a draft and then again whole; or "tool", a pending call,
    whose result the client sends in the next request."""
    records: list[Record] = []
    echo: list[dict] = []
    for k, reply in enumerate(replies):
        echo.append(text(f"{thread}-u{k}", "user", f"question {k}"))
        records.append(request(thread, f"{thread}-r{k}", list(echo), len(records)))
        if reply in ("text", "draft"):
            if reply == "draft":
                records.append(save(thread, f"{thread}-d{k}", [text(f"{thread}-a{k}", "assistant", "...")], len(records)))
            echo.append(text(f"{thread}-a{k}", "assistant", f"answer {k}"))
            records.append(save(thread, f"{thread}-s{k}", [echo[-1]], len(records)))
        else:
            echo.append(tool_call(f"{thread}-a{k}", f"{thread}-c{k}"))
            records.append(save(thread, f"{thread}-s{k}", [echo[-1]], len(records)))
            echo[-1] = tool_call(f"{thread}-a{k}", f"{thread}-c{k}", "result", result={"yes": True})
            records.append(request(thread, f"{thread}-t{k}", list(echo), len(records)))
    return records


async def apply(store: HistoryStore, records: list[Record]) -> None:
    """Each record alone, as a worker would in that order; every one must be accepted."""
    processor, persister = Processor(store, secret=SECRET), Persister(store, TOPICS.dlq, SECRET)
    for r in records:
        outs = await (processor.process([r]) if r.topic == TOPICS.requests else persister.process([r]))
        assert not [o for o in outs if o.topic == TOPICS.dlq], [dict(o.headers) for o in outs]


async def history(store: HistoryStore, thread: str) -> tuple:
    """A thread's rows, order, meta (but the fencing epoch) and applied saves."""
    k, r = store.keys(thread), store.redis
    return await r.hgetall(k.rows), await r.lrange(k.order, 0, -1), await r.hmget(k.meta, "owner", "version", "newest"), await r.get(k.saved)


def stored_states(rows: list[bytes]) -> dict[str, str]:
    """toolCallId -> state, of a thread's stored rows."""
    out = {}
    for row in rows:
        for part in json.loads(row)["content"]["parts"]:
            if part["type"] == "tool-invocation":
                out[part["toolInvocation"]["toolCallId"]] = part["toolInvocation"]["state"]
    return out


class TestASaveIsAppliedOnce:
    def test_a_repeated_save_after_a_newer_write_changes_nothing(self, redis_run):
        records = conversation("t", ["text", "text"])
        later_text = save("t", "t-s0", [text("t-a0", "assistant", "rewritten")], 9)  # the same save, other content

        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            await apply(store, records)
            before = await reads.thread_rows(store, "t")
            await apply(store, [records[1], later_text, records[1]])
            return before, await reads.thread_rows(store, "t")

        before, after = redis_run(go)
        assert after == before

    def test_a_late_copy_of_a_pending_call_never_undoes_the_clients_result(self, redis_run):
        records = conversation("t", ["tool", "text"])
        again = save("t", "t-s0-retry", [tool_call("t-a0", "t-c0")], 9)  # published anew by the agent

        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            await apply(store, records)
            await apply(store, [records[1], again])
            return await reads.thread_rows(store, "t")

        assert stored_states(redis_run(go)) == {"t-c0": "result"}

    def test_a_result_is_never_replaced_by_another_outcome_or_dropped(self, redis_run):
        records = conversation("t", ["tool"])
        error = save("t", "x1", [tool_call("t-a0", "t-c0", "output-error", errorText="late")], 9)
        dropped = save("t", "x2", [text("t-a0", "assistant", "no tool any more")], 10)

        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            await apply(store, records + [error, dropped])
            return await reads.thread_rows(store, "t")

        rows = redis_run(go)
        assert stored_states(rows) == {"t-c0": "result"} and json.loads(rows[-1])["content"]["parts"][0]["toolInvocation"]["result"] == {"yes": True}

    def test_a_save_that_moves_a_call_forward_is_applied(self, redis_run):
        records = conversation("t", ["tool"])[:2]  # the call, still pending
        approval = save("t", "x1", [tool_call("t-a0", "t-c0", "output-denied")], 9)

        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            await apply(store, records + [approval])
            return await reads.thread_rows(store, "t")

        assert stored_states(redis_run(go)) == {"t-c0": "output-denied"}


class TestOrderAndRepeats:
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(
        replies=st.lists(st.sampled_from(["text", "draft", "tool"]), min_size=1, max_size=4),
        repeats=st.lists(st.tuples(st.integers(0, 100), st.integers(0, 100)), max_size=8),
    )
    def test_any_redelivery_of_requests_and_saves_leaves_the_history_of_one_pass_in_order(self, redis_run, replies, repeats):
        """Each repeat (which, how much later) sends an earlier record again at a later point."""
        records = conversation("t", replies)
        delivered = list(records)
        for which, later in repeats:
            i = which % len(records)
            at = delivered.index(records[i]) + 1 + later % (len(delivered) - delivered.index(records[i]))
            delivered.insert(at, records[i])

        async def go(client, prefix):
            once, again = prefix(), prefix()
            await apply(HistoryStore(client, once), records)
            await apply(HistoryStore(client, again), delivered)
            return await history(HistoryStore(client, once), "t"), await history(HistoryStore(client, again), "t")

        once, again = redis_run(go)
        assert again == once


class TestFencing:
    def test_a_worker_whose_tasks_were_given_away_cannot_write_a_thread_the_new_owner_wrote(self, redis_run):
        first, second = conversation("t", ["text", "text"])[:2], conversation("t", ["text", "text"])[2:]

        async def go(client, prefix):
            name = prefix()
            old, new = HistoryStore(client, name), HistoryStore(client, name)
            await old.take_epoch()
            await apply(old, first)
            await new.take_epoch()  # the tasks go to another worker
            await apply(new, second[:1])
            with pytest.raises(Fenced, match="thread t was written by a worker with owner epoch 2, newer than this worker's 1"):
                await old.apply([Save("t", "r1", -1, [("t-a0", b'{"id":"t-a0","role":"assistant","content":{"format":2,"parts":[]}}')], ["assistant"], b"")])
            with pytest.raises(Fenced):
                await apply(old, second[1:])
            await apply(old, conversation("other", ["text"]))  # a thread the new owner has not written: its records are re-delivered to the new owner anyway
            return await reads.thread_rows(new, "t")

        rows = redis_run(go)
        assert [json.loads(r)["id"] for r in rows] == ["t-u0", "t-a0", "t-u1"]


def consumer_record(topic: str, offset: int, ts: int, key: bytes, value: bytes = b"{}", headers=()) -> ConsumerRecord:
    return ConsumerRecord(topic, 0, offset, ts, 0, key, value, None, len(key), len(value), list(headers))


class TestMergedOrder:
    def test_a_save_made_before_a_request_is_applied_before_it_in_the_same_batch(self):
        batch = {
            TopicPartition(TOPICS.requests, 0): [consumer_record(TOPICS.requests, 0, 100, b"a"), consumer_record(TOPICS.requests, 1, 300, b"a")],
            TopicPartition(TOPICS.persist, 0): [consumer_record(TOPICS.persist, 0, 200, b"a"), consumer_record(TOPICS.persist, 1, 50, b"b")],
        }
        phases = in_order(batch, TOPICS, SECRET, Written())
        assert [([r.offset for r in q], [r.offset for r in p]) for q, p in phases] == [([0], [1]), ([], [0]), ([1], [])]

    def test_threads_that_do_not_alternate_take_one_phase(self):
        batch = {
            TopicPartition(TOPICS.requests, 0): [consumer_record(TOPICS.requests, i, 100 + i, f"t{i}".encode()) for i in range(50)],
            TopicPartition(TOPICS.persist, 0): [consumer_record(TOPICS.persist, i, 100 + i, f"s{i}".encode()) for i in range(50)],
        }
        [(requests, saves)] = in_order(batch, TOPICS, SECRET, Written())
        assert len(requests) == len(saves) == 50

    def test_the_processors_own_saves_are_left_out(self):
        value = b'{"own": 1}'
        batch = {TopicPartition(TOPICS.persist, 0): [consumer_record(TOPICS.persist, 0, 1, b"a", value, origin.headers(value, SECRET))]}
        assert in_order(batch, TOPICS, SECRET, Written()) == []

    def test_saves_at_offsets_this_process_wrote_are_left_out_unverified_and_the_others_applied(self):
        written = Written()
        written.add(TopicPartition(TOPICS.persist, 0), 5, 3)
        batch = {TopicPartition(TOPICS.persist, 0): [consumer_record(TOPICS.persist, o, 100 + o, b"a") for o in range(4, 10)]}
        [([], saves)] = in_order(batch, TOPICS, SECRET, written)
        assert [r.offset for r in saves] == [4, 8, 9]

    def test_a_save_forging_the_processors_mark_goes_to_the_persister(self):
        value = b'{"forged": 1}'
        batch = {TopicPartition(TOPICS.persist, 0): [consumer_record(TOPICS.persist, 0, 1, b"a", value, origin.headers(value, b"not the secret"))]}
        [([], saves)] = in_order(batch, TOPICS, SECRET, Written())
        assert [r.offset for r in saves] == [0]


class TestRebuildOrder:
    def test_the_processors_save_goes_where_its_decision_was_made_among_other_writers(self, tmp_path):
        recorded = Recorded(tmp_path, TOPICS, SECRET)
        for offset, version in ((0, None), (1, None), (2, 1), (3, None)):
            value = json.dumps(
                {"requestId": str(offset), "threadId": "t", "resourceId": "r", "messages": [], **({"historyVersion": version} if version is not None else {})}
            ).encode()
            headers = origin.headers(value, SECRET) if version is not None else ()
            recorded.add_persisted([Record(TOPICS.persist, 0, offset, 0, b"t", value, headers)])
        log = recorded.log(b"t")
        order = []
        version = 0
        while log:
            order.append(log.next(version).offset)
            version += 1
        assert order == [0, 2, 1, 3]  # decided on version 1: after the first save, before the second

    def test_a_copy_of_the_processors_event_published_again_is_applied_once_as_the_worker_skipped_it(self, tmp_path):
        recorded = Recorded(tmp_path, TOPICS, SECRET)
        value = json.dumps({"requestId": "q", "threadId": "t", "resourceId": "r", "messages": [], "historyVersion": 0}).encode()
        for offset in (0, 1):  # the event, and a copy of it (bytes and signature) published later
            recorded.add_persisted([Record(TOPICS.persist, 0, offset, 0, b"t", value, origin.headers(value, SECRET))])
        log = recorded.log(b"t")
        handed = [log.next(0).offset]
        assert handed == [0] and not log

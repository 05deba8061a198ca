"""Working memory on the worker's side, against a real Redis (`memfilter.store.memory`, the
persister and the processor): an update an event carries is applied in order with its thread's
saves, every later request's filtered input carries the document (in Mastra's system message,
counted in the budget), and the document is the same whatever order updates of several threads
are applied in, applied again, rebuilt from the log, or after an erasure.
"""

from __future__ import annotations

import json

from factories import SECRET, T0, msg

from memfilter.audit.recorded import Recorded
from memfilter.audit.replay import apply_log, replay_log
from memfilter.core import origin
from memfilter.core.filter import Policy
from memfilter.core.tokens import COUNTERS
from memfilter.core.window import Budget
from memfilter.core.working_memory import instruction, template_of
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store.history import HistoryStore
from memfilter.store.memory import WorkingMemories

TOPICS = Topics()
TEMPLATE = template_of()  # Mastra's default Markdown template


def request(thread: str, n: int, resource: str = "r1") -> Record:
    value = {"requestId": f"{thread}-q{n}", "threadId": thread, "resourceId": resource, "messages": [msg(f"{thread}-u{n}")]}
    return Record(TOPICS.requests, 0, n, T0 + n, thread.encode(), json.dumps(value).encode())


def reply(thread: str, n: int, memory: str, resource: str = "r1", at: int | None = None, request_id: str | None = None) -> Record:
    """The agent's reply to request n of the thread, which called updateWorkingMemory."""
    value = {
        "requestId": request_id or f"{thread}-q{n}/reply",
        "threadId": thread,
        "resourceId": resource,
        "messages": [msg(f"{thread}-a{n}", "assistant", "noted")],
        "workingMemory": {"calls": [{"memory": memory}]},
    }
    return Record(TOPICS.persist, 0, 100 + n, T0 + (n if at is None else at), thread.encode(), json.dumps(value).encode())


def parts(store: HistoryStore, scope: str = "resource") -> tuple[Processor, Persister, WorkingMemories]:
    memories = WorkingMemories(store, TEMPLATE, scope)
    return Processor(store, TOPICS, secret=SECRET, memories=memories), Persister(store, TOPICS.dlq, SECRET, memories), memories


def filtered(outs) -> dict:
    [out] = [o for o in outs if o.topic == TOPICS.filtered]
    return json.loads(out.value)


class TestAnUpdate:
    def test_is_in_every_later_request_of_its_resource_and_never_in_another_resources(self, redis_run):
        async def go(client, prefix):
            processor, persister, _ = parts(HistoryStore(client, prefix()))
            first = filtered(await processor.process([request("t1", 0)]))
            assert await persister.apply([reply("t1", 0, "# User\n- Name: Sam")]) == [2]
            again = filtered(await processor.process([request("t1", 1)]))
            other_thread = filtered(await processor.process([request("t2", 0)]))
            other_resource = filtered(await processor.process([request("t3", 0, resource="r2")]))
            return first, again, other_thread, other_resource

        first, again, other_thread, other_resource = redis_run(go)
        assert first["workingMemory"] is None and first["context"][0]["content"]["parts"][0]["text"] == instruction(TEMPLATE, None)
        for seen in (again, other_thread):
            assert seen["workingMemory"] == "# User\n- Name: Sam"
            assert seen["context"][0] == {
                "role": "system",
                "content": {"format": 2, "parts": [{"type": "text", "text": instruction(TEMPLATE, "# User\n- Name: Sam")}]},
            }
        assert other_resource["workingMemory"] is None

    def test_of_a_thread_scope_stays_in_its_thread(self, redis_run):
        async def go(client, prefix):
            processor, persister, _ = parts(HistoryStore(client, prefix()), "thread")
            await processor.process([request("t1", 0), request("t2", 0)])
            await persister.apply([reply("t1", 0, "t1's")])
            return filtered(await processor.process([request("t1", 1)])), filtered(await processor.process([request("t2", 1)]))

        mine, theirs = redis_run(go)
        assert mine["workingMemory"] == "t1's" and theirs["workingMemory"] is None

    def test_naming_another_resource_than_the_threads_owner_updates_nothing(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            processor, persister, memories = parts(store)
            await processor.process([request("t1", 0), request("t9", 0, resource="r2")])
            refused = await persister.apply([reply("t1", 0, "r2 writes r1's thread", resource="r2")])
            return refused, await memories.documents([("t1", "r1"), ("t1", "r2"), ("t9", "r2")])

        [refused], documents = redis_run(go)
        assert refused.type == "ownership" and documents == [None, None, None]

    def test_from_the_processors_own_event_is_refused(self, redis_run):
        async def go(client, prefix):
            processor, persister, _ = parts(HistoryStore(client, prefix()))
            await processor.process([request("t1", 0)])
            value = json.dumps({"requestId": "forged", "threadId": "t1", "resourceId": "r1", "messages": [], "workingMemory": {"calls": [{"memory": "x"}]}})
            headers = tuple(origin.headers(value.encode(), SECRET))
            return await persister.apply([Record(TOPICS.persist, 0, 7, T0, b"t1", value.encode(), headers)])

        [refused] = redis_run(go)
        assert refused.type == "schema" and "never update working memory" in refused.message

    def test_over_its_bound_is_refused_and_its_reply_with_it(self, redis_run):
        async def go(client, prefix):
            processor, persister, memories = parts(HistoryStore(client, prefix()))
            await processor.process([request("t1", 0)])
            refused = await persister.apply([reply("t1", 0, "x" * 20_000)])
            return refused, await memories.documents([("t1", "r1")])

        [refused], documents = redis_run(go)
        assert refused.type == "too-large" and "workingMemory.calls[0]" in refused.message and documents == [None]


class TestTheDocument:
    def test_folds_updates_by_record_time_whatever_order_they_are_applied_in_and_again_changes_nothing(self, redis_run):
        updates = [reply("t1", 0, "first", at=10), reply("t2", 0, "second", at=20), reply("t3", 0, "third", at=30)]

        async def go(client, prefix):
            documents = []
            for order in (updates, updates[::-1], [updates[1], updates[2], updates[0]]):
                store = HistoryStore(client, prefix())
                processor, persister, memories = parts(store)
                await processor.process([request(t, 0) for t in ("t1", "t2", "t3")])
                for record in order:
                    await persister.apply([record])
                await persister.apply(order)  # all again
                # the same input answered twice (a runner after a rebalance): its first reply stands
                await persister.apply([reply("t1", 0, "a second answer", at=40)])
                documents.append(await memories.documents([("t1", "r1")]))
            return documents

        assert redis_run(go) == [["third"]] * 3

    def test_a_markdown_update_to_the_empty_template_keeps_what_it_said(self, redis_run):
        async def go(client, prefix):
            processor, persister, memories = parts(HistoryStore(client, prefix()))
            await processor.process([request("t1", 0)])
            await persister.apply([reply("t1", 0, "# User\n- Name: Sam", at=1), reply("t1", 1, TEMPLATE.content, at=2)])
            return await memories.documents([("t1", "r1")])

        assert redis_run(go) == ["# User\n- Name: Sam"]

    def test_an_erased_threads_updates_leave_it_and_a_rebuild_from_the_log_gives_the_same(self, redis_run):
        async def go(client, prefix):
            store = HistoryStore(client, prefix())
            processor, persister, memories = parts(store)
            log = [request("t1", 0), request("t2", 1)]
            await processor.process(log)
            saves = [reply("t1", 0, "from t1", at=5), reply("t2", 1, "from t2", at=6)]
            await persister.apply(saves)
            before = await memories.documents([("t1", "r1")])
            version = (await store.read({"t2": []}))["t2"].version
            erasure = json.dumps(
                {
                    "requestId": "erase-t2",
                    "threadId": "t2",
                    "resourceId": "r1",
                    "messages": [],
                    "historyVersion": version,
                    "erasure": {"at": "2026-03-01T12:00:00.000Z", "by": "dpo", "scope": "thread"},
                }
            ).encode()
            erase = Record(TOPICS.persist, 0, 200, T0 + 200, b"t2", erasure, tuple(origin.operator_headers(erasure, SECRET)))
            await persister.apply([erase])
            after = await memories.documents([("t1", "r1")])
            rebuilt = HistoryStore(client, prefix())
            with Recorded.temporary(TOPICS, SECRET) as recorded:
                persisted = [*(await processor_events(processor, log)), *saves, erase]
                recorded.add_persisted(persisted)
                await apply_log(recorded, rebuilt, memories=WorkingMemories(rebuilt, TEMPLATE, "resource"))
            return before, after, await WorkingMemories(rebuilt, TEMPLATE, "resource").documents([("t1", "r1")])

        before, after, rebuilt = redis_run(go)
        assert before == ["from t2"] and after == ["from t1"] and rebuilt == after


async def processor_events(processor: Processor, log: list[Record]) -> list[Record]:
    """The processor's own persist events for these requests, as the worker sends them (the
    requests were decided already: their recorded outputs, re-emitted)."""
    outs = await processor.process(log)
    return [Record(o.topic, 0, 50 + i, o.timestamp_ms, o.key, o.value, tuple(o.headers)) for i, o in enumerate(outs) if o.topic == TOPICS.persist]


class TestTheBudget:
    def test_counts_the_instruction_as_a_system_message(self, redis_run):
        async def go(client, prefix):
            budget = Budget(2000, COUNTERS["estimate"])
            store = HistoryStore(client, prefix(), counter=budget.counter)
            memories = WorkingMemories(store, TEMPLATE, "resource")
            with_memory = Processor(store, TOPICS, Policy(budget=budget), secret=SECRET, memories=memories)
            plain = Processor(HistoryStore(client, prefix(), counter=budget.counter), TOPICS, Policy(budget=budget), secret=SECRET)
            return filtered(await with_memory.process([request("t1", 0)])), filtered(await plain.process([request("t1", 0)]))

        with_memory, plain = redis_run(go)
        assert with_memory["contextTokens"] == round(plain["contextTokens"] + COUNTERS["estimate"].system(with_memory["context"][0]), 1)

    def test_a_refusal_for_the_budget_is_replayed_on_the_document_it_weighed(self, redis_run):
        budget = Budget(1500, COUNTERS["estimate"])
        big = "# User\n" + "".join(f"- fact {i}: something the user said long ago\n" for i in range(200))

        async def go(client, prefix):
            live = HistoryStore(client, prefix(), counter=budget.counter)
            memories = WorkingMemories(live, TEMPLATE, "resource")
            processor = Processor(live, TOPICS, Policy(budget=budget), secret=SECRET, memories=memories)
            persister = Persister(live, TOPICS.dlq, SECRET, memories)
            requests = [request("t1", 0), request("t1", 1)]
            first = await processor.process(requests[:1])
            saved = [as_record(o, 50) for o in first if o.topic == TOPICS.persist] + [reply("t1", 0, big)]
            await persister.apply(saved[1:])
            second = await processor.process(requests[1:])
            outs = [as_record(o, 60 + i) for i, o in enumerate(first + second)]
            replayed = HistoryStore(client, prefix(), counter=budget.counter)

            async def batches():
                yield requests

            with Recorded.temporary(TOPICS, SECRET) as recorded:
                recorded.add_filtered([o for o in outs if o.topic == TOPICS.filtered])
                recorded.add_dead([o for o in outs if o.topic == TOPICS.dlq])
                recorded.add_persisted(saved)
                report = await replay_log(recorded, replayed, batches(), Policy(budget=budget), memories=WorkingMemories(replayed, TEMPLATE, "resource"))
            return [dict(o.headers).get("error.type") for o in outs if o.topic == TOPICS.dlq], report

        refused, report = redis_run(go)
        assert refused == [b"context-budget"]  # the document does not fit beside the request
        assert (report.requests, report.different) == (2, 0), report.to_json()


def as_record(out, offset: int) -> Record:
    return Record(out.topic, 0, offset, out.timestamp_ms or T0, out.key, out.value, tuple(out.headers))

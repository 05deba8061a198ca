"""Working memory end to end: a worker and the agent runner (its `openai` backend on the fake
endpoint, which calls `updateWorkingMemory` when told to) on a real Kafka and Redis.

The model updates the document through the runner's tool; the runner answers the call and
calls the model again; the reply and its update are saved in one event, applied in order; the
next request of any thread of the resource carries the document in Mastra's system message,
another resource's never; `memfilter forget` erases it; a rebuild from the log makes the same
document, and a replay decides every request as it was decided. `memfilter history import`
brings Mastra's stored document in (its storage makes the export: tests/node/export.mjs).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from fake_openai import FakeOpenAI
from pipeline import Pipeline, publish, read, wait_for_line

from memfilter.core.working_memory import instruction, template_of
from memfilter.store.history import HistoryStore
from memfilter.store.memory import WorkingMemories
from memfilter.store.redis_driver import connect

NODE = Path(__file__).parents[1] / "node"
TEMPLATE = template_of()
SAM = "# User Information\n- **First Name**: Sam"


@pytest.fixture
def fake_openai():
    fake = FakeOpenAI()
    yield fake
    fake.close()


def stored(mid: str, text: str) -> dict:
    return {"id": mid, "role": "user", "createdAt": "2026-01-05T10:00:00.000Z", "content": {"format": 2, "parts": [{"type": "text", "text": text}]}}


def user(mid: str, text: str) -> dict:
    return {"id": mid, "role": "user", "parts": [{"type": "text", "text": text}]}


async def until(check, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)
    return result


async def document(pipeline: Pipeline, thread: str, resource: str, prefix: str | None = None) -> str | None:
    store = HistoryStore(connect(pipeline.redis_url), prefix or pipeline.prefix)
    try:
        [found] = await WorkingMemories(store, TEMPLATE, "resource").documents([(thread, resource)])
        return found
    finally:
        await store.redis.aclose()


def test_the_model_updates_it_through_the_runners_tool_and_every_thread_of_the_resource_sees_it_until_forget(pipeline, fake_openai):
    run = uuid.uuid4().hex[:6]
    t1, t2, t3, t4 = (f"{n}-{run}" for n in ("t1", "t2", "t3", "t4"))
    on = {"MEMFILTER_WORKING_MEMORY": "resource"}
    worker = pipeline.start_worker(**on)
    pipeline.start_agent(MEMFILTER_AGENT_BACKEND="openai", MEMFILTER_AGENT_BASE_URL=fake_openai.url, OPENAI_API_KEY="sk-test", **on)
    wait_for_line(worker.log_path, "memfilter worker ready", timeout=90)
    t = pipeline.topics
    sent = 0

    async def turn(thread: str, resource: str, text: str, calls: int = 1) -> list[dict]:
        """One request; the model's inputs for it once answered."""
        nonlocal sent
        sent += 1
        before = len(fake_openai.received)
        value = {"threadId": thread, "resourceId": resource, "requestId": f"{thread}-q{sent}", "messages": [user(f"{thread}-u{sent}", text)]}
        await publish(pipeline.bootstrap, t.requests, [(thread.encode(), json.dumps(value).encode(), None)])
        await until(lambda: len(fake_openai.received) >= before + calls)
        records = await read(
            pipeline.bootstrap, [t.persist], until=lambda recs: any(json.loads(r.value)["requestId"] == f"{thread}-q{sent}/reply" for r in recs)
        )
        reply = next(json.loads(r.value) for r in records if json.loads(r.value)["requestId"] == f"{thread}-q{sent}/reply")
        return [*fake_openai.received[before:], reply]

    async def go():
        told = await turn(t1, "r1", f"call updateWorkingMemory {json.dumps({'memory': SAM})}", calls=2)
        # 16,025 bytes as the model writes them, 52,022 as an event carries them: refused to the model
        big = await turn(t1, "r1", 'call updateWorkingMemory {"memory": "Bob", "n": [' + ",".join(["1E9"] * 4000) + "]}", calls=2)
        seen = await turn(t2, "r1", "what is my name")
        theirs = await turn(t3, "r2", "hello")
        return told, big, seen, theirs, await document(pipeline, t1, "r1")

    (first, second, reply), (_, _, big), (seen, _), (theirs, _), stored = asyncio.run(go())
    # the runner offered the tool, answered the call itself, and called the model again with the answer
    assert any(tool["function"]["name"] == "updateWorkingMemory" for tool in first["tools"])
    assert first["messages"][0] == {"role": "system", "content": instruction(TEMPLATE, None)}
    assert second["messages"][-1] == {"role": "tool", "tool_call_id": second["messages"][-2]["tool_calls"][0]["id"], "content": '{"success": true}'}
    # one event saves the reply (its tool call answered, then the model's text) and the update
    parts = reply["messages"][0]["content"]["parts"]
    assert [p["type"] for p in parts if p["type"] in ("tool-invocation", "text")] == ["tool-invocation", "text"]
    assert parts[[p["type"] for p in parts].index("tool-invocation")]["toolInvocation"]["state"] == "result"
    assert reply["workingMemory"] == {"calls": [{"memory": SAM}]}
    assert stored == SAM
    # a call over the bound as its event writes it is answered not stored, and the reply is saved
    assert "workingMemory" not in big and "not stored: over 16,384 bytes" in json.dumps(big["messages"])
    saved = big["messages"][0]["id"]
    asyncio.run(until(lambda: saved in pipeline.memfilter("history", "show", t1).stdout, timeout=30))
    # the resource's other thread sees it; another resource never does
    assert seen["messages"][0] == {"role": "system", "content": instruction(TEMPLATE, SAM)}
    assert theirs["messages"][0] == {"role": "system", "content": instruction(TEMPLATE, None)}

    # a rebuild from the log makes the same document; a replay decides every request as it was
    rebuilt = f"{pipeline.prefix}-rebuilt"
    done = pipeline.memfilter("history", "rebuild", "--prefix", rebuilt, **on)
    assert done.returncode == 0, done.stderr
    assert asyncio.run(document(pipeline, t1, "r1", rebuilt)) == SAM
    replayed = pipeline.memfilter("replay", "--strict", **on)
    assert replayed.returncode == 0 and " 0 different" in replayed.stdout, replayed.stdout + replayed.stderr

    # forget: the resource's threads erased, and its document with them
    erased = pipeline.memfilter("forget", "--resource", "r1")
    assert erased.returncode == 0, erased.stderr
    assert asyncio.run(document(pipeline, t1, "r1")) is None
    after = asyncio.run(turn(t4, "r1", "hello again"))
    assert after[0]["messages"][0] == {"role": "system", "content": instruction(TEMPLATE, None)}


def test_an_import_of_mastras_storage_brings_the_resources_document_in(pipeline, tmp_path):
    run = uuid.uuid4().hex[:6]
    thread, resource = f"old-{run}", f"imported-{run}"
    on = {"MEMFILTER_WORKING_MEMORY": "resource"}
    worker = pipeline.start_worker(**on)
    wait_for_line(worker.log_path, "memfilter worker ready", timeout=90)
    mastra = {
        "threads": [{"id": thread, "resourceId": resource, "title": "old", "messages": [stored(f"{thread}-u0", "hi")]}],
        "workingMemory": {resource: SAM},
    }
    done = subprocess.run(["node", "export.mjs"], cwd=NODE, input=json.dumps(mastra).encode(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    export = tmp_path / "mastra.jsonl"
    export.write_text("\n".join(json.dumps(row) for row in json.loads(done.stdout)["mastra"]))
    imported = pipeline.memfilter("history", "import", str(export), **on)
    assert imported.returncode == 0 and "imported 1 thread" in imported.stdout, imported.stdout + imported.stderr
    assert asyncio.run(document(pipeline, thread, resource)) == SAM

    async def ask() -> dict:
        value = {"threadId": f"new-{run}", "resourceId": resource, "requestId": f"new-{run}-q", "messages": [user(f"new-{run}-u", "who am I?")]}
        await publish(pipeline.bootstrap, pipeline.topics.requests, [(f"new-{run}".encode(), json.dumps(value).encode(), None)])
        [record] = await read(pipeline.bootstrap, [pipeline.topics.filtered], until=lambda recs: len(recs) >= 1)
        return json.loads(record.value)

    assert asyncio.run(ask())["workingMemory"] == SAM

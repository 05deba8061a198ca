"""Semantic recall end to end: a worker, the sink, `memfilter embedder` and the agent runner
on a real Kafka, Redis and PostgreSQL, with a deterministic embeddings endpoint (texts that
share words are near: `fake_openai.embedding`), so the test knows which message must be
recalled; and a gateway, driven by the AI SDK's own client (`tests/node/recall.test.mjs`).

What was said long out of the window is in the model's input again: from the same thread in
its place, from another thread of the resource as Mastra's remembered system message. Never
another resource's message, nor an erased thread's; a text the endpoint refuses costs that
message alone; the reply's metadata says what was recalled, with scores.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import asyncpg
import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from fake_openai import FakeOpenAI
from pipeline import Pipeline, local_get, node_test, publish, read, wait_for_line

from memfilter.runtime.sink import applied
from memfilter.settings import Gateway

WINDOW = 4  # MEMFILTER_HISTORY_MESSAGES: the planted message leaves the context by the third turn


@pytest.fixture
def fake_openai():
    fake = FakeOpenAI()
    yield fake
    fake.close()


def user(mid: str, text: str) -> dict:
    return {"id": mid, "role": "user", "parts": [{"type": "text", "text": text}]}


async def saved_reply(pipeline: Pipeline, request_id: str) -> dict:
    """The agent's reply to a request, as it saved it on persist-messages."""

    def reply(record) -> dict | None:
        try:
            value = json.loads(record.value)
        except ValueError:  # the test's hostile records
            return None
        return value["messages"][0] if value["requestId"] == f"{request_id}/reply" else None

    records = await read(pipeline.bootstrap, [pipeline.topics.persist], until=lambda recs: any(reply(r) for r in recs))
    return next(found for r in records if (found := reply(r)))


async def vectors_of(pipeline: Pipeline) -> dict[str, str]:
    """message id -> the resource its vector is kept under."""
    conn = await asyncpg.connect(pipeline.postgres_url)
    try:
        return {r["message_id"]: r["resourceId"] for r in await conn.fetch(f'SELECT message_id, "resourceId" FROM "{pipeline.prefix}".message_vectors')}
    except asyncpg.UndefinedTableError:
        return {}
    finally:
        await conn.close()


async def until(check, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while not (result := await check()):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.3)
    return result


def test_a_message_out_of_the_window_is_recalled_from_its_thread_and_the_resources_others_imported_ones_too_never_another_resources_nor_an_erased_one(
    pipeline, fake_openai, tmp_path
):
    run = uuid.uuid4().hex[:6]
    a, b, d, other, imported = f"a-{run}", f"b-{run}", f"d-{run}", f"o-{run}", f"i-{run}"
    recall_env = {"MEMFILTER_EMBEDDINGS_BASE_URL": fake_openai.url, "MEMFILTER_EMBEDDINGS_MODEL": "fake-embed", "OPENAI_API_KEY": "sk-test"}
    pipeline.start_worker(MEMFILTER_HISTORY_MESSAGES=str(WINDOW))
    pipeline.start_sink()
    embedder = pipeline.start_embedder(**recall_env)
    pipeline.start_agent(
        MEMFILTER_AGENT_BACKEND="openai",
        MEMFILTER_AGENT_BASE_URL=fake_openai.url,
        MEMFILTER_AGENT_MODEL="m-1",
        MEMFILTER_RECALL="resource",
        MEMFILTER_RECALL_THRESHOLD="0.2",
        **recall_env,
    )
    t = pipeline.topics
    sent = 0

    async def turn(thread: str, resource: str, mid: str, text: str) -> str:
        """One request, and its reply saved; the request's id."""
        nonlocal sent
        sent += 1
        rid = f"{mid}-q"
        value = {"threadId": thread, "resourceId": resource, "requestId": rid, "messages": [user(mid, text)]}
        await publish(pipeline.bootstrap, t.requests, [(thread.encode(), json.dumps(value).encode(), None)])
        await until(lambda: _answered(fake_openai, sent))
        return rid

    async def go():
        hostile = [  # on persist-messages, as any writer may publish: refused by the workers, and no stop to the embedder
            b"not json",
            json.dumps({"requestId": "h1", "threadId": "nul\u0000thread", "resourceId": "r1", "messages": []}).encode(),
            json.dumps({"requestId": "h2", "threadId": a, "resourceId": "r1", "messages": [{**user("nul\u0000id", "x"), "threadId": a}]}).encode(),
            json.dumps({"requestId": "h3", "threadId": a, "resourceId": "r2", "messages": [user(f"{a}-planted", "my cat is called rex")]}).encode(),
        ]
        await publish(pipeline.bootstrap, t.persist, [(a.encode(), value, None) for value in hostile])
        await turn(a, "r1", f"{a}-u0", "my cat is called whiskers")
        await turn(b, "r1", f"{b}-u0", "my cat is called tom")
        await turn(other, "r2", f"{other}-u0", "my cat is called felix")
        await turn(a, "r1", f"{a}-u1", "an unembeddable text")
        for n in range(2, 5):  # whiskers leaves thread a's window
            await turn(a, "r1", f"{a}-u{n}", f"tell me about weather number {n}")
        assert pipeline.memfilter("forget", "--thread", b).returncode == 0
        export = tmp_path / "export.jsonl"
        export.write_text(json.dumps({"threadId": imported, "resourceId": "r1", "messages": [user(f"{imported}-u0", "an old thread brought in")]}))
        assert pipeline.memfilter("history", "import", str(export)).returncode == 0
        await until(lambda: _has(vectors_of(pipeline), f"{a}-u4"))  # embedded as far as the last turn
        await until(lambda: _has(vectors_of(pipeline), f"{imported}-u0"))  # an imported thread like any
        await until(lambda: _lacks(vectors_of(pipeline), f"{b}-u0"))  # the erasure took its vectors out

        asked = len(fake_openai.received)
        own = await turn(a, "r1", f"{a}-u5", "what is my cat called")
        own_input = fake_openai.received[asked]["messages"]
        asked = len(fake_openai.received)
        elsewhere = await turn(d, "r1", f"{d}-u0", "what is my cat called")
        other_input = fake_openai.received[asked]["messages"]
        return own, own_input, elsewhere, other_input, await vectors_of(pipeline)

    own, own_input, elsewhere, other_input, vectors = asyncio.run(go())

    # in thread a: its own message, in its place before the context's rows, as the user said it
    assert own_input[0] == {"role": "user", "content": "my cat is called whiskers"}
    assert own_input[-1] == {"role": "user", "content": "what is my cat called"}
    assert not any("tom" in json.dumps(m) or "felix" in json.dumps(m) for m in own_input)
    # in a new thread of r1: Mastra's remembered system message, thread a's message in it
    system = [m["content"] for m in other_input if m["role"] == "system"]
    assert len(system) == 1 and system[0].startswith("The following messages were remembered from a different conversation:")
    assert "my cat is called whiskers" in system[0]
    assert "felix" not in json.dumps(other_input) and "tom" not in json.dumps(other_input)

    # every vector kept under its thread's owner; the erased thread's gone; the refused text has none
    assert vectors[f"{other}-u0"] == "r2" and vectors[f"{a}-u0"] == "r1" and vectors[f"{imported}-u0"] == "r1"
    assert f"{b}-u0" not in vectors and f"{a}-u1" not in vectors and f"{a}-planted" not in vectors
    assert embedder.poll() is None
    assert "memfilter_embedder_refused_total 1.0" in local_get(embedder.web_port, "/metrics")[1]

    # the replies say what was recalled, with scores
    for rid in (own, elsewhere):
        reply = asyncio.run(saved_reply(pipeline, rid))
        recalled = reply["content"]["metadata"]["recall"]
        assert recalled["scope"] == "resource"
        assert recalled["matches"][0]["id"] == f"{a}-u0" and recalled["matches"][0]["threadId"] == a
        assert recalled["matches"][0]["score"] > 0.5
        assert f"{a}-u0" in recalled["messages"]


async def _answered(fake: FakeOpenAI, n: int) -> bool:
    return len(fake.received) >= n


async def _has(value, key) -> bool:
    return key in await value


async def _lacks(value, key) -> bool:
    return key not in await value


def test_through_the_gateway_a_fact_from_turn_2_is_in_the_models_input_at_turn_60_by_working_memory_and_by_recall(pipeline, fake_openai):
    recall_env = {"MEMFILTER_EMBEDDINGS_BASE_URL": fake_openai.url, "MEMFILTER_EMBEDDINGS_MODEL": "fake-embed", "OPENAI_API_KEY": "sk-test"}
    memory = {"MEMFILTER_WORKING_MEMORY": "resource"}
    worker = pipeline.start_worker(MEMFILTER_HISTORY_MESSAGES="10", **memory)
    pipeline.start_sink()
    pipeline.start_embedder(**recall_env)
    pipeline.start_agent(MEMFILTER_AGENT_BACKEND="openai", MEMFILTER_AGENT_BASE_URL=fake_openai.url, MEMFILTER_RECALL="resource", **recall_env, **memory)
    wait_for_line(worker.log_path, "memfilter worker ready", timeout=90)
    port = pipeline.start_gateway("recall", MEMFILTER_GATEWAY_AUTH="header", MEMFILTER_GATEWAY_CALLER_RATE="100", MEMFILTER_GATEWAY_CALLER_BURST="100")
    result = node_test("recall.test.mjs", GATEWAY_URL=f"http://127.0.0.1:{port}", RESOURCE_HEADER=Gateway().resource_header)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    last = fake_openai.received[-1]["messages"]
    said = [str(m["content"]) for m in last]
    assert said[-1] == "what is my favourite colour"
    # in working memory: the system message's document
    assert last[0]["role"] == "system" and "<working_memory_data>\nmy favourite colour is turquoise\n</working_memory_data>" in said[0]
    # recalled (the window, 10 rows, holds turns 55 to 59 alone; recall adds only what it does not
    # hold: the reply's metadata names the message, recall.test.mjs checks), before the window
    told = next(i for i, m in enumerate(last) if m["role"] == "user" and "turquoise" in str(m["content"]))
    assert told < said.index("tell me something else, number 59")


def test_an_embedder_whose_sink_is_not_running_says_which_group_it_waits_for(pipeline):
    async def go():
        admin = AIOKafkaAdminClient(bootstrap_servers=pipeline.bootstrap)
        await admin.start()
        stop, told = asyncio.Event(), []

        def outage(why: str) -> None:
            told.append(why)
            stop.set()

        try:
            tp = TopicPartition(pipeline.topics.persist, 0)
            await asyncio.wait_for(applied(admin, f"no-sink-{pipeline.name}", {tp: 1}, stop, outage, "memfilter embedder", patience=0.5), 30)
        finally:
            await admin.close()
        return told

    assert asyncio.run(go()) == [
        f"group no-sink-{pipeline.name} has not committed past this batch of {pipeline.topics.persist} for 0.5 s: is it running, under that name?"
    ]

"""`memfilter agent` on the real stack, with the echo model and with the `openai` backend
against the streaming fake OpenAI-compatible server (`tests/fake_openai.py`); its pure core is
tested in tests/unit/test_replies.py."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import msgspec
import pytest
import redis.asyncio as aioredis
from factories import filtered, text
from fake_openai import FakeOpenAI
from pipeline import WORKER_LOGS, Collector, Pipeline, header, publish, read, wait_for_line

from memfilter.client import Client
from memfilter.core.reply_stream import Reply
from memfilter.core.ui import to_stored
from memfilter.store import reads
from memfilter.store.history import HistoryStore


@pytest.fixture
def fake_openai():
    fake = FakeOpenAI()
    yield fake
    fake.close()


def request(thread, request_id, *messages):
    return thread.encode(), json.dumps({"requestId": request_id, "threadId": thread, "resourceId": "r1", "messages": list(messages)}).encode(), None


def test_the_openai_backend_streams_replies_and_saves_what_the_chunks_add_up_to_retries_an_outage_and_dead_letters_a_refusal(services, fake_openai, tmp_path):
    tools = tmp_path / "tools.json"
    weather = {"name": "weather", "description": "the weather in a city", "inputSchema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    tools.write_text(json.dumps([weather]))
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    pipeline.start_worker()
    pipeline.start_agent(
        MEMFILTER_AGENT_BACKEND="openai",
        MEMFILTER_AGENT_BASE_URL=fake_openai.url,
        MEMFILTER_AGENT_MODEL="m-1",
        OPENAI_API_KEY="sk-test",
        MEMFILTER_AGENT_SYSTEM="you are terse",
        MEMFILTER_AGENT_TEMPERATURE="0.2",
        MEMFILTER_AGENT_MAX_OUTPUT_TOKENS="50",
        MEMFILTER_AGENT_TOOLS=str(tools),
    )
    ui_user = lambda mid, words, *more: {"id": mid, "role": "user", "parts": [{"type": "text", "text": words}, *more]}  # noqa: E731
    image = {"type": "file", "mediaType": "image/png", "url": "https://example.com/cat.png"}
    t = pipeline.topics
    asks = {
        "oa-1": [{"role": "system", "parts": [{"type": "text", "text": "be brief"}], "id": "s"}, ui_user("oa-1-u1", "hello")],
        "oa-2": [ui_user("oa-2-u1", "flaky")],
        "oa-3": [ui_user("oa-3-u1", "refuse")],
        "oa-4": [ui_user("oa-4-u1", 'call weather {"city": "Oslo"}')],
        "oa-5": [ui_user("oa-5-u1", "fail")],
        "oa-6": [ui_user("oa-6-u1", "think")],
        "oa-7": [ui_user("oa-7-u1", "what is this", image)],
    }
    try:
        asyncio.run(publish(services.bootstrap, t.requests, [request(thread, f"q-{thread}", *messages) for thread, messages in asks.items()]))
        records = asyncio.run(
            read(
                services.bootstrap,
                [t.persist, t.dlq, t.streams],
                until=lambda rs: (
                    sum(r.topic == t.persist and json.loads(r.value)["requestId"].endswith("/reply") for r in rs) >= 7 and any(r.topic == t.dlq for r in rs)
                ),
            )
        )
    finally:
        pipeline.stop_all()
    ended = {r.key.decode(): json.loads(r.value)["messages"] for r in records if r.topic == t.persist and json.loads(r.value)["requestId"].endswith("/reply")}
    assert ended["oa-3"] == []  # refused: no reply is saved, and the thread is no longer waiting for one (docs/delivery.md)
    saved = {thread: messages[0] for thread, messages in ended.items() if messages}
    parts = {thread: message["content"]["parts"] for thread, message in saved.items()}
    metadata = {thread: message["content"].get("metadata") for thread, message in saved.items()}
    assert parts["oa-1"][-1] == {"type": "text", "text": "model says 3", "state": "done"}  # the system prompt, the request's own, the user's
    assert metadata["oa-1"] == {"model": "m-1", "finishReason": "stop", "usage": {"inputTokens": 11, "outputTokens": 3, "totalTokens": 14}}
    assert parts["oa-2"][-1]["text"] == "model says 2"  # after its 500
    call = parts["oa-4"][-1]["toolInvocation"]
    assert (call["state"], call["toolName"], call["args"]) == ("call", "weather", {"city": "Oslo"}) and metadata["oa-4"]["finishReason"] == "tool-calls"
    assert parts["oa-5"][-1]["text"] == "half way " and metadata["oa-5"]["finishReason"] == "error"  # failed midway: what was made, marked
    assert [p["type"] for p in parts["oa-6"]] == ["step-start", "reasoning", "text"] and parts["oa-6"][1]["reasoning"] == "let me see"
    [dead] = [r for r in records if r.topic == t.dlq]
    assert (dead.key, header(dead, "error.type"), header(dead, "source.topic")) == (b"oa-3", "model", t.filtered)
    assert "HTTP 400" in header(dead, "error.message")
    # What the endpoint was sent: the system prompt first, the settings, the tools, the image.
    first = next(r for r in fake_openai.received if r["messages"][-1]["content"] == "hello")
    assert (first["path"], first["auth"], first["model"], first["stream"]) == ("/v1/chat/completions", "Bearer sk-test", "m-1", True)
    assert first["messages"] == [
        {"role": "system", "content": "you are terse"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    assert (first["temperature"], first["max_completion_tokens"], first["stream_options"]) == (0.2, 50, {"include_usage": True})
    assert first["tools"] == [
        {"type": "function", "function": {"name": "weather", "description": weather["description"], "parameters": weather["inputSchema"]}}
    ]
    seen = next(r for r in fake_openai.received if r["messages"][-1]["content"][0] == {"type": "text", "text": "what is this"})
    assert seen["messages"][-1]["content"][1] == {"type": "image_url", "image_url": {"url": image["url"]}}
    # The saved reply is what its chunks on the streams topic add up to.
    for thread, message in saved.items():
        chunks = [json.loads(r.value)["chunk"] for r in records if r.topic == t.streams and r.key == thread.encode()]
        assert chunks[0] == {"type": "start", "messageId": message["id"]}
        reply = Reply(message["id"])
        for chunk in chunks:
            reply.add(chunk)
        assert to_stored(reply.ui())["content"] == message["content"], thread


def test_a_record_that_is_not_a_filtered_input_is_dead_lettered_the_next_answered_and_metrics_say_so(services):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    agent = pipeline.start_agent()
    t = pipeline.topics
    good = msgspec.json.encode(filtered([text("u1", "user", "hi")], thread="ok"))
    try:
        asyncio.run(publish(services.bootstrap, t.filtered, [(b"bad", b"{not json", None), (b"ok", good, None)]))
        records = asyncio.run(read(services.bootstrap, [t.persist, t.dlq], until=lambda rs: len(rs) >= 2))
        web = f"http://127.0.0.1:{agent.web_port}"
        ready = urllib.request.urlopen(f"{web}/readyz", timeout=5).read()
        metrics = urllib.request.urlopen(f"{web}/metrics", timeout=5).read().decode()
    finally:
        pipeline.stop_all()
    assert ready == b"ready\n"
    assert 'memfilter_agent_inputs_total{result="answered"} 1.0' in metrics
    assert 'memfilter_agent_inputs_total{result="dead-letter"} 1.0' in metrics
    by_topic = {r.topic: r for r in records}
    assert header(by_topic[t.dlq], "error.type") == "decode" and by_topic[t.dlq].value == b"{not json"
    assert json.loads(by_topic[t.persist].value)["messages"][0]["content"]["parts"][-1]["text"] == "echo: hi"


def test_a_runner_built_on_the_client_consumes_as_a_group_and_its_replies_are_stored(services):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    pipeline.start_worker()

    async def go():
        async with Client(services.bootstrap, pipeline.topics) as client:
            await client.publish(
                [{"requestId": f"c{i}", "threadId": f"own-{i}", "resourceId": "r1", "messages": [text(f"own-{i}-u", "user", f"hi {i}")]} for i in range(2)]
            )
            handled = []
            async for delivery in client.consume("my-agent"):
                answer = text(f"{delivery.event.threadId}-a", "assistant", "hello")
                await client.reply(delivery.event, answer)
                await delivery.commit()
                handled.append(delivery.event.requestId)
                if len(handled) == 1:
                    break  # a member leaves after one: the group resumes after its commit
            async for delivery in client.consume("my-agent"):
                await client.reply(delivery.event, text(f"{delivery.event.threadId}-a", "assistant", "hello"))
                await delivery.commit()
                handled.append(delivery.event.requestId)
                break
        redis = aioredis.from_url(services.redis_url)
        store = HistoryStore(redis, pipeline.prefix)
        for _ in range(100):  # the worker applies the replies
            rows = [[json.loads(r)["id"] for r in await reads.thread_rows(store, f"own-{i}")] for i in range(2)]
            if all(len(r) == 2 for r in rows):
                break
            await asyncio.sleep(0.1)
        await redis.aclose()
        return handled, rows

    try:
        handled, rows = asyncio.run(go())
    finally:
        pipeline.stop_all()
    assert sorted(handled) == ["c0", "c1"]
    assert rows == [["own-0-u", "own-0-a"], ["own-1-u", "own-1-a"]]


def test_a_key_the_model_refuses_is_the_runners_problem_its_inputs_wait_and_are_answered_once_it_is_fixed(services, fake_openai):
    """HTTP 401 is not the input's fault: nothing is dead-lettered, the log names
    OPENAI_API_KEY, /readyz says not ready; once the endpoint takes the key, the input is answered."""
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    pipeline.start_worker()
    fake_openai.refuse_key = True
    agent = pipeline.start_agent(MEMFILTER_AGENT_BACKEND="openai", MEMFILTER_AGENT_BASE_URL=fake_openai.url, OPENAI_API_KEY="sk-wrong")
    t = pipeline.topics
    web = f"http://127.0.0.1:{agent.web_port}"
    try:
        asyncio.run(
            publish(services.bootstrap, t.requests, [request("key-1", "q1", {"id": "key-1-u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]})])
        )
        deadline = time.monotonic() + 60
        while len(fake_openai.received) < 2:  # asked, refused, asked again
            assert time.monotonic() < deadline, "the runner did not ask the model"
            time.sleep(0.2)
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(f"{web}/readyz", timeout=5)
        body = not_ready.value.read().decode()
        fake_openai.refuse_key = False
        records = asyncio.run(
            read(
                services.bootstrap,
                [t.persist, t.dlq],
                until=lambda rs: any(json.loads(r.value)["requestId"].endswith("/reply") for r in rs if r.topic == t.persist),
            )
        )
        ready = urllib.request.urlopen(f"{web}/readyz", timeout=5).read()
        log = (WORKER_LOGS / f"memfilter-test-{pipeline.name}-agent1.log").read_text()
    finally:
        pipeline.stop_all()
    assert not_ready.value.code == 503 and "HTTP 401" in body and "OPENAI_API_KEY" in body
    assert "answers HTTP 401" in log and "check OPENAI_API_KEY" in log
    assert [r for r in records if r.topic == t.dlq] == [] and ready == b"ready\n"


def test_the_openai_backend_without_a_key_refuses_to_start(services):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    result = pipeline.memfilter("agent", "--backend", "openai", OPENAI_API_KEY="", timeout=60)
    assert result.returncode == 2
    assert "MEMFILTER_AGENT_BACKEND=openai needs OPENAI_API_KEY" in result.stderr


def test_a_new_agent_group_starts_after_the_inputs_already_on_the_topic_unless_told_otherwise(services):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    t = pipeline.topics
    # One thread: its inputs, and the replies to them, are in one partition each, in order; so
    # the first reply is the old input's if the runner answered it.
    old = msgspec.json.encode(filtered([text("u1", "user", "old")], request_id="old", thread="t"))
    new = msgspec.json.encode(filtered([text("u2", "user", "new")], request_id="new", thread="t"))
    try:
        asyncio.run(publish(services.bootstrap, t.filtered, [(b"t", old, None)]))
        pipeline.start_agent(MEMFILTER_AGENT_START="latest")
        log = WORKER_LOGS / f"memfilter-test-{pipeline.name}-agent0.log"
        wait_for_line(log, "memfilter agent ready")
        assert f"no committed offset for {t.filtered}-0, " in log.read_text()  # said, partition by partition: where it starts
        asyncio.run(publish(services.bootstrap, t.filtered, [(b"t", new, None)]))
        [first, *_] = asyncio.run(read(services.bootstrap, [t.persist], until=lambda rs: len(rs) >= 1))
    finally:
        pipeline.stop_all()
    assert json.loads(first.value)["requestId"] == "new/reply"


def test_an_agent_killed_mid_reply_loses_no_turn_and_its_next_owner_answers_it_once_from_a_new_start(services, fake_openai):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    pipeline.start_worker()
    openai = {"MEMFILTER_AGENT_BACKEND": "openai", "MEMFILTER_AGENT_BASE_URL": fake_openai.url, "OPENAI_API_KEY": "sk-test"}
    openai["MEMFILTER_SESSION_TIMEOUT"] = "3"  # the group gives the killed runner's partitions on sooner
    first = pipeline.start_agent(**openai)
    t = pipeline.topics
    texts = lambda rs: [json.loads(r.value)["chunk"] for r in rs if r.topic == t.streams]  # noqa: E731

    async def go():
        await publish(
            services.bootstrap, t.requests, [request("kill-1", "q-kill", {"id": "kill-1-u", "role": "user", "parts": [{"type": "text", "text": "slow 20"}]})]
        )
        await read(services.bootstrap, [t.streams], until=lambda rs: sum(c["type"] == "text-delta" for c in texts(rs)) >= 3)
        pipeline.kill(first)  # mid-reply: its chunks are out, its transaction is not
        pipeline.start_agent(**openai)
        async with Collector(services.bootstrap, [t.persist], isolation_level="read_committed") as saved:
            assert await saved.wait_for(lambda rs: any(json.loads(r.value)["requestId"] == "q-kill/reply" for r in rs), timeout=120)
            await asyncio.sleep(1)  # a second reply, were there one, would be here by now
            replies_ = [json.loads(r.value) for r in saved.records if json.loads(r.value)["requestId"] == "q-kill/reply"]
        streamed = await read(services.bootstrap, [t.streams], until=lambda rs: [c["type"] for c in texts(rs)].count("finish") >= 1)
        redis, store = pipeline.store()
        rows = [json.loads(r) for r in await reads.thread_rows(store, "kill-1")]
        await redis.aclose()
        return replies_, streamed, rows

    try:
        replies_, streamed, rows = asyncio.run(go())
    finally:
        pipeline.stop_all()
    [reply] = replies_  # answered once
    full = "".join(f"t{i} " for i in range(20))
    assert reply["messages"][0]["content"]["parts"][-1]["text"] == full
    attempts = [json.loads(r.value)["attempt"] for r in streamed if r.topic == t.streams]
    assert len(set(attempts)) == 2  # the killed runner's, cut off, and the next owner's, whole from its start
    second = [json.loads(r.value)["chunk"] for r in streamed if json.loads(r.value)["attempt"] == attempts[-1]]
    assert second[0]["type"] == "start" and second[-1]["type"] == "finish"
    assert [r["role"] for r in rows] == ["user", "assistant"] and rows[1]["content"]["parts"][-1]["text"] == full

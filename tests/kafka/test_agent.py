"""The reference agent runner: its pure core (`streams/replies.py`) and `memfilter agent` on the
real stack, with the echo model and with the `openai` backend against a small
OpenAI-compatible server started here on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
import redis.asyncio as aioredis
from factories import SECRET
from pipeline import WORKER_LOGS, Pipeline, free_port, header, publish, read, wait_for_line

from memfilter.client import Client
from memfilter.core import replies
from memfilter.schemas.wire import FilteredInput, Source
from memfilter.store.history import HistoryStore


def text(mid, role, words, **extra):
    return {"id": mid, "role": role, "content": {"format": 2, "parts": [{"type": "text", "text": words}]}, **extra}


def tool(mid, state, **inv):
    return {
        "id": mid,
        "role": "assistant",
        "content": {
            "format": 2,
            "parts": [
                {"type": "step-start"},
                {"type": "tool-invocation", "toolInvocation": {"state": state, "toolCallId": "c1", "toolName": "lookup", "args": {"q": 1}, **inv}},
            ],
        },
    }


def filtered(context, request_id="q1", thread="t1"):
    return FilteredInput(request_id, thread, "r1", "user-tail", [], context, [], Source("chat-requests", 0, 0), 0)


class TestWhenTheModelIsAsked:
    def test_a_context_ending_with_the_users_message_is_answered(self):
        assert replies.wants_reply([text("u1", "user", "hi")])

    def test_a_context_ending_with_an_answer_or_a_pending_call_is_not(self):
        assert not replies.wants_reply([text("u1", "user", "hi"), text("a1", "assistant", "hello")])
        assert not replies.wants_reply([text("u1", "user", "hi"), tool("a1", "call")])
        assert not replies.wants_reply([])

    def test_a_tool_call_the_client_has_just_answered_is_answered(self):
        for state, extra in (("result", {"result": 1}), ("output-error", {"errorText": "x"}), ("output-denied", {})):
            assert replies.wants_reply([text("u1", "user", "hi"), tool("a1", state, **extra)])

    def test_system_messages_after_the_conversation_do_not_count(self):
        assert replies.wants_reply([text("u1", "user", "hi"), text(None, "system", "be brief")])


class TestWhatTheModelIsGiven:
    def test_text_tool_calls_and_their_results_map_to_chat_messages(self):
        context = [text(None, "system", "be brief"), text("u1", "user", "find"), tool("a1", "result", result={"n": 2})]
        assert replies.chat_messages(context) == [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "find"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"n": 2}'},
        ]

    def test_a_call_still_pending_is_left_out(self):
        assert replies.chat_messages([text("u1", "user", "find"), tool("a1", "call"), text("u2", "user", "never mind")]) == [
            {"role": "user", "content": "find"},
            {"role": "user", "content": "never mind"},
        ]


class TestTheEchoModel:
    def test_it_echoes_the_last_user_text(self):
        assert replies.echo_reply([text("u1", "user", "hello")], "k")[-1] == {"type": "text", "text": "echo: hello"}

    def test_a_tool_command_makes_a_pending_client_call(self):
        [_, part] = replies.echo_reply([text("u1", "user", '/tool pickSeat {"flight": "TP1"}')], "abc")
        assert part["toolInvocation"] == {"state": "call", "toolCallId": "call_abc", "toolName": "pickSeat", "args": {"flight": "TP1"}}

    def test_a_tool_outcome_is_reported(self):
        [_, part] = replies.echo_reply([text("u1", "user", "x"), tool("a1", "result", result={"seat": "2A"})], "k")
        assert part["text"] == 'lookup returned {"seat": "2A"}'


class TestTheSavedReply:
    def test_a_redelivered_input_saves_the_same_reply(self):
        event = filtered([text("u1", "user", "hi", createdAt="2026-03-01T10:00:00.000Z")])
        once = replies.reply_event(event, replies.reply_message(event, [{"type": "text", "text": "a"}], 5, SECRET))
        again = replies.reply_event(event, replies.reply_message(event, [{"type": "text", "text": "a"}], 5, SECRET))
        assert once == again

    def test_its_id_is_the_requests_own_and_unknowable_without_the_secret(self):
        event = filtered([])
        assert replies.reply_id(event, SECRET) != replies.reply_id(filtered([], request_id="q2"), SECRET)
        assert replies.reply_id(event, SECRET) != replies.reply_id(event, b"another-deployment-secret")

    def test_it_follows_everything_in_the_context(self):
        event = filtered([text("u1", "user", "hi", createdAt="2026-03-01T10:00:00.000Z")])
        assert replies.reply_message(event, [], 0, SECRET)["createdAt"] == "2026-03-01T10:00:00.001Z"

    def test_the_event_saves_it_in_the_inputs_thread_for_its_resource(self):
        event = json.loads(replies.reply_event(filtered([], thread="t9"), {"id": "m", "role": "assistant", "content": {"format": 2, "parts": []}}))
        assert (event["requestId"], event["threadId"], event["resourceId"]) == ("q1/reply", "t9", "r1")
        assert (event["messages"][0]["threadId"], event["messages"][0]["resourceId"]) == ("t9", "r1")


class FakeOpenAI:
    """An OpenAI-compatible chat-completions endpoint on loopback: answers with the text
    "model says N" (N the number of messages it got); a first request whose last message says
    "flaky" gets a 500, one that says "refuse" a 400. Keeps what it was sent."""

    def __init__(self):
        self.received: list[dict] = []
        self.refuse_key = False  # answer 401, as for a wrong key, while set
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.received.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                last = body["messages"][-1].get("content") or ""
                if fake.refuse_key:
                    return self.answer(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}})
                if "refuse" in last:
                    return self.answer(400, {"error": {"message": "context too long", "type": "invalid_request_error"}})
                if "flaky" in last and sum("flaky" in (r["messages"][-1].get("content") or "") for r in fake.received) == 1:
                    return self.answer(500, {"error": {"message": "overloaded", "type": "server_error"}})
                return self.answer(
                    200,
                    {
                        "id": "chatcmpl-1",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": f"model says {len(body['messages'])}"}}],
                    },
                )

            def answer(self, status, value):
                raw = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture
def fake_openai():
    fake = FakeOpenAI()
    yield fake
    fake.server.shutdown()


def request(thread, request_id, *messages):
    return thread.encode(), json.dumps({"requestId": request_id, "threadId": thread, "resourceId": "r1", "messages": list(messages)}).encode(), None


def test_the_openai_backend_answers_with_the_endpoints_reply_retries_an_outage_and_dead_letters_a_refusal(services, fake_openai):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    pipeline.start_worker()
    pipeline.start_agent(MEMFILTER_AGENT_BACKEND="openai", MEMFILTER_AGENT_BASE_URL=fake_openai.url, MEMFILTER_AGENT_MODEL="m-1", OPENAI_API_KEY="sk-test")
    ui_user = lambda mid, words: {"id": mid, "role": "user", "parts": [{"type": "text", "text": words}]}  # noqa: E731
    t = pipeline.topics
    try:
        asyncio.run(
            publish(
                services.bootstrap,
                t.requests,
                [
                    request("oa-1", "q1", {"role": "system", "parts": [{"type": "text", "text": "be brief"}], "id": "s"}, ui_user("oa-1-u1", "hello")),
                    request("oa-2", "q2", ui_user("oa-2-u1", "flaky")),
                    request("oa-3", "q3", ui_user("oa-3-u1", "refuse")),
                ],
            )
        )
        records = asyncio.run(
            read(
                services.bootstrap,
                [t.persist, t.dlq],
                until=lambda rs: sum(r.topic == t.dlq or json.loads(r.value)["requestId"].endswith("/reply") for r in rs) >= 3,
            )
        )
    finally:
        pipeline.stop_all()
    saved = {r.key.decode(): json.loads(r.value) for r in records if r.topic == t.persist and json.loads(r.value)["requestId"].endswith("/reply")}
    assert saved["oa-1"]["messages"][0]["content"]["parts"][-1] == {"type": "text", "text": "model says 2"}
    assert saved["oa-2"]["messages"][0]["content"]["parts"][-1]["text"] == "model says 1"  # after its 500
    [dead] = [r for r in records if r.topic == t.dlq]
    assert (dead.key, header(dead, "error.type"), header(dead, "source.topic")) == (b"oa-3", "model", t.filtered)
    assert "HTTP 400" in header(dead, "error.message")
    first = next(r for r in fake_openai.received if r["messages"][-1]["content"] == "hello")
    assert (first["path"], first["auth"], first["model"]) == ("/v1/chat/completions", "Bearer sk-test", "m-1")
    assert first["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


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
            rows = [[json.loads(r)["id"] for r in await store.thread_rows(f"own-{i}")] for i in range(2)]
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
        wait_for_line(WORKER_LOGS / f"memfilter-test-{pipeline.name}-agent0.log", "memfilter agent ready")
        asyncio.run(publish(services.bootstrap, t.filtered, [(b"t", new, None)]))
        [first, *_] = asyncio.run(read(services.bootstrap, [t.persist], until=lambda rs: len(rs) >= 1))
    finally:
        pipeline.stop_all()
    assert json.loads(first.value)["requestId"] == "new/reply"

"""`memfilter gateway` driven by the AI SDK's own client and by a browser, on the real stack (a
worker and the echo agent runner behind it):

- `tests/node/gateway.test.mjs` runs the `ai` package (`AbstractChat`, the logic of `useChat`,
  over `DefaultChatTransport`) against a gateway with JWT identity: an answer with the stored
  id and the stored conversation on reload, a client tool round trip, regenerate and edit, a
  rejection for each reason code, a retry with the same `Idempotency-Key`, two users on one
  thread, missing, forged and expired tokens, an empty stream for a request that asks for no
  answer, one conversation over two gateways, and, on a gateway no worker answers, a timeout
  that says what it waited for and a request past the in-flight bound refused;
- `tests/node/streaming.test.mjs` runs it against gateways whose agent runner streams from the
  fake OpenAI endpoint (`tests/fake_openai.py`): tokens shown before the reply is saved, the
  client's copy equal to the stored one, a dropped connection resumed on another gateway, a
  stop that saves what was made and a next turn that sees it, a second tab's message refused
  `busy-thread` while the first's reply streams (the request asks for `concurrentTurns:
  reject`) and taken after it, waiting for it (`enqueue`) or stopping it (`interrupt`), and a tool call, its client output and the model's
  continuation as one stored message, as the client keeps it;
- `tests/node/page.test.mjs` opens the gateway's chat page in Debian's Chromium (puppeteer-core)
  on a gateway with header identity, as `deploy/run-local.sh` runs it: a typed message gets the
  answer and a reload shows the stored history; its screenshot is kept at SCREENSHOT;
- `tests/node/page-turns.test.mjs` opens two tabs of it on the slow model's gateways, the second
  sending while the first's reply streams: shown waiting then answered after it (`enqueue`),
  the first's reply shown interrupted (`interrupt`), refused with the reason (`reject`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import shutil
import signal
import time
import urllib.error
import urllib.request

import aiohttp
import jwt
import msgspec
import pytest
import redis.asyncio as aioredis
from fake_openai import FakeOpenAI
from pipeline import WORKER_LOGS, node_test, publish, wait_for_line

from memfilter.client import Client
from memfilter.core import origin
from memfilter.gateway import shards
from memfilter.gateway.outcomes import Outcomes
from memfilter.runtime.loop import key_hash
from memfilter.schemas.wire import ReplyChunk
from memfilter.store.history import HistoryStore

pytestmark = pytest.mark.xdist_group("gateway")  # the module's worker, agent and gateways are shared (`--dist loadgroup`)

SCREENSHOT = WORKER_LOGS / "memfilter-test-chat-page.png"
JWT_KEY = secrets.token_hex(32)


@pytest.fixture(scope="module")
def model_agent(tmp_path_factory):
    """The `openai` agent runner's settings: the fake endpoint (`tests/fake_openai.py`: slow
    tokens, tool calls) and a tools file."""
    fake = FakeOpenAI()
    tools = tmp_path_factory.mktemp("tools") / "tools.json"
    tools.write_text(json.dumps([{"name": "weather", "description": "the weather in a city", "inputSchema": {"type": "object"}}]))
    yield {
        "MEMFILTER_AGENT_BACKEND": "openai",
        "MEMFILTER_AGENT_BASE_URL": fake.url,
        "MEMFILTER_AGENT_MODEL": "m",
        "OPENAI_API_KEY": "sk-test",
        "MEMFILTER_AGENT_TOOLS": str(tools),
    }
    fake.close()


@pytest.fixture(scope="module")
def gateways(pipelines, model_agent):
    """A worker, the echo agent and three gateways on a pipeline of the module's own (two with
    JWT identity, one with header identity); a worker, an `openai` agent on the fake endpoint
    (`tests/fake_openai.py`: slow tokens, tool calls) and two JWT gateways on another; and a
    JWT gateway on topics no worker reads, that waits 5 s for a decision and lets one request
    wait at once: their ports, by name."""
    pipeline, model, unserved = pipelines["echo"], pipelines["model"], pipelines["unserved"]
    workers = [pipeline.start_worker(), model.start_worker()]
    pipeline.start_agent()
    model.start_agent(**model_agent)
    # each test user sends dozens of requests a second, past a person's share (tests/kafka/test_gateway_limits.py tests the limits)
    reply = {"MEMFILTER_GATEWAY_REPLY_S": "30", "MEMFILTER_GATEWAY_CALLER_RATE": "1000", "MEMFILTER_GATEWAY_CALLER_BURST": "10000"}
    jwt = {"MEMFILTER_GATEWAY_AUTH": "jwt", "MEMFILTER_GATEWAY_JWT_KEY": JWT_KEY}
    for worker in workers:  # the topics are in the brokers' metadata by then: a broker just started takes seconds
        wait_for_line(worker.log_path, "memfilter worker ready", timeout=60)
    with concurrent.futures.ThreadPoolExecutor(6) as starting:  # all at once
        started = {
            "jwt": starting.submit(pipeline.start_gateway, "jwt", shared=True, **jwt, **reply),
            "jwt-2": starting.submit(pipeline.start_gateway, "jwt-2", shared=True, **jwt, **reply),
            "header": starting.submit(pipeline.start_gateway, "header", MEMFILTER_GATEWAY_AUTH="header", **reply),
            "unserved": starting.submit(unserved.start_gateway, "unserved", **jwt, MEMFILTER_GATEWAY_OUTCOME_S="5", MEMFILTER_GATEWAY_MAX_IN_FLIGHT="1"),
            "model": starting.submit(model.start_gateway, "model", shared=True, **jwt, **reply),
            "model-2": starting.submit(model.start_gateway, "model-2", shared=True, **jwt, **reply),
        }
        yield {name: future.result() for name, future in started.items()}


@pytest.fixture(scope="module")
def pipelines(services):
    """The module's pipelines, by name (`gateways` starts their processes)."""
    made = {name: services.pipeline() for name in ("echo", "model", "unserved")}
    for p in made.values():
        asyncio.run(p.create_topics())
    yield made
    for p in made.values():
        p.stop_all()
        asyncio.run(p.delete_topics())


def test_the_ai_sdks_client_gets_answers_tool_round_trips_regenerations_edits_and_rejections_through_the_gateway(gateways):
    urls = {f"{name.upper().replace('-', '_')}_URL": f"http://127.0.0.1:{port}" for name, port in gateways.items()}
    result = node_test("gateway.test.mjs", GATEWAY_URL=urls["JWT_URL"], JWT_KEY=JWT_KEY, **urls)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    metrics = {name: scrape(port) for name, port in gateways.items()}
    shared = metrics["jwt"] + metrics["jwt-2"]  # a turn's outcome is counted where it is served: on the gateway whose share its thread is in
    for outcome in ("answered", "no-reply", "ownership", "foreign-message-id", "duplicate", "schema", "too-large", "unauthenticated", "forwarded"):
        assert f'memfilter_gateway_requests_total{{outcome="{outcome}"}}' in shared, outcome
    assert 'memfilter_gateway_wait_seconds_count{for="reply"}' in shared
    assert "memfilter_gateway_in_flight 0.0" in metrics["jwt"] and "memfilter_gateway_in_flight 0.0" in metrics["jwt-2"]
    for outcome in ("timeout", "busy"):
        assert f'memfilter_gateway_requests_total{{outcome="{outcome}"}} 1.0' in metrics["unserved"], outcome


def test_the_ai_sdks_client_sees_tokens_as_they_come_resumes_on_another_gateway_stops_and_keeps_one_message_per_turn(gateways):
    urls = {f"{name.upper().replace('-', '_')}_URL": f"http://127.0.0.1:{port}" for name, port in gateways.items()}
    # The resume alone first, counted around it: streaming.test.mjs resumes too (polling for a
    # saved reply's 204 may find it still live on a gateway that has not read its save yet).
    before = [resumed(scrape(gateways[name])) for name in ("model", "model-2")]
    result = node_test("resume.test.mjs", JWT_KEY=JWT_KEY, **urls)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    added = [resumed(scrape(gateways[name])) - n for name, n in zip(("model", "model-2"), before)]
    assert sorted(added) == [0, 1], added  # resumed on the gateway whose share the thread is in (the other forwards it there)
    result = node_test("streaming.test.mjs", JWT_KEY=JWT_KEY, **urls)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert 'memfilter_gateway_requests_total{outcome="stopped"}' in scrape(gateways["model"]) + scrape(gateways["model-2"])


def test_a_gateway_started_while_a_reply_is_being_made_resumes_it_from_its_first_chunk_and_relays_no_forged_chunk(gateways, pipelines):
    """What the AI SDK's resume gets from a gateway that was not running when the reply began:
    it reads `reply-streams` from MEMFILTER_GATEWAY_REPLY_S back, so it replays the same chunks
    the first gateway relayed, from `start`, and follows them to `finish`, also when the reply
    was saved before the gateway read `persist-messages` (a slow start: its save is then found
    in the thread, by the message id its `start` named). Chunks another writer puts on the
    topic for the same request (a new start, words of its own) are relayed by neither: their
    attempt does not verify."""
    user, thread, request_id = (f"late-{secrets.token_hex(4)}" for _ in range(3))
    auth = {"Authorization": f"Bearer {jwt.encode({'sub': user, 'exp': int(time.time()) + 600}, JWT_KEY, algorithm='HS256')}"}
    model = pipelines["model"]
    forged = [
        msgspec.json.encode(ReplyChunk(request_id, thread, user, "forged.0", chunk))
        for chunk in ({"type": "start", "messageId": "x"}, {"type": "text-start", "id": "f"}, {"type": "text-delta", "id": "f", "delta": "FORGED"})
    ]

    async def go():
        async with aiohttp.ClientSession() as http:
            body = {"id": thread, "messages": [{"id": f"{thread}-u", "role": "user", "parts": [{"type": "text", "text": "slow 40"}]}]}
            posted = await http.post(f"http://127.0.0.1:{gateways['model']}/api/chat", json=body, headers={**auth, "Idempotency-Key": request_id})
            relayed = [await _chunk(posted)]
            while relayed[-1]["type"] != "text-delta":  # the reply has begun
                relayed.append(await _chunk(posted))
            await publish(model.bootstrap, model.topics.streams, [(thread.encode(), value, None) for value in forged])
            late = await asyncio.to_thread(pipelines["model"].start_gateway, "late", MEMFILTER_GATEWAY_AUTH="jwt", MEMFILTER_GATEWAY_JWT_KEY=JWT_KEY)
            resumed = await http.get(f"http://127.0.0.1:{late}/api/chat/{thread}/stream", headers=auth)
            assert resumed.status == 200
            replayed = [await _chunk(resumed)]
            while replayed[-1] is not None:
                replayed.append(await _chunk(resumed))
            while relayed[-1] is not None:
                relayed.append(await _chunk(posted))
            return relayed[:-1], replayed[:-1]

    relayed, replayed = asyncio.run(go())
    assert replayed == relayed  # the same chunks, from the first
    assert replayed[0]["type"] == "start" and replayed[-1]["type"] == "finish"
    assert "".join(c["delta"] for c in replayed if c["type"] == "text-delta") == "".join(f"t{i} " for i in range(40))  # no FORGED


def test_a_gateway_just_started_knows_a_reply_begun_before_it_once_it_says_it_has_caught_up(pipeline):
    """A gateway reads `reply-streams` from MEMFILTER_GATEWAY_REPLY_S back to know the replies
    being made; until it has read up to where the topic ended at its start, a thread with no
    reply known may yet have one. It says when it has (`Outcomes.caught_up`: its readiness,
    and what a resume waits for), and not before: a reply begun before the start, behind a
    few thousand other chunks, is known by then."""
    secret, resource, thread, request_id = b"s" * 32, "r-late", f"late-{secrets.token_hex(4)}", "q-late"

    def chunk(thread: str, request_id: str, c: dict) -> bytes:
        attempt = origin.attempt(secret, request_id, thread, resource, "n0")
        return msgspec.json.encode(ReplyChunk(request_id, thread, resource, attempt, c))

    others = [(f"busy-{i % 50}".encode(), chunk(f"busy-{i % 50}", f"q{i}", {"type": "text-delta", "id": "t", "delta": "x" * 200}), None) for i in range(3000)]
    begun = [(thread.encode(), chunk(thread, request_id, c), None) for c in ({"type": "start"}, {"type": "text-start", "id": "t"})]

    async def go():
        await publish(pipeline.bootstrap, pipeline.topics.streams, [*others, *begun])
        client = aioredis.from_url(pipeline.redis_url)
        outcomes = Outcomes(pipeline.bootstrap, pipeline.topics, 60, secret, HistoryStore(client, pipeline.name))
        try:
            async with Client(pipeline.bootstrap, pipeline.topics) as kafka:
                await outcomes.start(kafka)
                await asyncio.wait_for(outcomes.caught_up.wait(), 60)
                live = outcomes.live(thread, resource)
                return live.request_id if live is not None else None
        finally:
            await outcomes.stop()
            await client.aclose()

    assert asyncio.run(go()) == request_id


def test_a_body_or_path_no_request_may_carry_is_refused_with_its_reason_and_the_gateway_goes_on(gateways):
    """What a client sends the gateway is held to what the worker holds a record to: JSON nested
    past what a record may be, a lone surrogate, an id that is no id (in the body, in a path, as
    the caller) are each a 4xx naming what is wrong, never a 500; the gateway then answers as before."""
    base = f"http://127.0.0.1:{gateways['header']}"
    ok = {"X-Memfilter-Resource": "hostile-user", "Content-Type": "application/json"}
    message = {"id": "h-u0", "role": "user", "parts": [{"type": "text", "text": "hi"}]}

    async def go() -> list[tuple[int, dict]]:
        async with aiohttp.ClientSession() as http:
            answers = []
            for method, path, data, headers in [
                ("POST", "/api/chat", b'{"id": "h1", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", ok),
                ("POST", "/api/chat", b'{"id": "h\\ud800", "messages": []}', ok),
                ("POST", "/api/chat", json.dumps({"id": "h\u0000x", "messages": [message]}).encode(), ok),
                ("POST", "/api/chat", json.dumps({"id": "h2", "messages": [{**message, "id": "m" * 300}]}).encode(), ok),
                ("POST", "/api/chat", json.dumps({"id": "h3", "messages": [message]}).encode(), {**ok, "X-Memfilter-Resource": "r" * 300}),
                ("GET", "/api/threads/h%00x/messages", None, ok),
                ("GET", f"/api/chat/{'t' * 300}/stream", None, ok),
            ]:
                async with http.request(method, base + path, data=data, headers=headers) as r:
                    answers.append((r.status, await r.json()))
            return answers

    answers = asyncio.run(go())
    assert [(status, body["error"]["code"]) for status, body in answers] == [
        (400, "decode"),
        (400, "decode"),
        (400, "schema"),
        (400, "schema"),
        (401, "unauthenticated"),
        (400, "schema"),
        (400, "schema"),
    ], answers
    messages = [body["error"]["message"] for _, body in answers]
    assert "nests JSON too deeply" in messages[0] and "`threadId` holds the control character U+0000 at 1" in messages[2]
    assert "`messages[0].id` is 300 characters; an id has 256 at most" in messages[3] and "is 300 characters" in messages[4]
    assert "thread id in the path holds the control character U+0000" in messages[5]
    with urllib.request.urlopen(f"{base}/readyz", timeout=5) as ready:
        assert ready.status == 200


def test_a_stopping_gateway_takes_no_new_request_and_cuts_its_streams_saying_so_and_another_resumes_them(gateways, pipelines):
    """SIGTERM: the listener closes at once; the reply being relayed goes on for
    MEMFILTER_SHUTDOWN_S (2 s here) less a second, then its stream ends with an `error` chunk
    that says to resume it elsewhere, and the process exits; another gateway resumes the reply
    from its first chunk to its `finish`."""
    user, thread = f"drain-{secrets.token_hex(4)}", f"drain-{secrets.token_hex(4)}"
    auth = {"Authorization": f"Bearer {jwt.encode({'sub': user, 'exp': int(time.time()) + 600}, JWT_KEY, algorithm='HS256')}"}
    model = pipelines["model"]
    port = model.start_gateway("draining", MEMFILTER_GATEWAY_AUTH="jwt", MEMFILTER_GATEWAY_JWT_KEY=JWT_KEY, MEMFILTER_SHUTDOWN_S="2")
    [process] = [w for w in model.workers if getattr(w, "web_port", None) == port]

    async def go():
        async with aiohttp.ClientSession() as http:
            body = {"id": thread, "messages": [{"id": f"{thread}-u", "role": "user", "parts": [{"type": "text", "text": "slow 40"}]}]}
            posted = await http.post(f"http://127.0.0.1:{port}/api/chat", json=body, headers=auth)
            relayed = [await _chunk(posted)]
            while relayed[-1]["type"] != "text-delta":  # the reply has begun
                relayed.append(await _chunk(posted))
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            try:
                await http.get(f"http://127.0.0.1:{port}/readyz")
                refused = False
            except aiohttp.ClientConnectionError:
                refused = True
            while relayed[-1] is not None:
                relayed.append(await _chunk(posted))
            resumed = await http.get(f"http://127.0.0.1:{gateways['model-2']}/api/chat/{thread}/stream", headers=auth)
            replayed = [await _chunk(resumed)]
            while replayed[-1] is not None:
                replayed.append(await _chunk(resumed))
            return refused, relayed[:-1], replayed[:-1]

    refused, relayed, replayed = asyncio.run(go())
    assert refused  # no new request once stopping
    assert relayed[-1]["type"] == "error" and "this gateway is stopping; the reply goes on: resume it on another" in relayed[-1]["errorText"]
    assert process.wait(10) == 0
    assert replayed[: len(relayed) - 1] == relayed[:-1] and replayed[-1]["type"] == "finish"
    assert "".join(c["delta"] for c in replayed if c["type"] == "text-delta") == "".join(f"t{i} " for i in range(40))


def test_shared_gateways_read_their_share_forward_the_rest_and_take_back_a_lost_ones(gateways, pipelines):
    """Gateways with an address (MEMFILTER_GATEWAY_ADDRESS) share the outcome topics' 8
    partitions (`memfilter.gateway.shards`): each reads its own, and a turn sent to one whose
    share its thread is not in is forwarded to the one it is in and answered there. A third
    joins and takes some of them. Killed (its lease not given back), a turn on its share sent
    before the others know is served where it lands (the owner does not answer); once its lease
    has expired its partitions are the others' again."""
    echo, names = pipelines["echo"], ["jwt", "jwt-2"]
    user = f"shared-{secrets.token_hex(4)}"
    auth = {"Authorization": f"Bearer {jwt.encode({'sub': user, 'exp': int(time.time()) + 600}, JWT_KEY, algorithm='HS256')}"}
    ports = {name: gateways[name] for name in names}

    def gauge(port: int, name: str) -> float:
        return sum(float(line.split()[-1]) for line in scrape(port).splitlines() if line.startswith(f"memfilter_gateway_{name} "))

    def counted(port: int, name: str, before: float) -> float:
        """The counter once it has moved from `before` (within 10 s): a forward is counted once its
        stream is done, and the client stops reading at `[DONE]`, a moment before that."""
        deadline = time.monotonic() + 10
        while (now := gauge(port, name)) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        return now

    def shares_settle(ports: dict[str, int]) -> dict[str, float]:
        deadline = time.monotonic() + 15
        while True:
            read = {name: gauge(port, "partitions") for name, port in ports.items()}
            if sum(read.values()) == 8 and all(read.values()):
                return read
            assert time.monotonic() < deadline, read
            time.sleep(0.2)

    def thread_of(owner: str, ports: dict[str, int]) -> str:
        addresses = sorted(f"http://127.0.0.1:{port}" for port in ports.values())
        owned = shards.owners(8, addresses)
        while True:
            thread = f"shared-{secrets.token_hex(4)}"
            if owned[key_hash(thread.encode()) % 8] == f"http://127.0.0.1:{ports[owner]}":
                return thread

    async def turn(port: int, thread: str) -> tuple[int, list[dict]]:
        async with aiohttp.ClientSession() as http:
            body = {"id": thread, "messages": [{"id": f"{thread}-{secrets.token_hex(2)}", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}
            posted = await http.post(f"http://127.0.0.1:{port}/api/chat", json=body, headers=auth)
            chunks = [await _chunk(posted)] if posted.status == 200 else [None]
            while chunks[-1] is not None:
                chunks.append(await _chunk(posted))
            return posted.status, chunks[:-1]

    shares_settle(ports)
    for front, owner in (("jwt", "jwt-2"), ("jwt-2", "jwt")):
        before = gauge(ports[front], "forwarded_total")
        status, chunks = asyncio.run(turn(ports[front], thread_of(owner, ports)))
        assert status == 200 and chunks[-1]["type"] == "finish", chunks
        assert counted(ports[front], "forwarded_total", before) == before + 1

    third = echo.start_gateway("jwt-3", shared=True, MEMFILTER_GATEWAY_AUTH="jwt", MEMFILTER_GATEWAY_JWT_KEY=JWT_KEY)
    [process] = [w for w in echo.workers if getattr(w, "web_port", None) == third]
    three = ports | {"jwt-3": third}
    shares_settle(three)
    lost = thread_of("jwt-3", three)
    echo.kill(process)
    status, chunks = asyncio.run(turn(ports["jwt"], lost))  # forwarded to a gateway gone: served here
    assert status == 200 and chunks[-1]["type"] == "finish", chunks
    shares_settle(ports)  # its lease expired: its partitions are the others' again
    status, chunks = asyncio.run(turn(ports["jwt-2"], lost))
    assert status == 200 and chunks[-1]["type"] == "finish", chunks


async def _chunk(response) -> dict | None:
    """The next chunk of a UI message stream; None at its `[DONE]`."""
    while True:
        line = (await response.content.readline()).decode().strip()
        if line == "data: [DONE]":
            return None
        if line.startswith("data: "):
            return json.loads(line.removeprefix("data: "))
        assert line or not response.content.at_eof(), "the stream ended without [DONE]"


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def resumed(metrics: str) -> int:
    """How many resumes a gateway's scraped metrics count."""
    line = next((line for line in metrics.splitlines() if line.startswith('memfilter_gateway_requests_total{outcome="resumed"}')), None)
    return 0 if line is None else int(float(line.split()[-1]))


def test_the_chat_page_in_a_browser_answers_a_typed_message_and_shows_the_stored_history_after_a_reload(gateways):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: deploy/test.sh installs it"
    SCREENSHOT.unlink(missing_ok=True)
    result = node_test("page.test.mjs", GATEWAY_URL=f"http://127.0.0.1:{gateways['header']}", CHROMIUM=chromium, SCREENSHOT=str(SCREENSHOT), HOME="/tmp")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert SCREENSHOT.stat().st_size > 10_000


def test_two_tabs_of_the_chat_page_show_a_message_sent_while_a_reply_streams_waiting_interrupting_it_or_refused(gateways):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: deploy/test.sh installs it"
    urls = {name: f"http://127.0.0.1:{gateways[gateway]}" for name, gateway in (("MODEL_URL", "model"), ("MODEL_2_URL", "model-2"))}
    result = node_test("page-turns.test.mjs", **urls, JWT_KEY=JWT_KEY, CHROMIUM=chromium, HOME="/tmp")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


def test_a_reply_whose_runner_dies_ends_its_stream_saying_so_and_the_next_owners_reply_is_resumed_and_saved_once(gateways, pipelines, model_agent):
    """Last in the module: it replaces the `openai` runner. The gateway relaying the first
    attempt cannot take back what the client was shown, so it ends the stream with an error
    saying the reply began again; a resume on another gateway gets the next owner's reply,
    from its start, and it is the one stored, once."""
    model = pipelines["model"]
    [runner] = [p for p in model.workers if "agent" in getattr(p, "log_path", WORKER_LOGS).name and p.poll() is None]
    user, thread, request_id = (f"restart-{secrets.token_hex(4)}" for _ in range(3))
    auth = {"Authorization": f"Bearer {jwt.encode({'sub': user, 'exp': int(time.time()) + 600}, JWT_KEY, algorithm='HS256')}"}

    async def go():
        async with aiohttp.ClientSession() as http:
            body = {"id": thread, "messages": [{"id": f"{thread}-u", "role": "user", "parts": [{"type": "text", "text": "slow 30"}]}]}
            posted = await http.post(f"http://127.0.0.1:{gateways['model']}/api/chat", json=body, headers={**auth, "Idempotency-Key": request_id})
            relayed = [await _chunk(posted)]
            while relayed[-1]["type"] != "text-delta":
                relayed.append(await _chunk(posted))
            model.kill(runner)  # mid-reply
            model.start_agent(**model_agent)
            while relayed[-1] is not None:
                relayed.append(await _chunk(posted))
            resumed = await http.get(f"http://127.0.0.1:{gateways['model-2']}/api/chat/{thread}/stream", headers=auth)
            assert resumed.status == 200
            replayed = [await _chunk(resumed)]
            while replayed[-1] is not None:
                replayed.append(await _chunk(resumed))
            stored = await (await http.get(f"http://127.0.0.1:{gateways['model-2']}/api/threads/{thread}/messages", headers=auth)).json()
            return relayed[:-1], replayed[:-1], stored

    relayed, replayed, stored = asyncio.run(go())
    assert relayed[-1]["type"] == "error" and "began this reply again" in relayed[-1]["errorText"]
    full = "".join(f"t{i} " for i in range(30))
    assert replayed[0]["type"] == "start" and replayed[-1]["type"] == "finish"
    assert "".join(c["delta"] for c in replayed if c["type"] == "text-delta") == full
    assert [m["role"] for m in stored] == ["user", "assistant"] and stored[1]["parts"][-1]["text"] == full

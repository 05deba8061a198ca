"""Every byte a client controls, generated, through the whole pipeline: the gateway and
`chat-requests` in, a worker deciding, the echo agent runner answering, the sink writing to
PostgreSQL and taking idle threads out of Redis (MEMFILTER_IDLE_S=1), each thread loaded back
by its next request; then a rebuild and a replay of the log.

Hypothesis draws what a client sets: thread, resource, message and request ids (any script,
direction marks, astral characters, 256 characters and past it, U+0000 and the other control
characters; a request id of hundreds of characters, which has no length bound), texts (any character but a surrogate: U+0000 and control characters included),
tool names, inputs and outputs, metadata (nested 300 deep, and 10,000), requests at the size
limit and one byte past it, and lone surrogates as JSON escapes. What must happen is the
test's own model, not the product's code: a request whose ids are printable and at most 256
characters (the request id of any length), whose JSON is UTF-8 text nested as deep as a real tool result, and whose size is
within MEMFILTER_MAX_BYTES is stored; any other is refused with a reason (a dead letter, or
the gateway's 4xx, each naming what is wrong). For each stored request: the agent's answer
streams back through the gateway, PostgreSQL holds what was sent, the thread leaves Redis,
and its next request's context holds its rows loaded back from PostgreSQL byte for byte; and
an ordinary thread sent after each odd one reaches PostgreSQL within ORDINARY_S. At the end a
rebuild finishes with the same rows and a replay decides every request as it was decided.

MEMFILTER_PIPELINE_EXAMPLES sets how many examples run (each several requests at once); the
suite runs EXAMPLES, the same ones every run (`derandomize`)."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import aiohttp
import asyncpg
import msgspec
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from pipeline import Collector, header, publish

pytestmark = pytest.mark.xdist_group("every-byte")  # the module's pipeline is shared (`--dist loadgroup`)

EXAMPLES = int(os.environ.get("MEMFILTER_PIPELINE_EXAMPLES", "6"))
AT_ONCE = 4  # requests an example sends together
MAX_BYTES = 65_536  # the worker's MEMFILTER_MAX_BYTES here: requests at the limit stay cheap
ORDINARY_S = 30.0  # an ordinary thread sent after an odd one is in PostgreSQL within this
WAIT_S = 90.0

# ---- what a client can send ----------------------------------------------------------------

CONTROL = [*map(chr, range(32)), "\x7f"]
anything = st.characters(blacklist_categories=("Cs",))  # JSON text carries any character but an unpaired surrogate
printable = st.characters(blacklist_categories=("Cs",), blacklist_characters=CONTROL)
ODD = ["\u202e", "\u200f", "\u0301", "🙂", "𝔘", "\u00a0", "\ufeff", "{", "}", ":", "'", '"', "\\", "%", " ", "/"]


def unique(drawn: str) -> str:
    """A drawn id made the example's own: threads and message ids never meet across examples."""
    return f"{drawn}~{uuid.uuid4().hex[:8]}"


good_ids = st.one_of(
    st.text(printable, min_size=1, max_size=20),
    st.text(st.sampled_from(ODD), min_size=1, max_size=12),
    st.text(printable, min_size=247, max_size=247),  # 256 characters with its suffix: the most an id may have
).map(unique)
bad_ids = st.one_of(
    st.tuples(st.text(printable, max_size=10), st.sampled_from(CONTROL)).map(lambda t: unique(t[0]) + t[1]),
    st.text(printable, min_size=248, max_size=300).map(unique),  # 257 characters or more
    st.just(""),
)
# A request id has no length bound (it keys no PostgreSQL index; a reply's save is `<requestId>/reply`).
long_request_ids = st.text(printable, min_size=300, max_size=600).map(unique)
bad_request_ids = st.one_of(bad_ids.filter(lambda i: i == "" or any(c in CONTROL for c in i)))
texts = st.text(anything, max_size=80)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | texts,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(texts, children, max_size=3),
    max_leaves=10,
)
FLAWS = ["none", "none", "none", "thread", "resource", "message", "request", "surrogate", "deep", "size"]


class Sent(msgspec.Struct):
    """A request as a client sends it, and what the model says must come of it."""

    via: str  # "kafka" (onto chat-requests) or "gateway" (POST /api/chat)
    thread: str
    resource: str
    body: bytes
    refused: bool  # must be refused, with a reason
    texts: list[str]  # its user messages' texts, as they must be stored


@st.composite
def requests(draw) -> Sent:
    via = draw(st.sampled_from(["kafka", "gateway"]))
    flaw = draw(st.sampled_from(FLAWS))
    if via == "gateway" and flaw in ("resource", "request", "size"):  # the caller's identity and the request id are headers; the body is re-encoded
        flaw = "none"
    ids = {name: draw(bad_ids) if flaw == name else draw(good_ids) for name in ("thread", "resource", "message")}
    ids["request"] = draw(bad_request_ids if flaw == "request" else st.one_of(good_ids, long_request_ids))
    if via == "gateway":
        ids["resource"] = unique("user")
    first, last = draw(texts), "say " + draw(texts)  # not `/tool ...`: the echo model would call a tool
    depth = draw(st.sampled_from([300, 10_000])) if flaw == "deep" else 1  # as deep as a real tool result, or far past it
    metadata = {"m": draw(json_values), "deep": "\ue001"}  # a marker, made `depth` nested lists once encoded
    refused = flaw in ("thread", "resource", "message", "request") or depth > 1000
    if flaw == "surrogate":
        first, refused = first + "\ue000", True  # a marker, made a lone surrogate escape once encoded
    call = {"toolCallId": unique("call"), "toolName": draw(texts), "input": draw(json_values), "output": draw(json_values)}

    def body(last: str) -> bytes:
        if via == "kafka":
            invocation = {"toolCallId": call["toolCallId"], "toolName": call["toolName"], "args": call["input"], "result": call["output"], "state": "result"}
            messages = [
                {"id": ids["message"], "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": first}], "metadata": metadata}},
                {"id": unique("a"), "role": "assistant", "content": {"format": 2, "parts": [{"type": "tool-invocation", "toolInvocation": invocation}]}},
                {"id": unique("u"), "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": last}]}},
            ]
            value = {"requestId": ids["request"], "threadId": ids["thread"], "resourceId": ids["resource"], "messages": messages}
        else:
            tool = {"type": "dynamic-tool", "toolName": call["toolName"] or "t", "toolCallId": call["toolCallId"], "state": "output-available"}
            messages = [
                {"id": ids["message"], "role": "user", "parts": [{"type": "text", "text": first}], "metadata": metadata},
                {"id": unique("a"), "role": "assistant", "parts": [{**tool, "input": call["input"], "output": call["output"]}]},
                {"id": unique("u"), "role": "user", "parts": [{"type": "text", "text": last}]},
            ]
            value = {"id": ids["thread"], "messages": messages, "trigger": "submit-message"}
        return json.dumps(value).encode().replace(b"\\ue000", b"\\ud800").replace(b'"\\ue001"', b"[" * depth + b"]" * depth)

    sent = body(last)
    if flaw == "size":  # exactly at the limit, or one byte past it: each `x` is one byte of JSON
        last += "x" * (MAX_BYTES + draw(st.sampled_from([0, 1])) - len(sent))
        sent = body(last)
        refused = len(sent) > MAX_BYTES
    event(f"{via}: {flaw}")
    return Sent(via, ids["thread"], ids["resource"], sent, refused, [first, last])


# ---- the pipeline ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def product(services):
    """A worker, the echo agent runner, the sink (idle threads out of Redis after 1 s) and a
    gateway (identity from a header, as behind a proxy) on a pipeline of the module's own."""
    pipeline = services.pipeline()
    asyncio.run(pipeline.create_topics())
    limits = {"MEMFILTER_MAX_BYTES": str(MAX_BYTES)}
    pipeline.start_sink(MEMFILTER_IDLE_S="1")
    try:
        pipeline.start_answering(**limits)
        yield pipeline, f"http://127.0.0.1:{pipeline.start_gateway('header', MEMFILTER_GATEWAY_AUTH='header', **limits)}"
    finally:
        pipeline.stop_all()
        asyncio.run(pipeline.delete_topics())


STORED: list[str] = []  # threads stored by the examples, for the rebuild's check


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: an example takes seconds; the failure shows the requests whole
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(st.lists(requests(), min_size=AT_ONCE, max_size=AT_ONCE))
def test_every_request_is_stored_byte_for_byte_or_refused_with_its_reason(product, sent):
    asyncio.run(Example(*product, sent).run())


class Example:
    def __init__(self, pipeline, gateway: str, sent: list[Sent]):
        self.pipeline, self.gateway, self.sent = pipeline, gateway, sent
        self.ordinary: dict[str, float] = {}  # an ordinary thread sent after each odd request: when

    async def run(self) -> None:
        p = self.pipeline
        async with Collector(p.bootstrap, [p.topics.filtered, p.topics.dlq]) as seen:
            answers = await asyncio.gather(*(self.send(s) for s in self.sent))
            for s, answer in zip(self.sent, answers):
                await self.decided(s, answer, seen)
            pg = await asyncpg.connect(p.postgres_url)
            try:
                stored = [s for s in self.sent if not s.refused]
                rows = {s.thread: await self.in_postgresql(pg, s) for s in stored}
                for s in stored:
                    await self.loaded_back(pg, s, rows[s.thread], seen)
                for thread, at in self.ordinary.items():
                    await until(
                        lambda thread=thread: held(pg, p.prefix, thread), ORDINARY_S - (time.monotonic() - at), f"ordinary thread {thread} in PostgreSQL"
                    )
            finally:
                await pg.close()
        STORED.extend(s.thread for s in stored)

    async def send(self, s: Sent):
        """Send the request and an ordinary one after it; the gateway's answer (status, body), or None."""
        p, answer = self.pipeline, None
        if s.via == "kafka":
            await publish(p.bootstrap, p.topics.requests, [(s.thread.encode(), s.body, int(time.time() * 1000))])
        else:
            async with aiohttp.ClientSession() as http:
                headers = {"X-Memfilter-Resource": s.resource, "Content-Type": "application/json"}
                async with http.post(f"{self.gateway}/api/chat", data=s.body, headers=headers, timeout=aiohttp.ClientTimeout(total=WAIT_S)) as r:
                    answer = (r.status, await r.read())
        ordinary = f"ordinary-{uuid.uuid4().hex[:10]}"
        body = {
            "threadId": ordinary,
            "resourceId": "ordinary",
            "messages": [{"id": f"{ordinary}-u0", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "hi"}]}}],
        }
        await publish(p.bootstrap, p.topics.requests, [(ordinary.encode(), json.dumps(body).encode(), int(time.time() * 1000))])
        self.ordinary[ordinary] = time.monotonic()
        return answer

    async def decided(self, s: Sent, answer, seen: Collector) -> None:
        """The decision the model says, with its reason, for a request sent either way."""
        p = self.pipeline
        if s.via == "gateway":
            status, body = answer
            if s.refused:
                error = json.loads(body)["error"]
                assert 400 <= status < 500 and error["code"] in ("schema", "decode") and error["message"], (status, body[:300])
            else:
                assert status == 200, (status, body[:500])
                deltas = [c["delta"] for c in chunks(body) if c["type"] == "text-delta"]
                assert "".join(deltas) == "echo: " + s.texts[-1], deltas
            return
        mine = lambda r: r.value == s.body or (r.topic == p.topics.filtered and json.loads(r.value)["threadId"] == s.thread)  # noqa: E731
        assert await seen.wait_for(lambda recs: any(mine(r) for r in recs), WAIT_S), f"no decision on {s.body[:200]!r}"
        [record] = [r for r in seen.records if mine(r)]
        if s.refused:
            assert record.topic == p.topics.dlq and header(record, "error.type") in ("schema", "decode", "too-large"), record.headers
            assert header(record, "error.message"), record.headers
        else:
            assert record.topic == p.topics.filtered, dict((k, v[:300]) for k, v in record.headers)
            assert json.loads(record.value)["outcome"] == "seeded"

    async def in_postgresql(self, pg, s: Sent) -> list:
        """The thread as PostgreSQL holds it, with the agent's answer: what was sent, read back."""
        rows = await until(lambda: held(pg, self.pipeline.prefix, s.thread, 4), WAIT_S, f"thread {s.thread!r} whole in PostgreSQL")
        users = [json.loads(r["row"]) for r in rows if r["role"] == "user"]
        said = [part["text"] for m in users for part in m["content"]["parts"] if part["type"] == "text"]
        assert said == s.texts
        first = json.loads(s.body)["messages"][0]
        assert users[0]["content"]["metadata"] == (first["content"]["metadata"] if s.via == "kafka" else first["metadata"])  # 300 deep at most: json reads it
        reply = json.loads(rows[-1]["row"])
        assert reply["role"] == "assistant" and reply["content"]["parts"][-1]["text"].startswith("echo: say ")
        return rows

    async def loaded_back(self, pg, s: Sent, rows: list, seen: Collector) -> None:
        """Once the thread left Redis, its next request (one more message: a thread at the size
        limit could not be echoed whole) is decided on its rows loaded back from PostgreSQL,
        byte for byte: the context holds them as Redis holds them again."""
        p = self.pipeline
        await until(lambda: out_of_redis(pg, p.prefix, s.thread), WAIT_S, f"thread {s.thread!r} out of Redis")
        request_id = unique("next")
        message = {"id": unique("next"), "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "next"}]}}
        body = {"requestId": request_id, "threadId": s.thread, "resourceId": s.resource, "messages": [message]}
        await publish(p.bootstrap, p.topics.requests, [(s.thread.encode(), json.dumps(body).encode(), int(time.time() * 1000))])
        mine = lambda r: r.topic == p.topics.filtered and json.loads(r.value)["requestId"] == request_id  # noqa: E731
        assert await seen.wait_for(lambda recs: any(mine(r) for r in recs), WAIT_S), f"no decision on the next request of {s.thread!r}"
        [record] = [r for r in seen.records if mine(r)]
        context = msgspec.json.decode(record.value, type=Context).context
        assert [bytes(r) for r in context[: len(rows)]] == [r["row"].encode() for r in rows]  # the rows as Redis holds them once loaded back
        # The request and its answer in PostgreSQL too: the log holds nothing the stored history lacks (the rebuild's check).
        await until(lambda: held(pg, p.prefix, s.thread, len(rows) + 2), WAIT_S, f"the next request of {s.thread!r} and its answer in PostgreSQL")


class Context(msgspec.Struct):
    context: list[msgspec.Raw]


def chunks(body: bytes) -> list[dict]:
    events = [line.removeprefix(b"data: ") for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", body[-300:]
    return [json.loads(e) for e in events[:-1]]


async def held(pg, schema: str, thread: str, at_least: int = 1) -> list | None:
    """The thread's rows in PostgreSQL, in their place's order, once it holds `at_least`."""
    try:
        rows = await pg.fetch(f'SELECT id, role, "row", position FROM "{schema}".mastra_messages WHERE thread_id = $1 ORDER BY position', thread)
    except asyncpg.UndefinedTableError:
        return None
    return rows if len(rows) >= at_least else None


async def out_of_redis(pg, schema: str, thread: str) -> bool:
    return await pg.fetchval(f'SELECT NOT in_redis FROM "{schema}".mastra_threads WHERE id = $1', thread) is True


async def until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := await check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        await asyncio.sleep(0.2)
    return found


def test_a_rebuild_and_a_replay_of_the_log_finish_and_agree_with_what_is_stored(product):
    """After the examples (this module's tests run in order): the log holds every odd request
    and save; a rebuild into another prefix finishes with each stored thread's rows as
    PostgreSQL holds them, and a replay decides every request as it was decided."""
    pipeline, _ = product
    assert STORED, "the examples stored no thread"
    rebuilt = f"{pipeline.prefix}-rebuilt"
    done = pipeline.memfilter("history", "rebuild", "--prefix", rebuilt)
    assert done.returncode == 0 and f"rebuilt history under prefix {rebuilt}" in done.stdout, done.stdout + done.stderr

    async def compare() -> None:
        pg = await asyncpg.connect(pipeline.postgres_url)
        try:
            for thread in STORED:
                live, again = await held(pg, pipeline.prefix, thread), await held(pg, rebuilt, thread)
                assert [r["row"] for r in again] == [r["row"] for r in live], thread
        finally:
            await pg.close()

    asyncio.run(compare())
    replayed = pipeline.memfilter("replay", "--strict", MEMFILTER_MAX_BYTES=str(MAX_BYTES))  # the workers' policy
    assert replayed.returncode == 0 and " 0 different" in replayed.stdout, replayed.stdout[-3000:] + replayed.stderr[-2000:]
    pipeline.memfilter("history", "drop", "--prefix", rebuilt)

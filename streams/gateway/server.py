"""The gateway's routes, on aiohttp: what `useChat` calls, with Kafka, the workers and the agent runner behind.

- `POST /api/chat` takes what the AI SDK's `DefaultChatTransport` sends (`id`, `messages`,
  `trigger`, `messageId`; other body fields are ignored) and publishes it as a ChatRequest for
  the caller's resource (`memfilter.gateway.identity`), with `requestId` from the
  `Idempotency-Key` header when given, else a fresh one. It waits for the worker's decision
  and then, if the request asks for an answer, relays the agent's reply as the runner makes
  it, in the UI message stream protocol (`memfilter.core.ui_stream`): the chunks the runner
  streams on `reply-streams`, as they come, with the stored message id. The stream's `finish`
  is held until the reply is saved and applied to the thread (so a reload right after shows
  it). A reply saved by a runner that does not stream (`Client.reply`) is sent whole once
  saved. A request that asks for no answer (a tool result the model does not need yet) gets an
  empty stream. A rejection is an HTTP error whose JSON body names it: `{"error": {"code",
  "message"}}` (`STATUS` maps each reason code to a status). Every wait is bounded
  (MEMFILTER_GATEWAY_OUTCOME_S, MEMFILTER_GATEWAY_REPLY_S) and a timeout says what it waited
  for (504, or an `error` chunk once the stream has begun); at most
  MEMFILTER_GATEWAY_MAX_IN_FLIGHT requests wait at once (more: 503). A client that
  disconnects does not stop the reply: it is made and saved, and a resume finds it. A request
  that may wait for its turn (MEMFILTER_CONCURRENT_TURNS `enqueue` or `interrupt`, the
  deployment's or its own `concurrentTurns`) is waited for MEMFILTER_TURN_WAIT_S longer, and
  once it has waited WAITING_AFTER_S its stream begins with a transient `data-turn` part
  saying it waits: what comes after (the reply, or a refusal) follows in the same stream.
- `GET /api/chat/{id}/stream` (the AI SDK's `resumeStream`): the reply being made in the
  thread, replayed from its first chunk and followed to its end, from any gateway; 204 when
  none is (what the AI SDK's transport takes for "nothing to resume"). The thread's owner only.
  A gateway first reads the replies begun on the thread's partition before it took it (up to
  RESUME_CATCH_UP_S; 503 `starting` if it has not by then), so that its 204 is never a reply it
  has not read yet.
- `POST /api/chat/{id}/stop`: stops the reply being made in the thread (a StopReply on
  `reply-stops`): the runner ends the model call and saves what was made, finish reason
  `interrupted`. An abort of the fetch cannot be told from a dropped connection, so it stops
  nothing: a client stops with this (the chat page calls it with `chat.stop()`). 202; the
  thread's owner only.
- `GET /api/threads/{id}/messages`: the stored conversation as UI messages (what `useChat`'s
  `messages` should be on page load), for the thread's owner only; `[]` for a thread not
  stored yet.
- `/`: a chat page, the AI SDK's own client bundled (`page/chat.mjs`), for a newcomer to see
  the loop in a browser;
- `/healthz`, `/readyz` (the outcomes reader runs, has read the replies begun before the
  start, and Redis answers), `/metrics`.

Gateways with an address (MEMFILTER_GATEWAY_ADDRESS) share the outcome topics' partitions: a
turn, a resume or a stop for a thread in another's share is forwarded there, once its caller
is identified and within its limits, and the answer streamed back (`memfilter.gateway.shards`).

The caller's resource is the only one a request acts for: a body naming another is refused
(403) before anything is published, and the worker refuses a thread or a message id of
another resource (`ownership`, `foreign-message-id`) without touching it.
"""

from __future__ import annotations

import asyncio
import importlib.resources
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import aiohttp_cors
import msgspec
from aiohttp import web
from aiokafka.errors import KafkaError

from memfilter.client import Client, InvalidRequest
from memfilter.core.filter import Rejected, Rejection, decode_json
from memfilter.core.replies import wants_reply
from memfilter.core.ui import to_ui
from memfilter.core.ui_stream import DONE, HEADERS, chunks, event
from memfilter.gateway.identity import Unauthenticated, resource_of
from memfilter.gateway.limits import Fairness
from memfilter.gateway.outcomes import ENDS, Live, NotTaken, Outcomes, Waiting, stored, stored_row
from memfilter.gateway.shards import FORWARDED, Peers, forward
from memfilter.metrics import GatewayMetrics
from memfilter.runtime.records import MAX_RECORD_BYTES
from memfilter.schemas.wire import TURN_POLICIES, id_problem
from memfilter.settings import Settings
from memfilter.store import reads
from memfilter.store.cold import Warmer
from memfilter.store.history import HistoryStore
from memfilter.store.redis_driver import connect
from memfilter.store.transport import UNAVAILABLE

log = logging.getLogger("memfilter")
PAGE = importlib.resources.files("memfilter.gateway") / "page"  # index.html, and chat.js once built (`npm run build` there)


def cors(resource_header: str) -> aiohttp_cors.ResourceOptions:
    """What a page on an allowed origin (MEMFILTER_GATEWAY_CORS_ORIGINS) may send and read: the
    caller's identity (a bearer token, or the resource header behind a proxy), JSON, an
    Idempotency-Key; the UI message stream's header (the AI SDK's transport reads it) and
    Retry-After. No cookies: the gateway takes none."""
    return aiohttp_cors.ResourceOptions(
        allow_headers=("Authorization", "Content-Type", "Idempotency-Key", resource_header),
        allow_methods=("GET", "POST"),
        expose_headers=("x-vercel-ai-ui-message-stream", "Retry-After"),
        max_age=600,
    )


_ANY = msgspec.json.Decoder()  # a body is read whole, then checked key by key (`Gateway._chat`)
# How long one write to a client may wait for it to read (its socket's buffers full) before the
# stream is cut: a client that stops reading holds the chunks sent meanwhile, no more.
WRITE_STALL_S = 10.0
# Of MEMFILTER_SHUTDOWN_S, what a stopping gateway keeps for cutting its streams after the drain.
CUT_MARGIN_S = 1.0

# A rejection's reason code -> the HTTP status a web developer expects for it.
STATUS = {
    "schema": 400,
    "decode": 400,
    "thread-mismatch": 400,
    "key-mismatch": 400,
    "ownership": 403,
    "foreign-message-id": 409,
    "duplicate": 409,
    "too-large": 413,
    "context-budget": 413,
    "erased": 410,
    "busy-thread": 409,
}


def error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


# A request that may wait for its turn (MEMFILTER_CONCURRENT_TURNS enqueue, interrupt) and is not
# decided within WAITING_AFTER_S is told so: its stream starts with WAITING_PART, a transient
# data part (the AI SDK hands it to `onData` and keeps it out of the message), and goes on with
# its decision; a refusal then is the stream's error, its text the JSON of an error answer.
WAITING_AFTER_S = 0.5
WAITING_PART = {"type": "data-turn", "data": {"waiting": True}, "transient": True}


@web.middleware
async def _redis_unavailable(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """A Redis that does not answer while a request is read for (its thread's owner, its
    messages, its reply stored) is an outage, answered as one: 503 `unavailable`, to try again
    (a stream already begun waits for Redis instead: `outcomes.stored_row`)."""
    try:
        return await handler(request)
    except UNAVAILABLE as e:
        log.warning("memfilter gateway: Redis did not answer for %s %s (%s)", request.method, request.path, type(e).__name__)
        answer = error(503, "unavailable", f"Redis did not answer ({type(e).__name__}); try again")
        answer.headers["Retry-After"] = "1"
        return answer


def _not_taken(e: NotTaken) -> web.Response:
    answer = error(503, "starting", f"this gateway has not read {e} yet (it is taking it over from another); try again")
    answer.headers["Retry-After"] = "1"
    return answer


def _error_text(code: str, message: str) -> str:
    return json.dumps({"error": {"code": code, "message": message}})


def stream(reply: dict[str, Any] | None) -> web.Response:
    """The UI message stream of a saved reply (None: a request that asks for none)."""
    return web.Response(body=_whole(reply), headers=HEADERS)


def _whole(reply: dict[str, Any] | None) -> bytes:
    """`stream`'s body."""
    return b"".join(event(c) for c in (chunks(reply) if reply is not None else [{"type": "start"}, {"type": "finish"}])) + DONE


def _first(w: Waiting, deadline: float) -> Any:
    """The first of a reply's chunks (a ReplyChunk) or its saved message (a runner that does
    not stream), whichever comes first; None at `deadline`."""

    async def first() -> Any:
        chunk: asyncio.Future[Any] = asyncio.ensure_future(w.chunks.get())
        reply: asyncio.Future[Any] = w.reply
        try:
            await asyncio.wait({chunk, reply}, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not chunk.done():
                chunk.cancel()
        if chunk.done() and not chunk.cancelled():
            return chunk.result()
        return w.reply.result() if w.reply.done() else None

    return first()


def _chunks_of(w: Waiting, attempt: str):
    """The next chunk of a request's reply, of one attempt: "restarted" once another begins."""

    async def more() -> dict[str, Any] | str:
        while True:
            c = await w.chunks.get()
            if c.attempt == attempt:
                return c.chunk
            if c.chunk.get("type") == "start":
                return "restarted"

    return more


def _following(live: Live):
    """A reply being made, from its first chunk: the chunks so far, and the next one's getter
    ("restarted" once another attempt replaces it)."""
    so_far, queue = live.follow()

    async def more() -> dict[str, Any] | str:
        chunk = await queue.get()
        return "restarted" if chunk is None else chunk

    return so_far, more


async def _saved(w: Waiting, deadline: float, already: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The reply as its runner saved it (`already`, if read before the wait began), once on
    `persist-messages`; None at `deadline`."""
    return already if already is not None else await _before(asyncio.shield(w.reply), deadline)


async def _next(more: Callable[[], Awaitable[Any]], cut: asyncio.Future[None], deadline: float) -> Any:
    """What `more` gives next; "cut" once `cut` is done (a gateway stopping), None at `deadline`."""
    got = asyncio.ensure_future(more())
    try:
        done, _ = await asyncio.wait((got, cut), timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not got.done():
            got.cancel()
    return got.result() if got in done else "cut" if cut.done() else None


async def _before(waited: Any, deadline: float) -> Any:
    try:
        return await asyncio.wait_for(waited, max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        return None


class Gateway:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.gateway = settings.gateway
        self.metrics = GatewayMetrics()
        self.identify = resource_of(settings.gateway, self.metrics.jwks_fetches.inc)
        self.client = Client(settings.kafka.bootstrap, settings.topics, settings.policy.limits)
        self.redis = connect(settings.redis.url, waits=True)  # every request in flight may read at once
        self.store = HistoryStore(self.redis, settings.redis.prefix, warmer=Warmer.of(settings))
        # with an address of its own, a share of the outcome topics' partitions (`memfilter.gateway.shards`), else them all
        self.peers = (
            Peers(self.redis, self.store.gateways_key(settings.topics.filtered), settings.gateway.address, lambda: self.outcomes.share())
            if settings.gateway.address
            else None
        )
        self.outcomes = Outcomes(settings.kafka.bootstrap, settings.topics, settings.gateway.reply_s, settings.secret, self.store, self.peers)
        self.metrics.partitions.set_function(lambda: len(self.outcomes.reading))
        self.in_flight = 0
        g = settings.gateway
        self.fair = Fairness(g.caller_rate, g.caller_burst, g.caller_in_flight, time.monotonic)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_RECORD_BYTES, middlewares=[_redis_unavailable])
        app.router.add_get("/", self.page)
        app.router.add_get("/chat.js", self.page_script)
        api = [
            app.router.add_post("/api/chat", self.chat),
            app.router.add_get("/api/chat/{thread}/stream", self.resume),
            app.router.add_post("/api/chat/{thread}/stop", self.stop),
            app.router.add_get("/api/threads/{thread}/messages", self.messages),
        ]
        if origins := self.gateway.origins():  # pages elsewhere may call the API from a browser
            allowed = aiohttp_cors.setup(app, defaults=dict.fromkeys(origins, cors(self.gateway.resource_header)))
            for route in api:
                allowed.add(route)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_page)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._draining)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.cut: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # done when a stopping gateway's drain is over
        if self.peers is not None:
            await self.peers.start()
        await self.outcomes.start(self.client)
        # to the other gateways, for requests forwarded to them: as many connections as requests held (MEMFILTER_GATEWAY_MAX_IN_FLIGHT bounds them)
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def _draining(self, _: web.Application) -> None:
        """Stopping (SIGTERM): no new request is taken (the listener is closed); the replies
        being relayed go on for MEMFILTER_SHUTDOWN_S less CUT_MARGIN_S, then are cut."""
        grace = max(0.0, self.settings.worker.shutdown_s - CUT_MARGIN_S)
        log.info("memfilter gateway: stopping; the replies being relayed have %g s to end", grace)
        asyncio.get_running_loop().call_later(grace, self.cut.set_result, None)
        if self.peers is not None:  # its partitions go to the others now; it reads those of what it still relays
            await self.peers.stop()

    async def _stop(self, _: web.Application) -> None:
        await self.http.close()
        await self.outcomes.stop()
        await self.client.__aexit__()
        await self.redis.aclose()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            resource = await self.identify(request.headers)
        except Unauthenticated as e:
            self.metrics.requests.labels("unauthenticated").inc()
            return error(401, "unauthenticated", str(e))
        if limited := await self._limited(resource, holds=True):
            return limited
        if self.in_flight >= self.gateway.max_in_flight:
            self.fair.release(resource)
            self.metrics.requests.labels("busy").inc()
            return error(503, "busy", f"{self.in_flight} requests are waiting on this gateway (MEMFILTER_GATEWAY_MAX_IN_FLIGHT); try again")
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            response, outcome = await self._chat(request, resource)
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.dec()
            self.fair.release(resource)
        self.metrics.requests.labels(outcome).inc()
        return response

    async def _limited(self, resource: str, holds: bool) -> web.Response | None:
        """The 429 that refuses a request of `resource` past its fair share (`memfilter.gateway.limits`),
        or None. It is answered when its Retry-After is up (a second at most), not at once: a
        caller sending as fast as it is answered is then answered a few times a second, not
        thousands, and takes the gateway's CPU from no one."""
        refused = self.fair.admit(resource, holds)
        if refused is None:
            return None
        await asyncio.sleep(min(refused.seconds, 1.0))
        self.metrics.requests.labels("rate-limited").inc()
        g = self.gateway
        why = (
            f"{g.caller_in_flight} requests of yours are open on this gateway (MEMFILTER_GATEWAY_CALLER_IN_FLIGHT)"
            if refused.held
            else f"more than {g.caller_burst} requests at once, or {g.caller_rate:g} a second, from you (MEMFILTER_GATEWAY_CALLER_BURST, MEMFILTER_GATEWAY_CALLER_RATE)"
        )
        answer = error(429, "rate-limited", f"{why}; try again in {refused.retry_after()} s")
        answer.headers["Retry-After"] = refused.retry_after()
        return answer

    async def _chat(self, request: web.Request, resource: str) -> tuple[web.StreamResponse, str]:
        raw = await request.read()
        try:  # as the worker decodes a record: UTF-8, nested no deeper than a record may be
            body = decode_json(_ANY, raw, "the body", "a chat request")
        except Rejected as e:
            return error(400, e.type, e.message), e.type
        if not isinstance(body, dict) or not isinstance(body.get("id"), str) or not body["id"] or not isinstance(body.get("messages"), list):
            return error(400, "schema", "the body is not a chat request: expected {id: the chat id, messages: [...]}, as useChat sends"), "schema"
        named = body.get("resourceId")
        if named is not None and named != resource:
            return error(
                403, "ownership", f"the body names resource {named!r}, but the caller is {resource!r}; a request acts for its caller only"
            ), "ownership"
        thread, request_id = body["id"], request.headers.get("Idempotency-Key") or str(uuid.uuid4())
        if forwarded := await self._forwarded(request, thread, raw):
            return forwarded, "forwarded"
        chat_request = {"requestId": request_id, "threadId": thread, "resourceId": resource, "messages": body["messages"]}
        # what the AI SDK's transport sends beside the messages, and a stricter turn policy the page may ask for (`busy-thread`)
        chat_request |= {k: body[k] for k in ("trigger", "messageId", "concurrentTurns") if body.get(k) is not None}
        try:
            async with self.outcomes.waiting(thread, resource, request_id) as waiting:
                return await self._turn(request, body, chat_request, waiting)
        except NotTaken as e:
            return _not_taken(e), "starting"

    async def _forwarded(self, request: web.Request, thread: str, body: bytes = b"") -> web.StreamResponse | None:
        """The answer of the gateway whose share `thread` is in, streamed back (`memfilter.gateway.shards`),
        or None if this one serves it: its own, forwarded here already, or its owner not taking it."""
        owner = self.outcomes.owner(thread)
        if owner is None or FORWARDED in request.headers:
            return None
        response = await forward(self.http, request, owner, body, self.gateway.resource_header, WRITE_STALL_S)
        if response is not None:
            self.metrics.forwarded.inc()
        return response

    async def _turn(self, request: web.Request, body: dict[str, Any], chat_request: dict[str, Any], waiting: Waiting) -> tuple[web.StreamResponse, str]:
        """A chat request published, its decision waited for and its reply relayed (see the module's header)."""
        g, request_id = self.gateway, chat_request["requestId"]
        started = time.monotonic()
        try:
            [(_, at)] = await self.client.publish_at([chat_request])
        except InvalidRequest as e:
            return error(STATUS.get(e.type, 400), e.type, str(e).split(": ", 1)[-1]), e.type
        except KafkaError as e:
            return error(
                503, "unavailable", f"Kafka at {self.settings.kafka.bootstrap} did not take the request ({type(e).__name__}); try again"
            ), "unavailable"
        self.outcomes.landed(waiting, at)
        turn_wait = self._turn_wait_s(body.get("concurrentTurns"))
        within = g.outcome_s + turn_wait
        started_stream: web.StreamResponse | None = None
        try:
            decided = await asyncio.wait_for(asyncio.shield(waiting.decided), min(within, WAITING_AFTER_S) if turn_wait else within)
        except TimeoutError:
            if not turn_wait:
                return error(504, "timeout", self._undecided(request_id, within)), "timeout"
            # It may be waiting for its turn (a reply being made in its thread): the stream
            # starts now and says so (a transient data part: the page shows it queued), and
            # goes on with the decision, a refusal then being the stream's error.
            started_stream = web.StreamResponse(headers=HEADERS)
            await started_stream.prepare(request)
            await started_stream.write(event(WAITING_PART))
            try:
                decided = await asyncio.wait_for(asyncio.shield(waiting.decided), within - WAITING_AFTER_S)
            except TimeoutError:
                await started_stream.write(event({"type": "error", "errorText": _error_text("timeout", self._undecided(request_id, within))}) + DONE)
                return started_stream, "timeout"
        self.metrics.wait.labels("decision").observe(time.monotonic() - started)
        if isinstance(decided, Rejection):
            if started_stream is not None:
                await started_stream.write(event({"type": "error", "errorText": _error_text(decided.type, decided.message)}) + DONE)
                return started_stream, decided.type
            return error(STATUS.get(decided.type, 422), decided.type, decided.message), decided.type
        if not wants_reply(decided.context):
            if started_stream is not None:
                await started_stream.write(_whole(None))
                return started_stream, "no-reply"
            return stream(None), "no-reply"
        return await self._relay(request, waiting, started, started_stream)

    def _undecided(self, request_id: str, within: float) -> str:
        return f"no decision on request {request_id} within {within:g} s (MEMFILTER_GATEWAY_OUTCOME_S): is a worker running on {self.settings.topics.requests}?"

    def _turn_wait_s(self, asked: object) -> float:
        """How long a request may wait for its turn before the worker decides it: a reply being
        made in its thread at most MEMFILTER_TURN_WAIT_S, under `enqueue` or `interrupt` (the
        deployment's, or the request's own: `memfilter.core.filter`, `_check_turn`)."""
        policy = self.settings.policy
        turns = max((policy.turns, asked if asked in TURN_POLICIES else policy.turns), key=TURN_POLICIES.index)
        return policy.turn_wait_ms / 1000 if turns in ("enqueue", "interrupt") else 0.0

    async def _relay(self, request: web.Request, w: Waiting, started: float, response: web.StreamResponse | None = None) -> tuple[web.StreamResponse, str]:
        """The reply to a decided request, relayed as it is made (see the module's header), on
        `response` if it was started already (a request that waited for its turn)."""
        # a request that waited for its turn has the reply's whole time from its decision on
        g, deadline = self.gateway, (started if response is None else time.monotonic()) + self.gateway.reply_s
        first = await _first(w, deadline)
        waited_for = (
            f"request {w.request_id} was saved, but no reply within {g.reply_s:g} s (MEMFILTER_GATEWAY_REPLY_S): "
            f"is an agent runner running on {self.settings.topics.filtered}?"
        )
        if first is None or (isinstance(first, dict) and not await self._stored(first, w.thread, deadline)):
            why = waited_for if first is None else self._not_stored(w)
            if response is not None:
                await response.write(event({"type": "error", "errorText": _error_text("timeout", why)}) + DONE)
                return response, "timeout"
            return error(504, "timeout", why), "timeout"
        if isinstance(first, dict):  # a runner that does not stream: the reply, whole, once stored
            self.metrics.wait.labels("reply").observe(time.monotonic() - started)
            if response is not None:
                await response.write(_whole(first))
                return response, "answered"
            return stream(first), "answered"
        so_far, more = [first.chunk], _chunks_of(w, first.attempt)
        live = self.outcomes.live(w.thread, w.resource)
        if first.chunk.get("type") != "start" and live is not None and (live.request_id, live.attempt) == (w.request_id, first.attempt):
            so_far, more = _following(live)  # joined mid-reply (a retry of a request being answered): from its start
        if response is None:
            response = web.StreamResponse(headers=HEADERS)
            await response.prepare(request)
        outcome = await self._follow(request, response, w.thread, so_far, more, lambda: _saved(w, deadline), deadline)
        if outcome == "answered":
            self.metrics.wait.labels("reply").observe(time.monotonic() - started)
        return response, outcome

    async def _follow(
        self,
        request: web.Request,
        response: web.StreamResponse,
        thread: str,
        so_far: list[dict[str, Any]],
        more: Callable[[], Awaitable[dict[str, Any] | str]],
        saved: Callable[[], Awaitable[dict[str, Any] | None]],
        deadline: float,
    ) -> str:
        """Write a reply's chunks to `response` as they come (`so_far`, then from `more`), holding
        its `finish` until the reply is stored; the outcome, for the metrics. A client that
        stops reading is cut once a write has waited WRITE_STALL_S (what it was sent is all it
        holds of the gateway's memory then; it may resume); a gateway stopping cuts what it
        relays when its drain is over, saying so, and the client resumes on another."""

        async def write(data: bytes) -> None:
            await asyncio.wait_for(response.write(data), WRITE_STALL_S)

        pending = list(so_far)
        try:
            while True:
                chunk = pending.pop(0) if pending else await _next(more, self.cut, deadline)
                if chunk is None or isinstance(chunk, str):  # no chunk in time, "restarted" or "cut"
                    ended = chunk or "timeout"
                    why = {
                        "restarted": "the agent runner began this reply again (its last owner stopped); resume or reload to see it",
                        "cut": f"this gateway is stopping; the reply goes on: resume it on another (GET /api/chat/{thread}/stream)",
                        "timeout": f"the reply did not end within {self.gateway.reply_s:g} s (MEMFILTER_GATEWAY_REPLY_S)",
                    }[ended]
                    await write(event({"type": "error", "errorText": why}) + DONE)
                    return {"cut": "stopping"}.get(ended, ended)
                if chunk.get("type") == "finish":
                    message = await saved()
                    if message is None or not await self._stored(message, thread, deadline):
                        await write(event({"type": "error", "errorText": f"the reply was made but not stored in time: see {self.settings.topics.dlq}"}) + DONE)
                        return "timeout"
                await write(event(chunk))
                if chunk.get("type") in ENDS:
                    await write(DONE)
                    return "answered" if chunk.get("type") == "finish" else "error"
        except ConnectionResetError:  # the client went away; the reply goes on, and a resume finds it
            return "disconnected"
        except TimeoutError:  # a write waited WRITE_STALL_S: the client stopped reading
            if request.transport is not None:
                request.transport.abort()
            return "stalled"

    def _not_stored(self, w: Waiting) -> str:
        g = self.gateway
        return f"the reply to request {w.request_id} was published but not stored within {g.reply_s:g} s (MEMFILTER_GATEWAY_REPLY_S): see the dead-letter topic {self.settings.topics.dlq}"

    async def _stored(self, reply: dict[str, Any], thread: str, deadline: float) -> bool:
        """Wait until the worker has applied the reply, so that a reload right after the answer
        shows it; False at `deadline`."""
        return await stored(self.store, reply, thread, deadline)

    async def _owned(self, request: web.Request, holds: bool) -> tuple[str, str] | web.Response:
        """The caller and the thread of a thread's route, or the answer that refuses them:
        401 without identity, 429 past the caller's fair share (checked before anything is
        read for it; a request that `holds` is released by the caller once it ends, or here if
        refused after), 403 for a thread of another resource."""
        try:
            resource = await self.identify(request.headers)
        except Unauthenticated as e:
            return error(401, "unauthenticated", str(e))
        if limited := await self._limited(resource, holds):
            return limited
        thread = request.match_info["thread"]
        refused = None
        try:
            if problem := id_problem(thread):
                refused = error(400, "schema", f"the thread id in the path {problem}")
            elif (owner := (await self.store.owners([], [thread]))[1].get(thread)) is not None and owner != resource:
                refused = error(403, "ownership", f"thread {thread} belongs to another resource; {resource!r} may not use it")
        except BaseException:  # Redis not answering (503, `_redis_unavailable`), or the caller gone: its hold ends with this request all the same
            if holds:
                self.fair.release(resource)
            raise
        if refused is not None:
            if holds:
                self.fair.release(resource)
            return refused
        return resource, thread

    async def resume(self, request: web.Request) -> web.StreamResponse:
        owned = await self._owned(request, holds=True)
        if isinstance(owned, web.Response):
            return owned
        resource, thread = owned
        try:
            return await self._resume(request, resource, thread)
        finally:
            self.fair.release(resource)

    async def _resume(self, request: web.Request, resource: str, thread: str) -> web.StreamResponse:
        if forwarded := await self._forwarded(request, thread):
            return forwarded
        deadline = time.monotonic() + self.gateway.reply_s
        try:  # once the replies begun on its partition are read: no 204 for a reply not read yet
            async with self.outcomes.waiting(thread, resource, "", replies=True) as w:
                live = self.outcomes.live(thread, resource)
                if live is None:
                    return web.Response(status=204)
                self.metrics.requests.labels("resumed").inc()
                w.request_id = live.request_id
                so_far, more = _following(live)
                response = web.StreamResponse(headers=HEADERS)
                await response.prepare(request)
                # its save may have been read before this resume began waiting for it
                outcome = await self._follow(request, response, thread, so_far, more, lambda: self._resumed_save(w, live, deadline), deadline)
        except NotTaken as e:
            return _not_taken(e)
        if outcome in ("stalled", "stopping"):  # a resume's end the operator watches (a turn's every end is counted in `chat`)
            self.metrics.requests.labels(outcome).inc()
        return response

    async def _resumed_save(self, w: Waiting, live: Live, deadline: float) -> dict[str, Any] | None:
        """A resumed reply's save: read on `persist-messages` before the resume began or while
        it followed; or, for a reply saved before this gateway read that partition (it started,
        or took the partition over, after the save), its row in the thread, by the message id
        its `start` named. None at `deadline`."""
        if live.saved is not None:
            return live.saved
        message_id = next((c.get("messageId") for c in live.chunks if c.get("type") == "start"), None)
        waits = [asyncio.ensure_future(_saved(w, deadline))]
        if isinstance(message_id, str) and message_id:
            waits.append(asyncio.ensure_future(stored_row(self.store, w.thread, message_id, deadline)))
        try:
            for first in asyncio.as_completed(waits):
                if (saved := await first) is not None:
                    return saved
            return None
        finally:
            for wait in waits:
                wait.cancel()

    async def stop(self, request: web.Request) -> web.StreamResponse:
        owned = await self._owned(request, holds=False)
        if isinstance(owned, web.Response):
            return owned
        resource, thread = owned
        if forwarded := await self._forwarded(request, thread):
            return forwarded
        try:  # the reply being made, to name it
            async with self.outcomes.waiting(thread, resource, "", replies=True):
                live = self.outcomes.live(thread, resource)
        except NotTaken as e:
            return _not_taken(e)
        request_id = live.request_id if live is not None else ""
        try:
            await self.client.stop_reply(thread, resource, request_id)
        except KafkaError as e:
            return error(503, "unavailable", f"Kafka at {self.settings.kafka.bootstrap} did not take the stop ({type(e).__name__}); try again")
        self.metrics.requests.labels("stopped").inc()
        return web.json_response({"threadId": thread, "requestId": request_id or None}, status=202)

    async def messages(self, request: web.Request) -> web.Response:
        owned = await self._owned(request, holds=False)
        if isinstance(owned, web.Response):
            return owned
        _, thread = owned
        rows = await reads.thread_rows(self.store, thread)
        return web.json_response([to_ui(json.loads(row)) for row in rows if row is not None])

    async def page(self, _: web.Request) -> web.Response:
        """The chat page, told how this gateway identifies its callers."""
        config = json.dumps({"auth": self.gateway.auth, "resourceHeader": self.gateway.resource_header, "gateway": ""})
        return web.Response(text=(PAGE / "index.html").read_text().replace("__CONFIG__", config), content_type="text/html")

    async def page_script(self, _: web.Request) -> web.Response:
        script = PAGE / "chat.js"
        if not script.is_file():
            return web.Response(
                status=404, text="console.error('the chat page is not built: run `npm ci && npm run build` in streams/gateway/page (deploy/setup.sh does)');"
            )
        return web.Response(body=script.read_bytes(), content_type="text/javascript")

    async def healthz(self, _: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def readyz(self, _: web.Request) -> web.Response:
        problems = [] if self.outcomes.running else ["not reading the outcome topics"]
        if self.outcomes.running and not self.outcomes.caught_up.is_set():
            problems.append("still reading the replies being made (reply-streams, MEMFILTER_GATEWAY_REPLY_S back)")
        try:
            await asyncio.wait_for(self.redis.ping(), 1.0)
        except Exception as e:  # any failure to answer is "not ready", named in the reply
            problems.append(f"Redis not answering ({type(e).__name__})")
        if problems:
            return web.Response(text="not ready: " + "; ".join(problems) + "\n", status=503)
        return web.Response(text="ready\n")

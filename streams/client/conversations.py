"""Scripted `useChat`-like clients: conversations driven through the whole loop.

Each `Conversation` is one thread of one resource and behaves as a `useChat` client does: it
holds the conversation (its messages, kept here in the stored form), sends the whole of it as
AI SDK UI messages with every request, waits for the request's filtered input and, when the
model is asked to answer (`replies.wants_reply`), for the reply saved on `persist-messages`,
which it appends before the next turn. A turn is a user text (`sendMessage`: trigger
`submit-message`); one of the form `/tool NAME {json}` makes the echo model answer with a
client tool call, which the client answers at once (as `addToolOutput` with
`sendAutomaticallyWhen` does): a second request, whose answer continues that same message (as
`useChat` keeps it: the same id, a step more). `/regenerate`
drops the last answer and asks for another (`regenerate()`); `/edit TEXT` replaces the last
user message's text and drops what follows it (`sendMessage({text, messageId})`).

Each request's `Turn` keeps what the client held when it sent it and the `context` the model
was given, for the loop's tests and for `memfilter converse` to print.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer

from memfilter.client import Client, RequestRejected, outcome_of
from memfilter.core import ui
from memfilter.core.filter import Rejection
from memfilter.core.replies import PENDING_STATES, wants_reply
from memfilter.schemas.wire import PersistMessages
from memfilter.settings import Topics

Msg = dict[str, Any]

DEMO_SCRIPT = [
    "Find me a flight from Lisbon to Oslo on May 3.",
    '/tool pickSeat {"flight": "TP1234"}',
    "Thanks. Print my itinerary.",
    "/regenerate",
    "/edit Thanks. Print my itinerary and the seat map.",
]


@dataclass
class Turn:
    request_id: str
    view: list[Msg]  # the client's messages when it sent the request (stored form)
    new: bool  # whether its last message was new (not stored yet)
    context: list[Msg]  # what the model was given
    superseded: list[str]  # what it took out of the conversation
    reply: Msg | None  # the saved answer, if one was asked for
    tokens: float | None = None  # what the context weighs, with a token budget (`contextTokens`)


@dataclass
class Conversation:
    thread: str
    resource: str
    script: list[str]
    messages: list[Msg] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)


class Driver:
    """Runs conversations against a running worker and agent runner (`run`)."""

    def __init__(self, bootstrap: str, topics: Topics = Topics(), timeout: float = 60.0, run_id: str | None = None):
        self.bootstrap = bootstrap
        self.topics = topics
        self.timeout = timeout  # seconds to wait for a filtered input or a reply
        # in every request and message id, so that a second run on the same thread never reuses one (a `duplicate`)
        self.run_id = run_id or uuid.uuid4().hex[:6]
        self._outcomes: dict[tuple[int, int], asyncio.Future] = {}  # by where the request landed
        self._replies: dict[str, asyncio.Future] = {}

    async def run(self, conversations: list[Conversation]) -> None:
        """Drive every conversation to the end of its script, side by side."""
        consumer = AIOKafkaConsumer(
            self.topics.filtered,
            self.topics.persist,
            self.topics.dlq,
            bootstrap_servers=self.bootstrap,
            group_id=None,
            auto_offset_reset="latest",
            isolation_level="read_committed",
            fetch_max_wait_ms=20,
        )
        await consumer.start()
        try:
            while not consumer.assignment():
                await asyncio.sleep(0.05)
            for tp in consumer.assignment():
                await consumer.position(tp)  # from the end as it is now: what this run causes
            reader = asyncio.create_task(self._read(consumer))
            try:
                async with Client(self.bootstrap, self.topics) as client:
                    await asyncio.gather(*(self._converse(client, c) for c in conversations))
            finally:
                reader.cancel()
        finally:
            await consumer.stop()

    async def _read(self, consumer: AIOKafkaConsumer) -> None:
        persisted = msgspec.json.Decoder(PersistMessages)
        async for record in consumer:
            try:
                self._take(record, persisted)
            except (msgspec.DecodeError, TypeError):  # not a saver's event (a tombstone too): nothing to wait for
                continue

    def _take(self, record, persisted: msgspec.json.Decoder) -> None:
        """Settle what a filtered input, a dead letter or a saved reply answers. A request's
        outcome is found by where the request landed (`outcome_of`), not by its request id,
        which any client can send."""
        if record.topic != self.topics.persist:
            if (found := outcome_of(record, self.topics)) is not None:
                future = self._future(self._outcomes, found[0])
                if not future.done():
                    future.set_result(found[1])
            return
        event = persisted.decode(record.value)
        if event.requestId.endswith("/reply") and event.messages:
            self._settle(self._replies, event.requestId.removesuffix("/reply"), event.messages[0])

    def _settle(self, futures: dict, request_id: str, value: Any) -> None:
        future = self._future(futures, request_id)
        if not future.done():
            future.set_result(value)

    def _future(self, futures: dict, key: Any) -> asyncio.Future:
        return futures.setdefault(key, asyncio.get_running_loop().create_future())

    async def _converse(self, client: Client, c: Conversation) -> None:
        for k, text in enumerate(c.script):
            if text == "/regenerate" or text.startswith("/edit "):
                last = max(i for i, m in enumerate(c.messages) if m["role"] == "user")
                del c.messages[last + 1 :]
                if text == "/regenerate":
                    reply = await self._send(client, c, f"{c.thread}-{self.run_id}-q{k}", trigger="regenerate-message", new=False)
                    continue
                edited = copy.deepcopy(c.messages[last])
                edited["content"]["parts"] = [{"type": "text", "text": text.removeprefix("/edit ")}]
                c.messages[last] = edited
                reply = await self._send(client, c, f"{c.thread}-{self.run_id}-q{k}", message_id=edited["id"], new=False)
                continue
            c.messages.append({"id": f"{c.thread}-{self.run_id}-u{k}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": text}]}})
            reply = await self._send(client, c, f"{c.thread}-{self.run_id}-q{k}")
            calls = [p["toolInvocation"] for p in (reply or {}).get("content", {}).get("parts", []) if p.get("type") == "tool-invocation"]
            if calls and calls[-1]["state"] in PENDING_STATES:  # the client's tool runs and answers
                answered = copy.deepcopy(reply)
                invocation = answered["content"]["parts"][-1]["toolInvocation"]
                invocation.update(state="result", result={"done": invocation["toolName"], "args": invocation["args"]})
                c.messages[-1] = answered
                await self._send(client, c, f"{c.thread}-{self.run_id}-q{k}-tool", message_id=answered["id"], new=False)

    async def _send(
        self, client: Client, c: Conversation, request_id: str, trigger: str = "submit-message", message_id: str | None = None, new: bool = True
    ) -> Msg | None:
        """Send the conversation as `useChat` does (`messageId` defaults to the last message's)."""
        view = copy.deepcopy(c.messages)
        request = {
            "requestId": request_id,
            "threadId": c.thread,
            "resourceId": c.resource,
            "messages": [ui.to_ui(m) for m in view],
            "trigger": trigger,
            "messageId": message_id or view[-1]["id"],
        }
        [(_, at)] = await client.publish_at([request])
        outcome = await self._wait(self._outcomes, at, f"no filtered input for request {request_id} of thread {c.thread}: is a worker running?")
        if isinstance(outcome, Rejection):
            raise RequestRejected(request_id, outcome.type, outcome.message)
        event = outcome
        reply = None
        if wants_reply(event.context):
            reply = await self._wait(self._replies, request_id, f"no reply saved for request {request_id} of thread {c.thread}: is an agent runner running?")
            if c.messages and c.messages[-1].get("id") == reply.get("id"):
                c.messages[-1] = reply  # a continuation after the client's tool outcome: the same message, a step more
            else:
                c.messages.append(reply)
        tokens = event.contextTokens if event.contextTokens is not msgspec.UNSET else None
        c.turns.append(Turn(request_id, view, new, event.context, event.superseded, reply, tokens))
        return reply

    async def _wait(self, futures: dict, key: Any, problem: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(self._future(futures, key)), self.timeout)
        except TimeoutError:
            raise TimeoutError(f"{problem} (waited {self.timeout:.0f} s)") from None
        finally:
            futures.pop(key, None)


def describe(message: Msg, width: int = 200) -> str:
    """One line for a person: the role, and the text or tool invocations of a message."""
    said = []
    for p in message.get("content", {}).get("parts", []):
        if p.get("type") == "text":
            said.append(p["text"])
        elif p.get("type") == "tool-invocation":
            inv = p["toolInvocation"]
            outcome = f" -> {json.dumps(inv['result'])}" if "result" in inv else ""
            said.append(f"[{inv.get('toolName')}({json.dumps(inv.get('args'))}) {inv.get('state')}{outcome}]")
    line = " ".join(said)
    return f"{message.get('role')}: {line if len(line) <= width else line[: width - 1] + '…'}"

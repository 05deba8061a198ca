"""The agent runner's pure core: when a filtered input wants an answer, what a model is given,
and the reply as it is saved.

The reference agent runner (`memfilter.runtime.agent`) reads `filtered-inputs` and answers each input
whose context asks for one, by saving the model's reply through `persist-messages`, where the
worker's persister applies it to the thread. So that a re-delivered input (a runner that died
before its Kafka commit) saves the same reply and not a second one, everything here is a pure
function of the filtered input, its record timestamp and the deployment's secret:

- `wants_reply`: the context's last message is the user's, or an assistant message whose last
  part is a tool call the client has just answered (a result, an error, a denial or an approval)
  with none of its calls still waiting: what `useChat`'s `sendAutomaticallyWhen:
  lastAssistantMessageIsCompleteWithToolCalls` resubmits. Anything else (a pure echo ending in
  the stored answer, a call still pending) gets none.
- `chat_messages`: the context as OpenAI chat-completions messages: text parts joined, tool
  invocations as `tool_calls` followed by their `tool` results; calls without an outcome yet
  are left out (the API refuses a call without its result). Reasoning, sources, files and data
  parts are not sent.
- `echo_reply`: the `echo` model, deterministic and offline: "echo: <last user text>"; a user
  text `/tool NAME {json}` gets a pending client tool call NAME with those arguments; a tool
  outcome gets "NAME returned <outcome JSON>".
- `reply_message`: the reply as an assistant message (format 2) whose id is keyed by the
  deployment's secret from the thread and request (no client can compute it and take it
  first) and whose createdAt follows everything in the context;
- `reply_event`: the PersistMessages event saving a reply (the runner's, or any downstream
  service's through `Client.reply`): its `requestId` is the input's with `/reply`, so a repeat
  of it changes nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import uuid
from typing import Any

import msgspec

from memfilter.core.filter import CLIENT_OUTCOME_STATES, iso_ms, parse_ms
from memfilter.schemas.wire import FilteredInput, PersistMessages

Msg = dict[str, Any]
Parts = list[Msg]

PENDING_STATES = frozenset({"partial-call", "call", "approval-requested"})
_TOOL_COMMAND = re.compile(r"^/tool\s+([A-Za-z0-9_-]+)\s*(.*)$", re.DOTALL)


def _parts(message: Msg) -> Parts:
    content = message.get("content")
    parts = content.get("parts") if isinstance(content, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _invocations(message: Msg) -> list[Msg]:
    return [p["toolInvocation"] for p in _parts(message) if p.get("type") == "tool-invocation" and isinstance(p.get("toolInvocation"), dict)]


def _text(message: Msg) -> str:
    return "".join(p["text"] for p in _parts(message) if p.get("type") == "text" and isinstance(p.get("text"), str))


def _conversation(context: list[Msg]) -> list[Msg]:
    return [m for m in context if m.get("role") != "system"]


def wants_reply(context: list[Msg]) -> bool:
    """Whether the model is asked to answer this context (see the module's header)."""
    conversation = _conversation(context)
    if not conversation:
        return False
    last = conversation[-1]
    if last.get("role") == "user":
        return True
    parts = _parts(last)
    if last.get("role") != "assistant" or not parts or parts[-1].get("type") != "tool-invocation":
        return False
    states = [inv.get("state") for inv in _invocations(last)]
    return states[-1] in CLIENT_OUTCOME_STATES and not any(s in PENDING_STATES for s in states)


def chat_messages(context: list[Msg]) -> list[Msg]:
    """The context as chat-completions messages (see the module's header)."""
    out: list[Msg] = []
    for m in context:
        role = m.get("role")
        if role in ("system", "user"):
            out.append({"role": role, "content": _text(m)})
        elif role == "assistant":
            done = [inv for inv in _invocations(m) if inv.get("state") in CLIENT_OUTCOME_STATES]
            message: Msg = {"role": "assistant", "content": _text(m) or None}
            if done:
                message["tool_calls"] = [
                    {"id": inv.get("toolCallId"), "type": "function", "function": {"name": inv.get("toolName"), "arguments": json.dumps(inv.get("args", {}))}}
                    for inv in done
                ]
            if message["content"] is None and not done:
                continue
            out.append(message)
            out += [{"role": "tool", "tool_call_id": inv.get("toolCallId"), "content": json.dumps(_outcome(inv))} for inv in done]
    return out


def _outcome(invocation: Msg) -> Any:
    """What a client's tool outcome says, as the model is told it."""
    state = invocation.get("state")
    if state == "result":
        return invocation.get("result")
    if state == "output-error":
        return {"error": invocation.get("errorText")}
    if state == "output-denied":
        return {"denied": True}
    return {"approved": (invocation.get("approval") or {}).get("approved")}


def echo_reply(context: list[Msg], call_key: str) -> Parts:
    """The `echo` model's answer (see the module's header); `call_key` names its tool calls."""
    conversation = _conversation(context)
    last = conversation[-1] if conversation else {}
    if last.get("role") == "assistant":
        inv = _invocations(last)[-1]
        return [{"type": "step-start"}, {"type": "text", "text": f"{inv.get('toolName')} returned {json.dumps(_outcome(inv))}"}]
    text = _text(last)
    command = _TOOL_COMMAND.match(text.strip())
    if command:
        try:
            args = json.loads(command.group(2) or "{}")
        except ValueError:
            args = {"input": command.group(2)}
        call = {"state": "call", "toolCallId": f"call_{call_key[:12]}", "toolName": command.group(1), "args": args}
        return [{"type": "step-start"}, {"type": "tool-invocation", "toolInvocation": call}]
    return [{"type": "step-start"}, {"type": "text", "text": f"echo: {text}"}]


def chat_reply(message: Any) -> Parts:
    """A chat-completions answer (its `choices[0].message`) as stored parts: its text, and each
    tool call as a pending client call."""
    parts: Parts = [{"type": "step-start"}]
    if message.content:
        parts.append({"type": "text", "text": message.content})
    for call in message.tool_calls or ():
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError:
            args = {"input": call.function.arguments}
        parts.append({"type": "tool-invocation", "toolInvocation": {"state": "call", "toolCallId": call.id, "toolName": call.function.name, "args": args}})
    return parts


def reply_id(event: FilteredInput, secret: bytes) -> str:
    """The reply's message id: the same for every delivery of the input, computable only with
    the deployment's secret."""
    digest = hmac.digest(secret, f"reply\n{event.threadId}\n{event.resourceId}\n{event.requestId}".encode(), hashlib.sha256)
    return str(uuid.UUID(bytes=digest[:16], version=4))


def reply_message(event: FilteredInput, parts: Parts, timestamp_ms: int, secret: bytes) -> Msg:
    """The runner's reply to a filtered input (record time `timestamp_ms`) as an assistant
    message (see the module's header)."""
    stamps = [ms for ms in (parse_ms(m.get("createdAt")) for m in event.context) if ms is not None]
    return {
        "id": reply_id(event, secret),
        "role": "assistant",
        "createdAt": iso_ms(max([timestamp_ms - 1, *stamps]) + 1),
        "threadId": event.threadId,
        "resourceId": event.resourceId,
        "content": {"format": 2, "parts": parts},
    }


def reply_event(event: FilteredInput, message: Msg) -> bytes:
    """The PersistMessages value that saves `message` as the reply to a filtered input, in
    its thread, for its resource; a repeat of it changes nothing."""
    message = {"threadId": event.threadId, "resourceId": event.resourceId, **message}
    return msgspec.json.encode(PersistMessages(f"{event.requestId}/reply", event.threadId, event.resourceId, [message]))

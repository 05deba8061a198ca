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
- `chat_messages`: the context as OpenAI chat-completions messages: text parts joined (a
  user's images and data-URL files as content parts beside the text), tool invocations as
  `tool_calls` followed by their `tool` results; calls without an outcome yet are left out
  (the API refuses a call without its result). Reasoning, sources, an assistant's files and
  data parts are not sent.
- `echo_reply`: the `echo` model, deterministic and offline, as the UI message stream chunks
  a model's reply is made of (`memfilter.core.reply_stream`): "echo: <last user text>"; a user
  text `/tool NAME {json}` gets a pending client tool call NAME with those arguments; a tool
  outcome gets "NAME returned <outcome JSON>".
- `continued` and `reply_message`: the reply as the assistant message saved (format 2). After
  the client answered the model's tool calls, the reply continues the assistant message that
  made them (`continued`: same id and createdAt, the new step appended), as the AI SDK's
  client appends it, so stored and client views agree. Otherwise it is a new message whose id
  is keyed by the deployment's secret from the thread and request (no client can compute it
  and take it first) and whose createdAt follows everything in the context;
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
from msgspec import UNSET

from memfilter.core.filter import CLIENT_OUTCOME_STATES, iso_ms, parse_ms
from memfilter.core.ui import to_stored
from memfilter.schemas.wire import FilteredInput, PersistMessages, WorkingMemoryUpdate

Msg = dict[str, Any]

PENDING_STATES = frozenset({"partial-call", "call", "approval-requested"})
_TOOL_COMMAND = re.compile(r"^/tool\s+([A-Za-z0-9_-]+)\s*(.*)$", re.DOTALL)


def _parts(message: Msg) -> list[Msg]:
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
        if role == "system":
            out.append({"role": role, "content": _text(m)})
        elif role == "user":
            files = [f for f in map(_file_content, _parts(m)) if f is not None]
            out.append({"role": role, "content": [{"type": "text", "text": _text(m)}, *files] if files else _text(m)})
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


def _file_content(part: Msg) -> Msg | None:
    """A stored file part as a chat-completions content part: an image by its URL, another
    file by its data URL (the API takes no other); None for a part that is not such a file."""
    kind, data = part.get("mimeType") or part.get("mediaType"), part.get("data") or part.get("url")
    if part.get("type") != "file" or not isinstance(kind, str) or not isinstance(data, str):
        return None
    if kind.startswith("image/"):
        return {"type": "image_url", "image_url": {"url": data}}
    if data.startswith("data:"):
        return {"type": "file", "file": {"file_data": data, "filename": part.get("filename") or "file"}}
    return None


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


def echo_reply(context: list[Msg], call_key: str) -> list[Msg]:
    """The `echo` model's answer as UI message stream chunks, a word per text delta (see the
    module's header); `call_key` names its tool calls."""
    conversation = _conversation(context)
    last = conversation[-1] if conversation else {}
    if last.get("role") == "assistant":
        inv = _invocations(last)[-1]
        return _echo_text(f"{inv.get('toolName')} returned {json.dumps(_outcome(inv))}", call_key)
    text = _text(last)
    command = _TOOL_COMMAND.match(text.strip())
    if command:
        try:
            args = json.loads(command.group(2) or "{}")
        except ValueError:
            args = {"input": command.group(2)}
        call, name = f"call_{call_key[:12]}", command.group(1)
        return [
            {"type": "start-step"},
            {"type": "tool-input-start", "toolCallId": call, "toolName": name},
            {"type": "tool-input-available", "toolCallId": call, "toolName": name, "input": args},
            {"type": "finish-step"},
            {"type": "finish", "finishReason": "tool-calls", "messageMetadata": {"model": "echo", "finishReason": "tool-calls"}},
        ]
    return _echo_text(f"echo: {text}", call_key)


def _echo_text(text: str, key: str) -> list[Msg]:
    words = re.findall(r"\S+\s*|\s+", text) or [""]
    part = f"{key[:12]}-text"
    return [
        {"type": "start-step"},
        {"type": "text-start", "id": part},
        *({"type": "text-delta", "id": part, "delta": w} for w in words),
        {"type": "text-end", "id": part},
        {"type": "finish-step"},
        {"type": "finish", "finishReason": "stop", "messageMetadata": {"model": "echo", "finishReason": "stop"}},
    ]


def continued(event: FilteredInput, secret: bytes) -> tuple[str, Msg | None]:
    """The reply's id, and the stored assistant message it continues: the last of the
    conversation when it is the assistant's (its tool calls just answered, as `wants_reply`
    asks); None, with an id of its own (`reply_id`), for a new message."""
    conversation = _conversation(event.context)
    last = conversation[-1] if conversation else {}
    if last.get("role") == "assistant" and isinstance(last.get("id"), str) and last["id"]:
        return last["id"], last
    return reply_id(event, secret), None


def reply_id(event: FilteredInput, secret: bytes) -> str:
    """The reply's message id: the same for every delivery of the input, computable only with
    the deployment's secret."""
    digest = hmac.digest(secret, f"reply\n{event.threadId}\n{event.resourceId}\n{event.requestId}".encode(), hashlib.sha256)
    return str(uuid.UUID(bytes=digest[:16], version=4))


def reply_message(event: FilteredInput, ui: Msg, timestamp_ms: int, secret: bytes) -> Msg:
    """The runner's reply to a filtered input (record time `timestamp_ms`), made as the UI
    message `ui`, as the assistant message saved (see the module's header). A reply that
    continues a stored message keeps that message's id and createdAt."""
    id_, base = continued(event, secret)
    message = to_stored({**ui, "id": id_})
    if base is not None:
        message["createdAt"] = base.get("createdAt")
    else:
        stamps = [ms for ms in (parse_ms(m.get("createdAt")) for m in event.context) if ms is not None]
        message["createdAt"] = iso_ms(max([timestamp_ms - 1, *stamps]) + 1)
    message |= {"role": "assistant", "threadId": event.threadId, "resourceId": event.resourceId}
    return {k: v for k, v in message.items() if v is not None}


def no_reply_event(event: FilteredInput) -> bytes:
    """The PersistMessages value that ends a reply that will not come (the runner dead-lettered
    its input): it saves nothing, but as the input's `<requestId>/reply` it ends the thread's
    replying mark (docs/delivery.md), so the thread's next request is not held for one."""
    return msgspec.json.encode(PersistMessages(f"{event.requestId}/reply", event.threadId, event.resourceId, []))


def reply_event(event: FilteredInput, message: Msg, memory_calls: list[Msg] | None = None) -> bytes:
    """The PersistMessages value that saves `message` as the reply to a filtered input, in
    its thread, for its resource, with the reply's calls that updated working memory; a repeat
    of it changes nothing."""
    message = {"threadId": event.threadId, "resourceId": event.resourceId, **message}
    update = WorkingMemoryUpdate(memory_calls) if memory_calls else UNSET
    return msgspec.json.encode(PersistMessages(f"{event.requestId}/reply", event.threadId, event.resourceId, [message], workingMemory=update))

"""AI SDK UI messages (what `useChat` sends) to stored messages (format 2), and back.

Most requests come from backends behind the AI SDK's `useChat`, which hold `UIMessage`s
(`{id, role, parts, metadata?}`). The processor accepts them as they are: each message of a
request is recognized on its own (`is_ui`) and converted part by part (`to_stored`) before the
filter, whose rules then apply unchanged. The filter decides on `typed`, the little it reads of
each converted message, made from the message as msgspec decoded it; only the messages that
go on are converted whole (a whole 20-turn echo costs ~1.5x its stored form, not ~3x).
`to_ui` is the way back, for services downstream that hand stored messages to a `useChat`
client or to the AI SDK. The rules, and where they
differ from Mastra's conversion, are in `docs/ui-messages.md`.

What this promises:
- lossless: every key not named in a rule stays where it was (on the message, or on its
  part), so `to_ui(to_stored(m)) == m` for every UI message made of AI SDK v5 part types;
- total: any JSON object with a `parts` array either converts or raises `NotConvertible`
  naming the path of what is wrong (`messages[2].parts[1].state`), never anything else (the
  processor makes it a `schema` rejection);
- pure: dicts in, new dicts out; nothing given is changed.
"""

from __future__ import annotations

from typing import Any

from msgspec import UNSET

from memfilter.schemas.wire import Content, EitherMessage, Message, Part, ToolInvocation

Msg = dict[str, Any]


class NotConvertible(ValueError):
    """A UI message whose shape the conversion cannot read; the message names the path."""


# UI tool states -> stored ones; the other states are the same on both sides.
_TO_STORED_STATE = {"input-streaming": "partial-call", "input-available": "call", "output-available": "result"}
_TO_UI_STATE = {v: k for k, v in _TO_STORED_STATE.items()}
UI_TOOL_STATES = frozenset({*_TO_STORED_STATE, "output-error", "approval-requested", "approval-responded", "output-denied"})
# The typed view of parts other than tool parts (one instance per type: the filter reads a
# part's type, and the tool invocation of `tool-invocation` parts only); `_SIMPLE`, those that
# need no check.
_PLAIN = {kind: Part(kind) for kind in ("text", "step-start", "reasoning", "file", "source", "source-document")}
_SIMPLE = {kind: _PLAIN[kind] for kind in ("text", "step-start", "source-document")}
# Keys of a UI tool part that go into `toolInvocation` under the same name.
_INVOCATION_KEYS = ("errorText", "rawInput", "approval", "preliminary", "title", "resultProviderMetadata")


def is_ui(message: Msg) -> bool:
    """A UI message: a `parts` array, and `content` absent or a string (AI SDK v4's mirror)."""
    return isinstance(message.get("parts"), list) and isinstance(message.get("content", ""), str)


# Part types that are the same in both forms (the most common ones, looked at first).
_AS_IS = frozenset({"text", "step-start", "source-document"})


def to_stored(message: Msg, where: str = "message") -> Msg:
    """A UI message as a stored message (format 2); `where` names it in errors."""
    out = dict(message)
    parts = out.pop("parts")
    content: Msg = {"format": 2}
    converted = content["parts"] = []
    for i, p in enumerate(parts):
        kind = p.get("type") if type(p) is dict else None
        converted.append(p if type(kind) is str and kind in _AS_IS else _part_to_stored(p, where, i))
    if "content" in out:
        content["content"] = out.pop("content")
    if "metadata" in out:
        content["metadata"] = out.pop("metadata")
    out["content"] = content
    return out


def _part_to_stored(part: Any, message: str, index: int) -> Msg:
    where = f"{message}.parts[{index}]"
    if not isinstance(part, dict):
        raise NotConvertible(f'{where} is not an object; a part is {{"type": ..., ...}}')
    kind = part.get("type")
    if not isinstance(kind, str):
        raise NotConvertible(f"{where}.type is missing or not a string")
    if kind == "reasoning" and "reasoning" not in part:
        text = _string(part, "text", where)
        rest = {k: v for k, v in part.items() if k not in ("type", "text")}
        return {"type": "reasoning", "reasoning": text, "details": [{"type": "text", "text": text}], **rest}
    if kind == "file" and "mimeType" not in part and "data" not in part:
        rest = {k: v for k, v in part.items() if k not in ("type", "mediaType", "url")}
        return {"type": "file", "mimeType": _string(part, "mediaType", where), "data": _string(part, "url", where), **rest}
    if kind == "source-url":
        source = {"sourceType": "url", "id": _string(part, "sourceId", where), "url": _string(part, "url", where)}
        source.update((k, part[k]) for k in ("title", "providerMetadata") if k in part)
        rest = {k: v for k, v in part.items() if k not in ("type", "sourceId", "url", "title", "providerMetadata")}
        return {"type": "source", "source": source, **rest}
    if kind == "dynamic-tool" or (kind.startswith("tool-") and not (kind == "tool-invocation" and "toolInvocation" in part)):
        return _tool_to_stored(part, kind, where)
    return part


def _tool_to_stored(part: Msg, kind: str, where: str) -> Msg:
    state = part.get("state")
    if not isinstance(state, str) or state not in UI_TOOL_STATES:
        raise NotConvertible(f"{where}.state is {state!r}; a tool part's state is one of {', '.join(sorted(UI_TOOL_STATES))}")
    invocation: Msg = {"state": _TO_STORED_STATE.get(state, state), "toolCallId": _string(part, "toolCallId", where)}
    if kind == "dynamic-tool":
        invocation["toolName"] = _string(part, "toolName", where)
        invocation["dynamic"] = True
    else:
        invocation["toolName"] = kind[len("tool-") :]
    if "input" in part:
        invocation["args"] = part["input"]
    if "output" in part:
        invocation["result"] = part["output"]
    invocation.update((k, part[k]) for k in _INVOCATION_KEYS if k in part)
    named = {"type", "state", "toolCallId", "input", "output", "callProviderMetadata", *_INVOCATION_KEYS}
    if kind == "dynamic-tool":
        named.add("toolName")
    out: Msg = {"type": "tool-invocation", "toolInvocation": invocation}
    if "callProviderMetadata" in part:
        out["providerMetadata"] = part["callProviderMetadata"]
    out.update((k, v) for k, v in part.items() if k not in named)
    return out


def _string(part: Msg, key: str, where: str) -> str:
    value = part.get(key)
    if not isinstance(value, str):
        raise NotConvertible(f"{where}.{key} is {'missing' if key not in part else 'not a string'}")
    return value


def to_ui(message: Msg) -> Msg:
    """A stored message (format 2) as an AI SDK v5 UI message: the inverse of `to_stored`.
    Stored rows that never were UI messages convert too (v4 tool invocations become
    `tool-<name>` parts); keys of their `content` other than `parts`, `content` and `metadata`
    have no place in a UI message and are left out."""
    content = message.get("content") or {}
    out = {k: v for k, v in message.items() if k != "content"}
    out["parts"] = [_part_to_ui(p) for p in content.get("parts", [])]
    if "content" in content:
        out["content"] = content["content"]
    if "metadata" in content:
        out["metadata"] = content["metadata"]
    return out


def _part_to_ui(part: Msg) -> Msg:
    kind = part.get("type")
    if kind == "reasoning" and "reasoning" in part:
        rest = {k: v for k, v in part.items() if k not in ("type", "reasoning", "details")}
        return {"type": "reasoning", "text": part["reasoning"], **rest}
    if kind == "file" and "mimeType" in part and "data" in part:
        rest = {k: v for k, v in part.items() if k not in ("type", "mimeType", "data")}
        return {"type": "file", "mediaType": part["mimeType"], "url": part["data"], **rest}
    if kind == "source" and isinstance(part.get("source"), dict) and part["source"].get("sourceType") == "url":
        source = part["source"]
        out = {"type": "source-url", "sourceId": source.get("id"), "url": source.get("url")}
        out.update((k, source[k]) for k in ("title", "providerMetadata") if k in source)
        out.update((k, v) for k, v in part.items() if k not in ("type", "source"))
        return out
    if kind == "tool-invocation" and isinstance(part.get("toolInvocation"), dict):
        return _tool_to_ui(part)
    return part


def _tool_to_ui(part: Msg) -> Msg:
    invocation = part["toolInvocation"]
    dynamic = invocation.get("dynamic") is True
    out: Msg = {"type": "dynamic-tool" if dynamic else f"tool-{invocation.get('toolName')}"}
    if dynamic:
        out["toolName"] = invocation.get("toolName")
    out["toolCallId"] = invocation.get("toolCallId")
    out["state"] = _TO_UI_STATE.get(invocation.get("state"), invocation.get("state"))
    if "args" in invocation:
        out["input"] = invocation["args"]
    if "result" in invocation:
        out["output"] = invocation["result"]
    named = {"state", "toolCallId", "toolName", "dynamic", "args", "result"}
    out.update((k, v) for k, v in invocation.items() if k not in named)  # `errorText`, `approval`, ... and a v4 row's own
    if "providerMetadata" in part:
        out["callProviderMetadata"] = part["providerMetadata"]
    out.update((k, v) for k, v in part.items() if k not in ("type", "toolInvocation", "providerMetadata"))
    return out


class _NoView(Exception):
    """A part `typed` cannot view: `to_stored` is to say what is wrong with it."""


def typed(message: EitherMessage) -> Message | None:
    """What the filter reads of a UI message's stored form (ids, role, and per part its type and
    tool invocation), made straight from the message as decoded, without converting it whole:
    `to_stored` runs only for the messages that go on. None when the message needs
    `to_stored` to say what is wrong with it (or is no UI message)."""
    if message.parts is UNSET or type(message.content) is Content:
        return None
    try:
        parts = [_SIMPLE.get(p.type) or _typed_part(p) for p in message.parts]
    except _NoView:
        return None
    return Message(message.role, Content(2, parts), message.id, message.createdAt, message.threadId, message.resourceId, message.type)


def _typed_part(p) -> Part:
    kind = p.type
    if kind == "reasoning":
        if p.text is UNSET and p.reasoning is UNSET:
            raise _NoView
        return _PLAIN["reasoning"]
    if kind == "dynamic-tool" or (kind.startswith("tool-") and not (kind == "tool-invocation" and p.toolInvocation is not UNSET)):
        name = p.toolName if kind == "dynamic-tool" else kind[len("tool-") :]
        if p.state not in UI_TOOL_STATES or p.toolCallId is UNSET or name is UNSET:
            raise _NoView
        state = _TO_STORED_STATE.get(p.state, p.state)
        return Part("tool-invocation", toolInvocation=ToolInvocation(state, p.toolCallId, name, p.input, p.output, p.errorText, p.approval, p.preliminary))
    if p.toolInvocation is not UNSET:
        return Part(kind, toolInvocation=p.toolInvocation)
    if (kind == "file" and (p.mediaType is UNSET or p.url is UNSET)) or (kind == "source-url" and (p.sourceId is UNSET or p.url is UNSET)):
        raise _NoView
    kind = "source" if kind == "source-url" else kind
    return _PLAIN.get(kind) or Part(kind)

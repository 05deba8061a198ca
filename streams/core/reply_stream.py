"""A reply as it is made: UI message stream chunks in, the message they add up to out.

The agent runner streams a reply as the AI SDK's UI message stream chunks (`text-delta`,
`tool-input-delta`, `start-step`, ...: `memfilter.core.ui_stream` names the protocol), and the
gateway relays the same chunks to `useChat`. So that what the browser shows and what is saved
can never differ, the saved reply is made from the chunks alone, folded here the way the AI
SDK's client folds them (`processUIMessageStream` in the `ai` package): the same parts, with
the same keys, in the same order.

What it promises:
- `Reply(message_id, continued)` starts a reply: a new assistant message, or the parts of the
  assistant message it continues (after the client answered its tool calls: the AI SDK appends
  the continuation to that message, with the same id);
- `add(chunk)` folds one chunk; a chunk the client would refuse (a delta for a part never
  started) raises `BadChunk`, so a model that streams nonsense fails the reply, not the runner;
- `ended(reason, error)` closes the reply as it stands when it is cut short (a stop, an error
  midway) and returns the chunks that say so to the client: every call still being streamed
  or left unanswered by the model's own end becomes `output-error` naming why, so no stored
  call looks like it will still be answered;
- `ui()` is the message as the client has it after those chunks; `metadata` merges every
  chunk's `messageMetadata` as the client does;
- pure: dicts in, new dicts out.
"""

from __future__ import annotations

import copy
import json
from typing import Any

Msg = dict[str, Any]


class BadChunk(ValueError):
    """A chunk the AI SDK's client would refuse; the message says which and why."""


def _drop_none(d: Msg) -> Msg:
    return {k: v for k, v in d.items() if v is not None}


def _merge(old: Any, new: Any) -> Any:
    """The AI SDK's `mergeObjects`: objects merged key by key, anything else replaced."""
    if isinstance(old, dict) and isinstance(new, dict):
        return {**old, **{k: _merge(old.get(k), v) for k, v in new.items()}}
    return new


class Reply:
    def __init__(self, message_id: str, continued: Msg | None = None):
        self.message: Msg = copy.deepcopy(continued) if continued else {"id": message_id, "role": "assistant", "parts": []}
        self.message["id"] = message_id
        self.metadata: Any = self.message.pop("metadata", None)
        self._texts: dict[str, Msg] = {}  # text and reasoning parts being streamed, by chunk id
        self._inputs: dict[str, str] = {}  # tool call id -> its input as streamed so far

    @property
    def parts(self) -> list[Msg]:
        return self.message["parts"]

    def add(self, chunk: Msg) -> None:
        kind = chunk.get("type")
        if kind in ("start", "finish", "message-metadata"):
            if chunk.get("messageMetadata") is not None:
                self.metadata = _merge(self.metadata, chunk["messageMetadata"])
        elif kind in ("text-start", "reasoning-start"):
            part = _drop_none({"type": kind.removesuffix("-start"), "id": chunk["id"] if kind == "reasoning-start" else None, "text": ""})
            part |= _drop_none({"providerMetadata": chunk.get("providerMetadata"), "state": "streaming"})
            self._texts[chunk["id"]] = part
            self.parts.append(part)
        elif kind in ("text-delta", "reasoning-delta", "text-end", "reasoning-end"):
            found = self._texts.get(str(chunk.get("id")))
            if found is None:
                raise BadChunk(f"{kind} for text part {chunk.get('id')!r}, which no {kind.split('-')[0]}-start began")
            part = found
            if kind.endswith("-delta"):
                part["text"] += chunk["delta"]
            else:
                part["state"] = "done"
                del self._texts[chunk["id"]]
            if chunk.get("providerMetadata") is not None:
                part["providerMetadata"] = chunk["providerMetadata"]
        elif kind == "start-step":
            self.parts.append({"type": "step-start"})
        elif kind == "tool-input-start":
            self._inputs[chunk["toolCallId"]] = ""
            self._tool(chunk, "input-streaming", input=None)
        elif kind == "tool-input-delta":
            call = chunk.get("toolCallId")
            if call not in self._inputs:
                raise BadChunk(f"tool-input-delta for tool call {call!r}, which no tool-input-start began")
            self._inputs[call] += chunk["inputTextDelta"]
        elif kind == "tool-input-available":
            self._inputs.pop(chunk["toolCallId"], None)
            self._tool(chunk, "input-available", input=chunk.get("input"))
        elif kind == "tool-input-error":
            self._inputs.pop(chunk["toolCallId"], None)
            self._tool(chunk, "output-error", input=chunk.get("input"), errorText=chunk.get("errorText"))
        elif kind in ("tool-output-available", "tool-output-error"):
            part = self._find(chunk["toolCallId"])
            state = "output-available" if kind == "tool-output-available" else "output-error"
            part["state"] = state
            part |= {"output": chunk["output"]} if state == "output-available" else {"errorText": chunk["errorText"]}
        elif kind in ("file", "source-url", "source-document"):
            self.parts.append({k: v for k, v in chunk.items() if v is not None})
        # `finish-step` changes no part (as in the client, a text not ended stays open across it);
        # `error` and `abort` end the stream and change none either

    def _find(self, call: str) -> Msg:
        for part in reversed(self.parts):
            if part.get("toolCallId") == call:
                return part
        raise BadChunk(f"a chunk for tool call {call!r}, which no tool-input chunk began")

    def _tool(self, chunk: Msg, state: str, **fields: Any) -> None:
        dynamic = bool(chunk.get("dynamic"))
        name = chunk.get("toolName")
        if not isinstance(name, str) or not isinstance(chunk.get("toolCallId"), str):
            raise BadChunk(f"{chunk.get('type')} without a toolName and a toolCallId")
        existing = next((p for p in self._step() if p.get("toolCallId") == chunk["toolCallId"]), None)
        part = existing if existing is not None else {}
        if existing is None:
            self.parts.append(part)
        part.update({"type": "dynamic-tool", "toolName": name} if dynamic else {"type": f"tool-{name}"})
        part |= {"toolCallId": chunk["toolCallId"], "state": state}
        for key, value in fields.items():
            if value is None:
                part.pop(key, None)
            else:
                part[key] = value
        part.pop("rawInput", None)
        if chunk.get("title") is not None:
            part["title"] = chunk["title"]
        if chunk.get("providerExecuted") is not None:
            part["providerExecuted"] = chunk["providerExecuted"]
        if chunk.get("providerMetadata") is not None:
            part["callProviderMetadata"] = chunk["providerMetadata"]

    def _step(self) -> list[Msg]:
        """The parts since the last step boundary."""
        at = max((i for i, p in enumerate(self.parts) if p.get("type") == "step-start"), default=-1)
        return self.parts[at + 1 :]

    def ended(self, why: str) -> list[Msg]:
        """Close a reply cut short (`why`: the reason, as its error text), in place; the chunks
        that make the client's copy the same: every streamed text done, every call still being
        streamed an error naming why."""
        out: list[Msg] = []
        for chunk_id, part in list(self._texts.items()):
            out.append({"type": f"{part['type']}-end", "id": chunk_id})
            self.add(out[-1])
        for call in list(self._inputs):
            part = self._find(call)
            name = part.get("toolName") if part["type"] == "dynamic-tool" else part["type"].removeprefix("tool-")
            chunk = {"type": "tool-input-error", "toolCallId": call, "toolName": name, "input": _complete(self._inputs[call]), "errorText": why}
            out.append(chunk | ({"dynamic": True} if part["type"] == "dynamic-tool" else {}))
            self.add(out[-1])
        return out

    def ui(self) -> Msg:
        """The reply as a UI message, as the client has it."""
        return self.message | ({"metadata": self.metadata} if self.metadata is not None else {})


def _complete(text: str) -> Any:
    """A tool input cut short: what it was, if it was already whole JSON; else none."""
    try:
        return json.loads(text)
    except ValueError:
        return None

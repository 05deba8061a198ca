"""OpenAI chat completions, streamed, as the AI SDK's UI message stream: the `openai` model's pure half.

`memfilter agent --backend openai` calls any OpenAI-compatible `/chat/completions` endpoint with
`stream: true` and hands each streamed chunk (as a dict) to `Completion.add`, which returns the
UI message stream chunks (`memfilter.core.reply_stream`) it makes:

- `delta.content` -> `text-start` once, then `text-delta`s; `delta.reasoning_content` (or
  `delta.reasoning`, as DeepSeek, vLLM and OpenRouter stream a model's reasoning) ->
  `reasoning-*` chunks;
- `delta.tool_calls[i]` -> `tool-input-start` when the call's id and name come, then a
  `tool-input-delta` per piece of its JSON arguments; at the end each call is
  `tool-input-available` with its parsed input (or `tool-input-error` when the arguments
  are not JSON), so the client's `onToolCall` runs for it;
- the reply is one step (`start-step` ... `finish-step`); `finish` carries the finish reason
  in the protocol's words and, as message metadata, the model id, the usage (input and
  output tokens, with `stream_options.include_usage`) and the finish reason.

`request` makes what is sent: the system prompt, the context as chat messages (user images and
data-URL files as content parts), the tools and the sampling settings.
"""

from __future__ import annotations

import json
from typing import Any

from memfilter.core.replies import chat_messages

Msg = dict[str, Any]

# chat completions' finish_reason -> the protocol's
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool-calls", "function_call": "tool-calls", "content_filter": "content-filter"}


def request(context: list[Msg], model: str, system: str = "", tools: list[Msg] | None = None, **sampling: Any) -> Msg:
    """The body of a streamed chat completion for `context` (sampling settings that are None
    are left out, so the endpoint's defaults hold)."""
    messages = chat_messages(context)
    if system:
        messages.insert(0, {"role": "system", "content": system})
    body: Msg = {"model": model, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    if tools:
        body["tools"] = [{"type": "function", "function": tool} for tool in tools]
    return body | {k: v for k, v in sampling.items() if v is not None}


class Completion:
    """One streamed completion, folded into UI message stream chunks."""

    def __init__(self, id_prefix: str):
        self.prefix = id_prefix  # names the text and reasoning parts' chunk ids
        self.model: str | None = None
        self.usage: Msg | None = None
        self.reason: str | None = None
        self.open: dict[str, str] = {}  # "text" / "reasoning" -> the chunk id of the part being streamed
        self.calls: dict[int, Msg] = {}  # tool call index -> {id, name, arguments}
        self.started = False
        self._parts = 0  # text and reasoning parts begun: each gets its own chunk id

    def add(self, chunk: Msg) -> list[Msg]:
        out: list[Msg] = []
        if not self.started:
            out.append({"type": "start-step"})
            self.started = True
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            u = chunk["usage"]
            self.usage = {"inputTokens": u.get("prompt_tokens"), "outputTokens": u.get("completion_tokens"), "totalTokens": u.get("total_tokens")}
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += self._text("reasoning", reasoning)
            if isinstance(delta.get("content"), str) and delta["content"]:
                out += self._text("text", delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.reason = FINISH.get(choice["finish_reason"], "other")
        return out

    def _text(self, kind: str, delta: str) -> list[Msg]:
        out = []
        other = "text" if kind == "reasoning" else "reasoning"
        if other in self.open:
            out.append({"type": f"{other}-end", "id": self.open.pop(other)})
        if kind not in self.open:
            self._parts += 1
            self.open[kind] = f"{self.prefix}-{kind}-{self._parts}"
            out.append({"type": f"{kind}-start", "id": self.open[kind]})
        return [*out, {"type": f"{kind}-delta", "id": self.open[kind], "delta": delta}]

    def _call(self, piece: Msg) -> list[Msg]:
        index = piece.get("index", 0)
        function = piece.get("function") or {}
        call = self.calls.get(index)
        out: list[Msg] = []
        if call is None:
            call = self.calls[index] = {"id": piece.get("id") or f"{self.prefix}-call-{index}", "name": function.get("name") or "", "arguments": ""}
            out += self._close_texts()
            out.append({"type": "tool-input-start", "toolCallId": call["id"], "toolName": call["name"]})
        if function.get("arguments"):
            call["arguments"] += function["arguments"]
            out.append({"type": "tool-input-delta", "toolCallId": call["id"], "inputTextDelta": function["arguments"]})
        return out

    def _close_texts(self) -> list[Msg]:
        return [{"type": f"{kind}-end", "id": self.open.pop(kind)} for kind in list(self.open)]

    def finish(self) -> list[Msg]:
        """The chunks that end a completion the endpoint ended: texts closed, each call's
        input available, the step finished, `finish` with the reason and the metadata."""
        out = self._close_texts()
        for call in self.calls.values():
            try:
                out.append({"type": "tool-input-available", "toolCallId": call["id"], "toolName": call["name"], "input": json.loads(call["arguments"] or "{}")})
            except ValueError:
                error = f"the model's arguments for {call['name']} are not JSON: {call['arguments'][:200]!r}"
                out.append({"type": "tool-input-error", "toolCallId": call["id"], "toolName": call["name"], "input": call["arguments"], "errorText": error})
        self.calls.clear()
        reason = self.reason or "other"
        if self.started:
            out.append({"type": "finish-step"})
        return [*out, {"type": "finish", "finishReason": reason, "messageMetadata": self.metadata(reason)}]

    def metadata(self, reason: str) -> Msg:
        """What the saved reply's metadata says of the call."""
        return {k: v for k, v in (("model", self.model), ("finishReason", reason), ("usage", self.usage)) if v is not None}

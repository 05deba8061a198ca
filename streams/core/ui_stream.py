"""A saved assistant message as the AI SDK's UI message stream: what `useChat` reads.

`memfilter gateway` answers a `useChat` request with the reply the agent saved. The AI SDK's
client builds its copy of the message from a stream of chunks (`uiMessageChunkSchema` in the
`ai` package: `start`, `text-start`/`text-delta`/`text-end`, `tool-input-available`, ...), sent
as server-sent events (`data: <chunk JSON>`, then `data: [DONE]`) under the protocol's
headers. This module makes those chunks from the stored message, by way of its UI form
(`memfilter.core.ui.to_ui`).

What it promises:
- the client's copy is the stored message: the `start` chunk carries the stored id, and each
  UI part comes out as the chunks the AI SDK turns back into that part (a text part in one
  delta; a tool part as its input, and its output or error where it has one, so `onToolCall`
  runs for a pending client call and `addToolOutput` answers it); a step boundary
  (`step-start`) as `start-step`/`finish-step`;
- parts the protocol has no chunk for (a `source-document` without a title, unknown types)
  are left out of the stream, never sent malformed; they stay stored, and
  `GET /api/threads/{id}/messages` shows them;
- pure: a dict in, new dicts out.
"""

from __future__ import annotations

from typing import Any

import msgspec

from memfilter.core.ui import Msg, to_ui

# The headers of the UI message stream protocol (the `ai` package's UI_MESSAGE_STREAM_HEADERS).
HEADERS = {
    "content-type": "text/event-stream",
    "cache-control": "no-cache",
    "connection": "keep-alive",
    "x-vercel-ai-ui-message-stream": "v1",
    "x-accel-buffering": "no",
}

_PASSED = ("providerMetadata",)


def chunks(message: Msg, finish_reason: str | None = None) -> list[Msg]:
    """The UI message stream chunks of a stored assistant message (format 2), from `start` to `finish`."""
    ui = to_ui(message)
    out: list[Msg] = [{"type": "start", "messageId": ui["id"]} | ({"messageMetadata": ui["metadata"]} if "metadata" in ui else {})]
    in_step = False
    for n, part in enumerate(ui["parts"]):
        kind = part.get("type")
        if kind == "step-start":
            if in_step:
                out.append({"type": "finish-step"})
            out.append({"type": "start-step"})
            in_step = True
        else:
            out += _part_chunks(part, f"{ui['id']}-{n}")
    if in_step:
        out.append({"type": "finish-step"})
    out.append({"type": "finish"} | ({"finishReason": finish_reason} if finish_reason else {}))
    return out


def _part_chunks(part: Msg, id_: str) -> list[Msg]:
    kind = part.get("type", "")
    passed = {k: part[k] for k in _PASSED if k in part}
    if kind in ("text", "reasoning") and isinstance(part.get("text"), str):
        return [{"type": f"{kind}-start", "id": id_, **passed}, {"type": f"{kind}-delta", "id": id_, "delta": part["text"]}, {"type": f"{kind}-end", "id": id_}]
    if kind == "dynamic-tool" or kind.startswith("tool-"):
        return _tool_chunks(part)
    if kind == "file" and isinstance(part.get("url"), str) and isinstance(part.get("mediaType"), str):
        return [{"type": "file", "url": part["url"], "mediaType": part["mediaType"], **passed}]
    if kind == "source-url" and isinstance(part.get("sourceId"), str) and isinstance(part.get("url"), str):
        return [{k: v for k, v in part.items() if k in ("type", "sourceId", "url", "title", "providerMetadata")}]
    if kind == "source-document" and all(isinstance(part.get(k), str) for k in ("sourceId", "mediaType", "title")):
        return [{k: v for k, v in part.items() if k in ("type", "sourceId", "mediaType", "title", "filename", "providerMetadata")}]
    if kind.startswith("data-"):
        return [{k: v for k, v in part.items() if k in ("type", "id", "data")}]
    return []


def _tool_chunks(part: Msg) -> list[Msg]:
    dynamic = part["type"] == "dynamic-tool"
    name = part.get("toolName") if dynamic else part["type"].removeprefix("tool-")
    call = part.get("toolCallId")
    if not isinstance(call, str) or not isinstance(name, str):
        return []
    common: Msg = (
        {"toolCallId": call} | ({"dynamic": True} if dynamic else {}) | ({"providerExecuted": part["providerExecuted"]} if "providerExecuted" in part else {})
    )
    state = part.get("state")
    out: list[Msg] = [{"type": "tool-input-available", **common, "toolName": name, "input": part.get("input")}]
    if "callProviderMetadata" in part:
        out[0]["providerMetadata"] = part["callProviderMetadata"]
    if state == "output-available":
        out.append({"type": "tool-output-available", **common, "output": part.get("output")})
    elif state == "output-error":
        out.append({"type": "tool-output-error", **common, "errorText": str(part.get("errorText", ""))})
    elif state == "output-denied":
        out.append({"type": "tool-output-denied", "toolCallId": call})
    return out


def event(chunk: Any) -> bytes:
    """One server-sent event of the stream."""
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


DONE = b"data: [DONE]\n\n"

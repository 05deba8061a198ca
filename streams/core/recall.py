"""Semantic recall: which stored messages a request recalls, given how near each is to its
question, by Mastra's rules (`SemanticRecall` of `@mastra/core` 1.71.0, with the default
`topK` 4 and `messageRange` 1).

Why: the context holds the last turns; what was said fifty turns ago (or in another thread of
the same user) is found by meaning. Mastra embeds every saved message and, for each new user
message, hands the model the nearest ones with the messages around them. A team moving from
Mastra keeps that choice of rows here.

What it promises, the same as Mastra's for the same stored messages and scores
(tests/unit/test_recall.py holds it against Mastra's own processor):

- `question`: the text recall searches with: the last user message's (its `content` string,
  or its text parts joined by spaces); None, no recall.
- `recall`: from the scored matches (best first, `top_k` of them, those below `threshold`
  dropped), each match and `before`/`after` messages of its thread around it, but those the
  model's input holds already; split into the current thread's (added to its history, in
  their place) and other threads' (a system message, `remembered`).
- `remembered`: Mastra's system message of other threads' messages, to the byte (dates and
  times in UTC, as Mastra writes them on a server whose time zone is UTC).
- `embedded_text`: the text of a saved message that is embedded (Mastra's
  `extractTextContent`); None, the message is not embedded.
- `with_recalled`: the model's input with what was recalled in it, where Mastra puts it.

Pure functions: the embedding, the search and where the rows are kept are the shell's.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

Msg = dict[str, Any]
TOP_K, MESSAGE_RANGE = 4, 1  # Mastra's defaults
_ROLE_ORDER = {"system": 0, "user": 1, "assistant": 2, "tool": 3}
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


class Match(msgspec.Struct, frozen=True):
    """A stored message near the question: its id, its thread, how near (cosine, higher nearer)."""

    message_id: str
    thread_id: str
    score: float


class Recalled(msgspec.Struct, frozen=True):
    """What a request recalls: `own` the current thread's messages (in their stored order),
    `other` other threads' (for `remembered`), and the matches that chose them."""

    own: list[Msg]
    other: list[Msg]
    matches: list[Match]


def question(messages: list[Msg]) -> str | None:
    """Mastra's `extractUserQuery`: the text of the last user message that has one."""
    for m in reversed(messages):
        content = m.get("content") if m.get("role") == "user" else None
        if not isinstance(content, dict):
            continue
        if isinstance(content.get("content"), str) and content["content"]:
            return content["content"]
        parts = content.get("parts")
        text = " ".join(
            p["text"]
            for p in (parts if isinstance(parts, list) else [])
            if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) and p["text"]
        )
        if text:
            return text
    return None


def embedded_text(row: Msg) -> str | None:
    """What of a saved message is embedded, as Mastra's `processOutputResult` does: its
    `content` string, else its text parts joined by newlines; nothing of a system message, or
    of one without text."""
    if row.get("role") == "system":
        return None
    content = row.get("content")
    if isinstance(content, str):
        return content or None
    if not isinstance(content, dict):
        return None
    if isinstance(content.get("content"), str) and content["content"]:
        return content["content"]
    parts = content.get("parts")
    text = "\n".join(
        p["text"] if isinstance(p.get("text"), str) else ""
        for p in (parts if isinstance(parts, list) else [])
        if isinstance(p, dict) and p.get("type") == "text"
    )
    return text or None


def recall(
    matches: list[Match],
    threads: dict[str, list[Msg]],
    held: set[str],
    thread_id: str,
    top_k: int = TOP_K,
    before: int = MESSAGE_RANGE,
    after: int = MESSAGE_RANGE,
    threshold: float | None = None,
) -> Recalled:
    """The rows the best `top_k` of `matches` (best first) recall from `threads` (each
    thread's stored messages, in order): each match and up to `before` messages before it and
    `after` after it in its thread, none of `held` (the ids the model's input holds)."""
    chosen = [m for m in matches[:top_k] if threshold is None or m.score >= threshold]
    picked: dict[str, Msg] = {}
    for match in chosen:
        rows = threads.get(match.thread_id, [])
        at = next((i for i, row in enumerate(rows) if row.get("id") == match.message_id), None)
        if at is None:
            continue
        for row in rows[max(0, at - before) : at + after + 1]:
            picked.setdefault(row["id"], row)
    fresh = [row for row in picked.values() if row["id"] not in held]
    own_ids = {r["id"] for r in fresh if _thread(r, thread_id) == thread_id}
    own = [row for row in threads.get(thread_id, []) if row.get("id") in own_ids]
    other = [row for row in fresh if _thread(row, thread_id) != thread_id]
    return Recalled(own, other, chosen)


def _thread(row: Msg, current: str) -> str:
    return row.get("threadId") or current  # a row without one is the current thread's (Mastra's rule)


def _when(row: Msg) -> datetime:
    return datetime.fromisoformat(str(row.get("createdAt", "1970-01-01T00:00:00Z")).replace("Z", "+00:00"))


def _v1(rows: list[Msg]) -> list[tuple[Msg, str | list[Msg]]]:
    """Mastra's `convertToV1Messages`, as far as the remembered text reads it: each row as one
    or more (row, content) of the AI SDK 4 form, an assistant's text and tool calls cut into
    blocks and its tool results a `tool` message, and an array content combined into the
    previous message of its role (Mastra's `pushOrCombine`: the first one's time and thread)."""
    out: list[tuple[Msg, str | list[Msg]]] = []

    def push(row: Msg, content: str | list[Msg]) -> None:
        last = out[-1] if out else None
        role = row["role"]
        if (
            last is not None
            and last[0]["role"] == role
            and isinstance(last[1], list)
            and isinstance(content, list)
            and (role != "assistant" or not content or content[-1].get("type") != "tool-call")
        ):
            last[1].extend(content)
        else:
            out.append((row, content))

    for row in rows:
        content = row.get("content")
        if not isinstance(content, dict):
            continue
        parts = [p for p in content.get("parts") or [] if isinstance(p, dict)]
        files = [{"type": "file"} for _ in content.get("experimental_attachments") or []] + [{"type": "file"} for p in parts if p.get("type") == "file"]
        if row.get("role") == "user":
            texts = [{"type": "text", "text": p.get("text")} for p in parts if p.get("type") == "text"]
            given = texts + files
            one = len(given) == 1 and given[0]["type"] == "text" and "content" in content
            push(row, content["content"] if one else given)
        elif row.get("role") == "assistant":
            for role, said in _assistant(parts):
                push({**row, "role": role}, said)
    return out


def _assistant(parts: list[Msg]) -> list[tuple[str, str | list[Msg]]]:
    """An assistant's parts in blocks, as Mastra's `convertToV1Messages` cuts them: a block
    ends at text after tool calls, or at a tool call after text or of another step; each
    block an assistant message (its one text alone a string) and its answered calls a `tool`
    message."""
    out: list[tuple[str, str | list[Msg]]] = []
    block: list[Msg] = []
    step, calls = 0, False

    def flush() -> None:
        said: list[Msg] = []
        for part in block:
            if part.get("type") in ("text", "file"):
                said.append(part)
            elif part.get("type") == "reasoning":
                said.extend({"type": "reasoning"} for _ in part.get("details") or [])
            elif (part.get("toolInvocation") or {}).get("toolName") != "updateWorkingMemory":
                said.append({"type": "tool-call"})
        out.append(("assistant", said[0].get("text", "") if len(said) == 1 and said[0].get("type") == "text" else said))
        if results := [p for p in block if p.get("type") == "tool-invocation" and _result(p.get("toolInvocation") or {})]:
            out.append(("tool", [{"type": "tool-result"} for _ in results]))

    for part in parts:
        kind = part.get("type")
        if (
            kind == "tool-invocation"
            and (any(p.get("type") in ("text", "file", "reasoning") for p in block) or ((part.get("toolInvocation") or {}).get("step") or 0) != step)
            or (kind == "text" and calls)
        ):
            flush()
            block, step, calls = [], step + 1, False
        if kind in ("text", "file", "reasoning", "tool-invocation"):
            block.append(part)
            calls = calls or kind == "tool-invocation"
    flush()
    return out


def _result(call: Msg) -> bool:
    return call.get("toolName") != "updateWorkingMemory" and call.get("state") == "result" and "result" in call


def remembered(rows: list[Msg], current: str) -> str:
    """Mastra's `formatCrossThreadMessages`: other threads' recalled messages, by time, each
    with its day and time, in one system message."""
    ordered = sorted(
        rows,
        key=lambda r: (_when(r), r.get("threadId") or "", _ROLE_ORDER.get(r.get("role", ""), 99), r.get("id") or ""),
    )
    out, last_day = "", None
    for row, content in _v1(ordered):
        when = _when(row)
        day = f"{when.year}, {_MONTHS[when.month - 1]}, {when.day}"
        clock = f"{when.hour % 12 or 12}:{when.minute:02d} {'AM' if when.hour < 12 else 'PM'}"
        if day != last_day:
            out += f"\nthe following messages are from {day}\n"
        source = "from previous conversation" if row.get("threadId") and row["threadId"] != current else ""
        role = str(row.get("role", ""))
        text = content if isinstance(content, str) else " ".join("" if p.get("text") is None else str(p["text"]) for p in content if p.get("type") == "text")
        out += f"Message {source} at {clock}: {role[:1].upper() + role[1:]}: {text}"
        last_day = day
    return (
        "The following messages were remembered from a different conversation:\n"
        f"<remembered_from_other_conversation>\n{out}\n<end_remembered_from_other_conversation>"
    )


def with_recalled(context: list[Msg], recalled: Recalled, current: str) -> list[Msg]:
    """The model's input: `context` with the recalled rows where Mastra puts them. Other
    threads' rows are one system message (`remembered`) after the context's own system
    messages; the current thread's are history older than the context's rows (they were not
    in it), so they come first of the conversation, in their stored order."""
    lead = 0
    while lead < len(context) and context[lead].get("role") == "system":
        lead += 1
    memory: list[Msg] = []
    if recalled.other:
        text = remembered(recalled.other, current)
        memory.append({"role": "system", "content": {"format": 2, "parts": [{"type": "text", "text": text}], "content": text}})
    return [*context[:lead], *memory, *recalled.own, *context[lead:]]

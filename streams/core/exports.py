"""Threads from the exports teams already have, as the rows the product stores (`memfilter history import`).

A team adopting the product brings months of conversations, in one of two shapes, JSON lines:

- **Mastra's storage**, as a storage export gives its tables: a row of `mastra_threads`
  (`{"id", "resourceId", "title", "metadata", "createdAt", "updatedAt"}`) or of
  `mastra_messages` (`{"id", "thread_id", "content", "role", "type", "createdAt",
  "resourceId"}`, `content` the message's JSON as a string, or already an object), one per
  line, in any order. A message row is read as Mastra's own storage reads it
  (`parseStoredMessage` in `@mastra/core` 1.71.0): `content` parsed, a plain string made a
  text part, `thread_id` becoming `threadId`; a thread's messages are in `createdAt` order,
  as Mastra lists them, and its resource is its thread row's (a message naming another is an
  error);
  With working memory on (MEMFILTER_WORKING_MEMORY), Mastra's stored documents come too, from
  where Mastra keeps them: a row of `mastra_resources` (`{"id", "workingMemory", ...}`) for
  scope `resource`, brought by the first of the resource's threads in the export (a resource
  with none there is a problem: no thread of it carries it in), or a thread row's
  `metadata.workingMemory` for scope `thread`;
- **AI SDK UI messages**, one thread per line: `{"threadId", "resourceId", "messages": [...]}`,
  the messages as `useChat` holds them (or already stored ones), converted exactly as the
  processor converts a request's (`memfilter.core.ui`), in the order given; a message's date
  is its `createdAt`, else its `metadata.createdAt` (where Mastra's UI messages carry it).

What comes out is a thread's rows as the processor would have stored them, in order: each a
Mastra DB message (format 2) with its `id`, `threadId` and `resourceId`, `createdAt` where the
export has one (`with_created_at` fills the others). System messages are left out: the
processor never stores them. Every problem is reported by thread and line, and the thread is
not imported; the others are. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from memfilter.core import ui
from memfilter.core.filter import iso_ms, parse_ms
from memfilter.schemas.wire import Message, id_problem

_MESSAGE = msgspec.json.Decoder(Message)


@dataclass
class ImportedThread:
    thread: str
    resource: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # why it cannot be imported (empty: it can)
    lines: list[int] = field(default_factory=list)  # of the export, for the problems
    working_memory: str | None = None  # a working memory document its event brings (Mastra's, as stored)


def read_export(lines: Iterable[bytes], memory: Literal["off", "resource", "thread"] = "off") -> list[ImportedThread]:
    """The threads of an export (either shape, or both, line by line), in order of first
    mention; with working memory of `memory`'s scope, each with the document it brings."""
    threads: dict[str, ImportedThread] = {}
    mastra: dict[str, list[tuple[int, dict[str, Any]]]] = {}  # thread -> (line, message row)
    documents: dict[str, tuple[int, str]] = {}  # resource or thread -> (line, its working memory)
    bad: list[str] = []

    def thread_of(tid: Any, line: int) -> ImportedThread | None:
        if not isinstance(tid, str) or not tid:
            bad.append(f"line {line}: no thread id")
            return None
        if problem := id_problem(tid):
            bad.append(f"line {line}: the thread id {problem}")
            return None
        t = threads.setdefault(tid, ImportedThread(tid, None))
        t.lines.append(line)
        return t

    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            value = msgspec.json.decode(raw)
        except msgspec.DecodeError as e:
            bad.append(f"line {n}: not JSON ({e})")
            continue
        if not isinstance(value, dict):
            bad.append(f"line {n}: a JSON object per line, not {type(value).__name__}")
        elif isinstance(value.get("messages"), list):  # AI SDK UI messages of one thread
            if (t := thread_of(value.get("threadId"), n)) is not None:
                _own(t, value.get("resourceId"), n)
                for i, m in enumerate(value["messages"]):
                    _add(t, _from_ui(m, f"line {n}: messages[{i}]", t), f"line {n}: messages[{i}]")
        elif "thread_id" in value:  # a row of mastra_messages
            if (t := thread_of(value["thread_id"], n)) is not None:
                mastra.setdefault(t.thread, []).append((n, value))
        elif "resourceId" in value and "role" not in value:  # a row of mastra_threads
            if (t := thread_of(value.get("id"), n)) is not None:
                _own(t, value.get("resourceId"), n)
                if memory == "thread" and isinstance(document := _metadata(value).get("workingMemory"), str):
                    documents[t.thread] = (n, document)
        elif "workingMemory" in value and isinstance(value.get("id"), str):  # a row of mastra_resources
            if memory == "resource" and isinstance(value["workingMemory"], str):
                documents[value["id"]] = (n, value["workingMemory"])
        else:
            bad.append(f"line {n}: neither a Mastra thread or message row nor a thread of UI messages")
    for tid, rows in mastra.items():
        t = threads[tid]
        for n, row in sorted(rows, key=lambda r: (parse_ms(r[1].get("createdAt")) or 0, r[0])):  # Mastra lists by createdAt
            _add(t, _from_mastra(row, f"line {n}", t), f"line {n}")
    for t in threads.values():
        if t.resource is None:
            t.problems.append("no resource: a Mastra thread row (its resourceId) or a UI export's resourceId names it")
        seen: set[str] = set()
        for row in t.rows:
            if row["id"] in seen:
                t.problems.append(f"message id {row['id']} appears twice")
            seen.add(row["id"])
    for owner, (n, document) in documents.items():  # each document on the first thread that is its own
        carrier = threads.get(owner) if memory == "thread" else next((t for t in threads.values() if t.resource == owner), None)
        if carrier is None:
            bad.append(f"line {n}: the working memory of resource {owner}: no thread of it in the export brings it in")
        else:
            carrier.working_memory = document
    if bad:
        threads.setdefault("", ImportedThread("", None, problems=bad))
    return list(threads.values())


def _metadata(row: dict[str, Any]) -> dict[str, Any]:
    """A thread row's metadata: an object, or its JSON as a string (as Mastra's SQL stores keep it)."""
    metadata = row.get("metadata")
    if isinstance(metadata, str):
        try:
            metadata = msgspec.json.decode(metadata)
        except msgspec.DecodeError:
            return {}
    return metadata if isinstance(metadata, dict) else {}


def with_created_at(rows: list[dict[str, Any]], stored: dict[str, dict[str, Any]], now_ms: int, newest_ms: int | None) -> list[dict[str, Any]]:
    """The rows with a `createdAt` each: a row the export gave none takes the stored row's of
    the same id (an import again writes the same bytes), else the import's time, one
    millisecond apart and after the thread's newest row, as the processor dates new messages."""
    ms = max(now_ms, (newest_ms or -1) + 1)
    out = []
    for row in rows:
        if "createdAt" not in row:
            earlier = stored.get(row["id"], {}).get("createdAt")
            if earlier is None:
                earlier, ms = iso_ms(ms), ms + 1
            row = {**row, "createdAt": earlier}
        out.append(row)
    return out


def _own(t: ImportedThread, resource: Any, line: int) -> None:
    if not isinstance(resource, str) or not resource:
        t.problems.append(f"line {line}: no resourceId")
    elif problem := id_problem(resource):
        t.problems.append(f"line {line}: the resourceId {problem}")
    elif t.resource is None:
        t.resource = resource
    elif t.resource != resource:
        t.problems.append(f"line {line}: resource {resource!r}, but the thread is {t.resource!r}'s")


def _from_mastra(row: dict[str, Any], where: str, t: ImportedThread) -> dict[str, Any] | None:
    """A `mastra_messages` row as Mastra's storage reads it (`parseStoredMessage`)."""
    rest = {k: v for k, v in row.items() if k not in ("resourceId", "content", "role", "thread_id")}
    content = row.get("content")
    if isinstance(content, str):
        try:
            content = msgspec.json.decode(content)
        except msgspec.DecodeError:
            pass  # a plain string: Mastra makes it a text part
    if isinstance(content, str):
        content = {"format": 2, "content": content, "parts": [{"type": "text", "text": content}]}
    message = {**rest, "threadId": t.thread, "content": content, "role": row.get("role")}
    if row.get("resourceId"):
        if t.resource is not None and row["resourceId"] != t.resource:
            t.problems.append(f"{where}: message {row.get('id')} names resource {row['resourceId']!r}, the thread is {t.resource!r}'s")
        message["resourceId"] = row["resourceId"]
    elif t.resource is not None:
        message["resourceId"] = t.resource
    return message


def _from_ui(m: Any, where: str, t: ImportedThread) -> dict[str, Any] | None:
    if not isinstance(m, dict):
        t.problems.append(f"{where}: a message is a JSON object")
        return None
    try:
        stored = ui.to_stored(m, where) if ui.is_ui(m) else dict(m)
    except ui.NotConvertible as e:
        t.problems.append(str(e))
        return None
    created = m.get("metadata", {}).get("createdAt") if isinstance(m.get("metadata"), dict) else None
    if "createdAt" not in stored and parse_ms(created) is not None:  # where Mastra's UI messages keep it
        stored["createdAt"] = created
    stored.setdefault("threadId", t.thread)
    if t.resource is not None:
        stored.setdefault("resourceId", t.resource)
    return stored


def _add(t: ImportedThread, message: dict[str, Any] | None, where: str) -> None:
    """Check the message as the processor checks a request's, and keep it (not a system one)."""
    if message is None:
        return
    try:
        typed = _MESSAGE.decode(msgspec.json.encode(message))
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        t.problems.append(f"{where}: not a stored message ({e})")
        return
    if typed.id is msgspec.UNSET:
        t.problems.append(f"{where}: no id; an imported message keeps the id its clients know it by")
    elif typed.threadId is not msgspec.UNSET and typed.threadId != t.thread:
        t.problems.append(f"{where}: message {typed.id} names thread {typed.threadId!r}")
    elif typed.resourceId is not msgspec.UNSET and t.resource is not None and typed.resourceId != t.resource:
        t.problems.append(f"{where}: message {typed.id} names resource {typed.resourceId!r}, the thread is {t.resource!r}'s")
    elif typed.role != "system":
        t.rows.append(message)

"""The memory input filter: what one chat request may contribute to its thread.

Chat clients (the AI SDK's `useChat` and the like) send the whole conversation on every
request, and what they echo back drifts from what was stored: provider metadata is lost, text
is re-trimmed, clocks are skewed, a client may even "answer" a tool call that never asked.
Stored history is the truth. So for each request this module decides, from the request and a
view of its thread's stored history, what the request may contribute:

- new trailing user messages (everything after the last assistant message);
- client tool outcomes (results, errors, denials, approval answers) for tool calls that the
  stored copy still has pending, and only when they advance the stored state;
- the whole input, provider metadata stripped, as the seed of an empty thread;
- nothing, for a pure echo of a stored assistant turn.

Wherever a kept message has the id of a stored message, the stored copy goes on instead of the
echo, with at most the advancing tool outcomes applied. The rules, with the places where they
deliberately differ from Mastra's `MemoryInputFilter`, are in `docs/filter.md`.

This is the functional core: pure functions of (request bytes or request, `StoredView`, record
timestamp) to a `Decision`. No I/O. `lookup_ids` says which stored rows a decision needs to
see, so the stream layer fetches them in one round trip. Messages are the dicts msgspec
decoded (see `schemas.wire`); nothing here mutates them, so every key this module does not
interpret passes through as it came.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Any

import msgspec

from schemas.wire import ChatRequest, Dropped, validate_messages

Msg = dict[str, Any]

CLIENT_OUTCOME_STATES = frozenset({"approval-responded", "result", "output-error", "output-denied"})
TERMINAL_STATES = frozenset({"result", "output-error", "output-denied"})
ID_NAMESPACE = uuid.UUID("8f4c1c4e-51a2-4d39-9a43-6d0f2b6c9e11")


class Rejected(Exception):
    """A request refused as a whole: it goes to the dead-letter topic, nothing is saved."""

    def __init__(self, type: str, message: str):
        super().__init__(message)
        self.type = type
        self.message = message


class Rejection(msgspec.Struct):
    type: str  # a stable code: decode, schema, key-mismatch, thread-mismatch, ownership, ...
    message: str  # for a person: names the thing and the fix


class Limits(msgspec.Struct, frozen=True):
    max_bytes: int = 1 << 20
    max_messages: int = 1000


class StoredView(msgspec.Struct):
    """What a decision sees of storage: the thread, and the ids its request names."""

    rows: dict[str, Msg]  # stored copies, in this thread, of the request's message ids
    elsewhere: dict[str, str]  # request message id -> the other thread that stores it
    owner: str | None = None  # resourceId owning the thread (recorded, else of its rows)
    size: int = 0  # rows the thread holds; 0 is an empty thread
    newest_ms: int | None = None  # newest createdAt among the thread's rows, epoch ms


class Decision(msgspec.Struct):
    outcome: str  # a FilteredInput outcome, or "rejected"
    messages: list[Msg]
    dropped: list[Dropped]
    persist: list[Msg]
    error: Rejection | None = None


# ---- decoding and validation (the edge of the core) -------------------------------------


def decode_request(raw: bytes, limits: Limits = Limits()) -> ChatRequest:
    """Decode and validate one `chat-requests` value; raise `Rejected` naming what is wrong."""
    if len(raw) > limits.max_bytes:
        raise Rejected("too-large", f"request is {len(raw)} bytes; the limit is {limits.max_bytes} (MEMFILTER_MAX_BYTES)")
    try:
        request = msgspec.json.decode(raw, type=ChatRequest)
    except msgspec.ValidationError as e:
        raise Rejected("schema", f"request does not match ChatRequest: {e}") from None
    except msgspec.DecodeError as e:
        raise Rejected("decode", f"request is not JSON: {e}") from None
    if len(request.messages) > limits.max_messages:
        raise Rejected(
            "too-large",
            f"request has {len(request.messages)} messages; the limit is {limits.max_messages} (MEMFILTER_MAX_MESSAGES)",
        )
    check_messages(request.messages)
    return request


def check_messages(messages: list[Msg]) -> None:
    """Schema checks of messages beyond their types: tool parts complete, ids unique."""
    try:
        validate_messages(messages)
    except msgspec.ValidationError as e:
        raise Rejected("schema", f"messages do not match Message: {str(e).replace('$', 'messages')}") from None
    seen = set()
    for i, m in enumerate(messages):
        for j, part in enumerate(m["content"]["parts"]):
            if part["type"] == "tool-invocation" and "toolInvocation" not in part:
                raise Rejected("schema", f"messages[{i}].content.parts[{j}] is a tool-invocation without toolInvocation")
        mid = m.get("id")
        if mid is not None and m["role"] != "system":
            if mid in seen:
                raise Rejected("schema", f"message id {mid} appears twice in the request; each message needs its own id")
            seen.add(mid)


def check_key(request: ChatRequest, key: str | None) -> None:
    if key is not None and key != request.threadId:
        raise Rejected("key-mismatch", f"record key {key!r} is not the request's threadId {request.threadId!r}; key records by thread id")


def check_thread(request: ChatRequest) -> None:
    """Every message that names a thread or resource names the request's own."""
    for i, m in enumerate(request.messages):
        for field, want in (("threadId", request.threadId), ("resourceId", request.resourceId)):
            got = m.get(field)
            if got is not None and got != want:
                raise Rejected(
                    "thread-mismatch",
                    f"messages[{i}] has {field} {got!r} but the request is for {field} {want!r}",
                )


def check_storage(request: ChatRequest, view: StoredView, ids: list[str]) -> None:
    """The checks that need the stored view: ownership, then ids stored in other threads."""
    if view.owner is not None and view.owner != request.resourceId:
        raise Rejected(
            "ownership",
            f"thread {request.threadId} belongs to resource {view.owner}; request from {request.resourceId} rejected",
        )
    for mid in ids:
        other = view.elsewhere.get(mid)
        if other is not None and mid not in view.rows:
            raise Rejected(
                "foreign-message-id",
                f"message id {mid} is stored in thread {other}; thread {request.threadId} cannot reuse it (give the message a new id)",
            )


def lookup_ids(request: ChatRequest, request_id: str) -> list[str]:
    """The message ids whose stored copies (here or in other threads) a decision needs:
    the ids the client sent, and the ids the server gives the messages it sent without."""
    return [m["id"] for m in with_ids(request, request_id) if m["role"] != "system"]


def with_ids(request: ChatRequest, request_id: str) -> list[Msg]:
    """The request's messages, each conversation message without an id given one that is
    the same whenever the same request is decided again (so a replay finds it stored)."""
    return [
        m
        if "id" in m or m["role"] == "system"
        else {**m, "id": str(uuid.uuid5(ID_NAMESPACE, f"{request.threadId}\n{request_id}\n{pos}"))}
        for pos, m in enumerate(request.messages)
    ]


# ---- tool-invocation states --------------------------------------------------------------


def _invocation(part: Msg) -> Msg | None:
    return part.get("toolInvocation") if part.get("type") == "tool-invocation" else None


def is_client_outcome(part: Msg) -> bool:
    inv = _invocation(part)
    return inv is not None and inv.get("state") in CLIENT_OUTCOME_STATES


def advances(stored_part: Msg, incoming_state: str) -> bool:
    """May a client outcome in `incoming_state` replace this stored tool part's state?"""
    inv = stored_part["toolInvocation"]
    state = inv.get("state")
    if state in TERMINAL_STATES:
        return False
    if incoming_state == "approval-responded":
        return state == "approval-requested"
    if stored_part.get("providerExecuted") or inv.get("providerExecuted"):
        return False  # the provider, not the client, produces this call's result
    return incoming_state in TERMINAL_STATES


def apply_outcomes(stored: Msg, parts: list[Msg]) -> Msg | None:
    """The stored row with the client outcomes among `parts` applied, or None if none advance.

    Only `state` and whichever of `result`, `errorText`, `approval` the outcome carries are
    taken from the input; every other key of the stored part and its invocation stays.
    """
    stored_parts = stored["content"]["parts"]
    new_parts: list[Msg] | None = None
    for part in parts:
        if not is_client_outcome(part):
            continue
        inv = part["toolInvocation"]
        for pos, current in enumerate(new_parts or stored_parts):
            cur_inv = _invocation(current)
            if cur_inv is None or cur_inv.get("toolCallId") != inv["toolCallId"]:
                continue
            if not advances(current, inv["state"]):
                continue
            updated_inv = {**cur_inv, "state": inv["state"]}
            for key in ("result", "errorText", "approval"):
                if key in inv:
                    updated_inv[key] = inv[key]
            new_parts = new_parts or list(stored_parts)
            new_parts[pos] = {**current, "toolInvocation": updated_inv}
    if new_parts is None:
        return None
    return {**stored, "content": {**stored["content"], "parts": new_parts}}


# ---- the filter ------------------------------------------------------------------------


def _with_parts(message: Msg, parts: list[Msg]) -> Msg:
    return {**message, "content": {**message["content"], "content": "", "parts": parts}}


def _trailing_outcomes(message: Msg) -> list[Msg]:
    """Client tool outcomes at the end of a message's parts, skipping `data-*` parts."""
    run = []
    for part in reversed(message["content"]["parts"]):
        if part["type"].startswith("data-"):
            continue
        if not is_client_outcome(part):
            break
        run.append(part)
    run.reverse()
    return run


def _strip_provider_metadata(message: Msg) -> Msg:
    """An assistant message as a seed: provider item references removed, outcomes kept."""
    if message["role"] != "assistant":
        return message
    content = {k: v for k, v in message["content"].items() if k != "providerMetadata"}
    content["parts"] = [
        p
        if is_client_outcome(p)
        else {k: v for k, v in p.items() if k not in ("providerMetadata", "providerOptions")}
        for p in content["parts"]
    ]
    return {**message, "content": content}


def _select(messages: list[Msg], retain_full: bool, view: StoredView) -> tuple[str, dict[int, Msg]]:
    """The outcome, and the messages kept (by input position) before the base layer."""
    conversation = [i for i, m in enumerate(messages) if m["role"] != "system"]
    if not conversation:
        return "empty", {}
    whole = {i: messages[i] for i in conversation}
    if retain_full:
        return "retain-full-input", whole
    last = conversation[-1]
    tail = messages[last]
    if tail["role"] not in ("user", "assistant"):
        return "unchanged", whole

    boundary = None
    run: list[Msg] = []
    if tail["role"] == "user":
        boundary = next((i for i in reversed(conversation) if messages[i]["role"] == "assistant"), None)
        if boundary is None:
            return "unchanged", whole
    else:
        run = _trailing_outcomes(tail)

    if view.size == 0:
        return "seeded", {i: _strip_provider_metadata(m) for i, m in whole.items()}

    if boundary is not None:
        kept = {i: messages[i] for i in conversation if i > boundary}
        answered = messages[boundary]
        stored = view.rows.get(answered["id"])
        if stored is not None:
            outcomes = [
                p for p in answered["content"]["parts"] if is_client_outcome(p) and apply_outcomes(stored, [p]) is not None
            ]
            if outcomes:
                kept[boundary] = _with_parts(answered, outcomes)
        return "user-tail", kept

    if run:
        return "tool-outcomes", {last: _with_parts(tail, run)}
    if tail["id"] in view.rows:
        return "stored-echo-dropped", {}
    return "unpersisted-assistant-kept", whole


def decide(request: ChatRequest, view: StoredView, *, request_id: str, timestamp_ms: int) -> Decision:
    """The filter's decision for one validated request against its thread's stored view."""
    messages = with_ids(request, request_id)
    try:
        check_thread(request)
        check_storage(request, view, [m["id"] for m in messages if m["role"] != "system"])
    except Rejected as e:
        return Decision("rejected", [], [], [], error=Rejection(e.type, e.message))

    outcome, kept = _select(messages, request.retainFullInput, view)
    clock = _Clock(timestamp_ms, view.newest_ms)
    out: list[Msg] = []
    persist: list[Msg] = []
    for pos, message in enumerate(messages):
        if message["role"] == "system":
            out.append(message)
            continue
        keep = kept.get(pos)
        if keep is None:
            continue
        stored = view.rows.get(keep["id"])
        if stored is not None:  # the base layer: the stored copy goes on
            updated = apply_outcomes(stored, keep["content"]["parts"])
            out.append(updated or stored)
            row = updated and _saveable(updated)
        else:
            new = _complete(keep, request, clock)
            out.append(new)
            row = _saveable(new)
        if row:
            persist.append(row)
    return Decision(outcome, out, _dropped(request.messages, out, view, outcome), persist)


def _dropped(messages: list[Msg], out: list[Msg], view: StoredView, outcome: str) -> list[Dropped]:
    kept_ids = {m.get("id") for m in out}
    dropped: list[Dropped] = []
    for m in messages:
        mid = m.get("id")
        if mid is None or mid in kept_ids:
            continue
        kept_ids.add(mid)
        if mid in view.rows:
            reason = "echo of a stored message"
        elif outcome == "stored-echo-dropped":
            reason = "the request ends in a stored assistant turn"
        else:
            reason = "before the kept tail and never stored"
        dropped.append(Dropped(mid, reason))
    return dropped


def _complete(message: Msg, request: ChatRequest, clock: _Clock) -> Msg:
    """A new message as it is saved: createdAt, threadId and resourceId where missing."""
    new = dict(message)
    if "createdAt" not in new:
        new["createdAt"] = clock.next()
    new.setdefault("threadId", request.threadId)
    new.setdefault("resourceId", request.resourceId)
    return new


def _saveable(row: Msg) -> Msg | None:
    """The row as saved: `partial-call` tool parts removed; None if no part is left."""
    parts = row["content"]["parts"]
    kept = [p for p in parts if (_invocation(p) or {}).get("state") != "partial-call"]
    if not kept:
        return None
    if len(kept) == len(parts):
        return row
    return {**row, "content": {**row["content"], "parts": kept}}


class _Clock:
    """createdAt for new messages: from the record timestamp, after the thread's newest row,
    strictly increasing within the request."""

    def __init__(self, timestamp_ms: int, newest_ms: int | None):
        self.ms = timestamp_ms if newest_ms is None else max(timestamp_ms, newest_ms + 1)

    def next(self) -> str:
        value, self.ms = self.ms, self.ms + 1
        return iso_ms(value)


def iso_ms(ms: int) -> str:
    seconds, millis = divmod(ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def parse_ms(created_at: Any) -> int | None:
    """An ISO-8601 createdAt as epoch milliseconds; None when it is not a timestamp."""
    if not isinstance(created_at, str):
        return None
    try:
        dt = datetime.fromisoformat(created_at)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)

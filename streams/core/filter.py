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
echo, with at most the advancing tool outcomes applied. The rules, and where they deliberately
differ from Mastra's `MemoryInputFilter`, are in `docs/filter.md`.

With the decision comes the model's `context`: the request's system messages, a window of the
conversation's last rows with the request's updates in place, then what else the request
contributes; the window is chosen by `memfilter.core.window`, by rows and, with a budget, by
tokens (`docs/agent.md`).

This is the functional core: pure functions from (request bytes, `StoredView`, record
timestamp) to a `Decision`; no I/O. `lookup_ids` says which stored rows a decision needs, and
`window_reach` where the context's window must start, so the stream layer fetches them in its
batch's round trips.

How messages are held, for speed and losslessness: a request is decoded twice from its bytes,
once typed (`Message` Structs: validated, read by the rules) and once as raw JSON per message
(`msgspec.Raw`: passed on untouched). Only a message that goes on changed (a new message
getting its id, a trimmed tool-outcome message, a seed) is decoded to a dict and edited, and a
stored row is decoded only when a client outcome may apply to it; an unchanged stored row goes
on as the bytes that were stored. Nothing here mutates what it was given.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import sys
import time
from datetime import UTC, datetime
from typing import Any

import msgspec
from msgspec import UNSET

from memfilter.core import tokens, ui, window
from memfilter.schemas.wire import (
    TURN_POLICIES,
    ChatRequestOf,
    Content,
    Dropped,
    EitherMessage,
    Id,
    Message,
    MessagesOf,
    Part,
    RequestId,
    TurnPolicy,
    id_problem,
)

Msg = dict[str, Any]

CLIENT_OUTCOME_STATES = frozenset({"approval-responded", "result", "output-error", "output-denied"})
TERMINAL_STATES = frozenset({"result", "output-error", "output-denied"})
# The tool-invocation states in order (spec section 2): a stored invocation never goes down.
STATE_RANKS = {"partial-call": 0, "call": 1, "approval-requested": 2, "approval-responded": 3, **dict.fromkeys(TERMINAL_STATES, 4)}
# The rows of the conversation the model's context holds by default (Mastra's `lastMessages`).
HISTORY_MESSAGES = 10
# Stack frames a value accepted at the edge leaves free (see `decode_json`).
DEPTH_HEADROOM = 200

_TYPED = msgspec.json.Decoder(ChatRequestOf[Message])
_RAW = msgspec.json.Decoder(MessagesOf[msgspec.Raw])  # after _TYPED: the messages as they came
_EITHER = msgspec.json.Decoder(ChatRequestOf[EitherMessage])
_MESSAGE = msgspec.json.Decoder(Message)
_EITHER_MESSAGE = msgspec.json.Decoder(EitherMessage)


class Rejected(Exception):
    """A request refused as a whole: it goes to the dead-letter topic, nothing is saved."""

    def __init__(self, type: str, message: str, decoded: Any = None):
        super().__init__(message)
        self.type = type
        self.message = message
        self.decoded = decoded  # of a `schema` rejection by `decode_json`: the value, decoded untyped


class Rejection(msgspec.Struct):
    type: str  # a stable code: decode, schema, key-mismatch, thread-mismatch, ownership, ...
    message: str  # for a person: names the thing and the fix


class Limits(msgspec.Struct, frozen=True):
    max_bytes: int = 1 << 20
    max_messages: int = 1000


class Policy(msgspec.Struct, frozen=True):
    """How requests are decided, the same wherever they are (the worker, `replay`, `explain`):
    what a request may be (`limits`), how many rows of the conversation the model's context
    carries (`history`), within how many tokens (`budget`, none by default), and whether a
    regenerate or an edit supersedes stored rows (`edits`), and whether an erased thread may
    be started again by a new conversation's first request (`reopen_erased`, off by default)."""

    limits: Limits = Limits()
    history: int = HISTORY_MESSAGES
    edits: bool = True
    budget: window.Budget | None = None
    reopen_erased: bool = False
    turns: TurnPolicy = "concurrent"  # a request while a reply is being made (`_check_turn`)
    turn_wait_ms: int = 120_000  # how long after its request a reply counts as being made


class Request(msgspec.Struct):
    """A decoded, validated chat request: its messages typed, and as sent. The typed parts of
    the messages before its last assistant message are released once decoded (`_release`):
    read a message's parts with `parts_of`."""

    shape: ChatRequestOf[Message]
    raw: list[msgspec.Raw]
    request_id: str  # as sent, else the id the edge derived (from the record's position)
    ids: list[str | None]  # each message's id by position (see `message_ids`)
    conversation: list[int]  # positions of its conversation (not system) messages
    named: list[str]  # their ids, in order (`lookup_ids`)
    ui: frozenset[int] = frozenset()  # positions of the messages sent as UI messages (`raw` holds them as sent)


class StoredView(msgspec.Struct):
    """What a decision sees of storage: the thread, and the ids its request names."""

    rows: dict[str, bytes]  # stored JSON, in this thread, of (at least) the request's message ids
    elsewhere: dict[str, str]  # request message id -> what names the other thread that stores it (others may be there too)
    owner: str | None = None  # resourceId owning the thread (recorded, else of its rows)
    size: int = 0  # rows the thread holds; 0 is an empty thread
    newest_ms: int | None = None  # newest createdAt among the thread's rows, epoch ms
    # The ids of the conversation's last rows, in order (their rows in `rows`): at least the
    # last `history` of `decide`, and from the first of the request's ids stored here on.
    tail: list[str] = []
    # Ids of rows a regenerate or an edit took out of the conversation (still stored here, never
    # in `tail`): at least those of the request's ids.
    superseded: frozenset[str] = frozenset()
    decoded: dict[str, Msg] = {}  # rows decoded so far (see `row`)
    counts: dict[str, float] = {}  # token counts stored beside rows (`memfilter.core.tokens`), where read
    erased: bool = False  # the thread was erased (`memfilter forget`) and not started again since
    replying: str | None = None  # the request whose reply is being made (its save not applied yet)
    replying_ms: int = 0  # that request's record time, epoch ms
    waiting: int = 0  # requests of the thread waiting for their turn (MEMFILTER_CONCURRENT_TURNS enqueue, interrupt)

    def row(self, mid: str) -> Msg:
        row = self.decoded.get(mid)
        if row is None:
            row = self.decoded[mid] = msgspec.json.decode(self.rows[mid])
        return row


class Decision(msgspec.Struct):
    outcome: str  # a FilteredInput outcome, or "rejected"
    messages: list[Any]  # dicts, or a stored row's JSON (msgspec.Raw) where it goes on unchanged
    dropped: list[Dropped]
    persist: list[Msg]  # whole rows to save
    context: list[Any] = []  # the model's input (`memfilter.core.window`); like `messages`, dicts or stored JSON
    superseded: list[str] = []  # ids of the rows the request takes out of the conversation (`_action`)
    error: Rejection | None = None
    fit: window.Window | None = None  # how the context's window was chosen (its tokens, with a budget)
    wait: TurnPolicy | None = None  # `enqueue` or `interrupt`: not decided yet, it waits for its turn (`_check_turn`)

    def counts(self, counter: tokens.Counter) -> list[float]:
        """The token count of each row to save, in `persist`'s order (counted once: the window
        counted those it weighed)."""
        known = self.fit.counts if self.fit is not None else {}
        return [known[row["id"]] if row["id"] in known else counter.message(row) for row in self.persist]


# ---- decoding and validation (the edge of the core) -------------------------------------


def decode_json(decoder: msgspec.json.Decoder, raw: bytes | None, what: str, shape: str, fallback: msgspec.json.Decoder | None = None) -> Any:
    """Decode one topic value (`what`, of type `shape`) with `decoder`, else with `fallback`
    if given; raise `Rejected` naming what is wrong.

    Everything a record can hold is checked here, once, so that nothing later (deciding,
    encoding, packing rows for Redis, a downstream consumer) meets a value it cannot handle:
    - a null value (a tombstone) is `decode`;
    - the whole value must be UTF-8 (RFC 8259), strictly: msgspec checks only the strings it
      reads, and passes the ones it skips or keeps raw on as they came;
    - nesting is bounded: msgspec guards its recursion with Python's recursion limit, so the
      decode runs with DEPTH_HEADROOM frames less than the interpreter allows. A value accepted
      here can then be decoded or encoded again by any later step that runs up to that many
      frames deeper, which every step of the worker, `explain` and `history show` does. (With
      the default recursion limit, about 750 levels of nesting pass; deeper is `decode`.)
    - shape errors are `schema`, malformed JSON is `decode`."""
    if raw is None:
        raise Rejected("decode", f"{what} is null (a tombstone); send a JSON object")
    try:
        raw.isascii() or raw.decode()  # ASCII is UTF-8: checked without making a str
    except UnicodeDecodeError as e:
        raise Rejected("decode", f"{what} is not UTF-8: byte {e.start} ({raw[e.start : e.start + 1]!r}); encode it as UTF-8") from None
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(limit - DEPTH_HEADROOM)  # (inline, not a context manager: every request pays for it)
    try:
        try:
            return decoder.decode(raw)
        except msgspec.DecodeError as e:
            shape_error = str(e)
        if fallback is not None:
            try:
                return fallback.decode(raw)
            except msgspec.DecodeError:
                pass
        decoded = msgspec.json.decode(raw)  # a shape error can stop the decoder before malformed JSON
    except RecursionError:
        raise Rejected("decode", f"{what} nests JSON too deeply; flatten it (about 750 levels at most)") from None
    except msgspec.DecodeError as e:
        raise Rejected("decode", f"{what} is not JSON: {e}") from None
    finally:
        sys.setrecursionlimit(limit)
    raise Rejected("schema", f"{what} does not match {shape}: {_named(shape_error, decoded)}", decoded)


_AT = re.compile(r" - at `\$((?:\.[^.\[`]+|\[\d+\])*)`$")


def _named(error: str, decoded: Any) -> str:
    """msgspec's shape error, the path without its `$.`; for an id (`Id`), what is wrong with
    it in words rather than the rule's regular expression."""
    at = _AT.search(error)
    if at is None:
        return error
    path = at.group(1).removeprefix(".")
    value = decoded
    try:
        for key, index in re.findall(r"\.?([^.\[]+)|\[(\d+)\]", at.group(1)):
            value = value[int(index)] if index else value[key]
    except (KeyError, IndexError, TypeError):
        value = None
    kind = RequestId if path.endswith("requestId") else Id
    problem = id_problem(value, kind) if isinstance(value, str) and error.startswith("Expected `str` ") else None
    return f"`{path}` {problem}" if problem else error.replace("`$.", "`")


def decode_request(raw: bytes | None, default_id: str, limits: Limits = Limits(), id_key: bytes = b"") -> Request:
    """Decode and validate one `chat-requests` value; raise `Rejected` naming what is wrong.

    `default_id` is the request id when the request has none: the edge derives it from the
    record's source position, so a replay of the record gets the same one. `id_key` is the
    deployment's secret (MEMFILTER_SECRET), from which ids of messages sent without one are
    made (see `message_ids`)."""
    if raw is not None and len(raw) > limits.max_bytes:
        raise Rejected("too-large", f"request is {len(raw)} bytes; the limit is {limits.max_bytes} (MEMFILTER_MAX_BYTES)")
    try:
        shape = decode_json(_TYPED, raw, "request", "ChatRequest", fallback=_EITHER)
        messages, at = _RAW.decode(raw).messages, frozenset()
        if shape.messages and type(shape.messages[0]) is EitherMessage:  # UI messages among them
            view = _typed_view(shape)
            if view is None:  # a shape only the whole conversion names: below, with the request's error
                decode_json(_TYPED, raw, "request", "ChatRequest")
            shape, at = view
    except Rejected as e:
        if e.type != "schema":
            raise
        (shape, messages), at = _converted_whole(e), frozenset()
    if len(shape.messages) > limits.max_messages:
        raise Rejected(
            "too-large",
            f"request has {len(shape.messages)} messages; the limit is {limits.max_messages} (MEMFILTER_MAX_MESSAGES)",
        )
    request_id = shape.requestId or default_id
    ids, conversation, named = message_ids(shape, request_id, id_key)
    _release(shape)
    return Request(shape, messages, request_id, ids, conversation, named, at)


class _Released(list):
    """The parts of a message whose typed parts `decode_request` released: reading them is a
    bug, loud here rather than an empty list; `parts_of` reads them again from the message's bytes."""

    def _refuse(self, *_):
        raise AssertionError("a released message's parts were read: read them with memfilter.core.filter.parts_of")

    __getitem__ = __iter__ = __len__ = __reversed__ = __contains__ = _refuse


RELEASED = Content(2, _Released())


def _release(shape: ChatRequestOf[Message]) -> None:
    """Release the typed parts of the messages before the last assistant message, now, while
    they are fresh in the CPU's caches. A useChat echo's older messages are most of a request
    (about 15 objects each), and a decision reads the parts of its last assistant message and
    what follows only (`_select`), except for outcomes that keep stored messages before it,
    which read them again (`parts_of`). Timed inside the worker (benchmarks/worker_throughput.py),
    freeing its requests at the end of a batch took 22 µs a request, 12.5 with this."""
    messages = shape.messages
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), 0)
    for i in range(last):
        messages[i].content = RELEASED


def parts_of(request: Request, pos: int) -> list[Part]:
    """The typed parts of the request's message at `pos`: as decoded, or decoded again from
    the message's bytes if they were released (`_release`)."""
    content = request.shape.messages[pos].content
    if content is not RELEASED:
        return content.parts
    if pos in request.ui:
        view = ui.typed(_EITHER_MESSAGE.decode(request.raw[pos]))
        assert view is not None  # it had a typed view when the request was decoded
        return view.content.parts
    return _MESSAGE.decode(request.raw[pos]).content.parts


def _typed_view(either: ChatRequestOf[EitherMessage]) -> tuple[ChatRequestOf[Message], frozenset[int]] | None:
    """The typed view of a request with UI messages among its messages, and their positions
    (`Request.ui`: each is converted only if it goes on, `_as_dict`); None when a UI message
    needs the whole conversion (`_converted_whole`) to name what is wrong with it."""
    typed, at = [], set()
    for i, m in enumerate(either.messages):
        if isinstance(m.content, Content):
            typed.append(Message(m.role, m.content, m.id, m.createdAt, m.threadId, m.resourceId, m.type))
            continue
        view = ui.typed(m)
        if view is None:
            return None
        typed.append(view)
        at.add(i)
    return msgspec.structs.replace(either, messages=typed), frozenset(at)


def _converted_whole(error: Rejected) -> tuple[ChatRequestOf[Message], list[msgspec.Raw]]:
    """A request whose messages do not all have the stored shape, the slow way: its UI
    messages converted whole (`memfilter.core.ui`), then the request decoded as one in the stored
    shape, so that an error names where the client sent what is wrong. `error` (the request's
    schema error) goes up as it is when no message is a UI message."""
    request = error.decoded
    messages = request.get("messages") if isinstance(request, dict) else None
    kinds = [isinstance(m, dict) and ui.is_ui(m) for m in messages] if isinstance(messages, list) else []
    if not any(kinds):
        raise error
    try:
        request["messages"] = [ui.to_stored(m, f"messages[{i}]") if is_ui else m for i, (m, is_ui) in enumerate(zip(messages, kinds))]
    except ui.NotConvertible as e:
        raise Rejected("schema", f"request does not match ChatRequest: {e}") from None
    converted = msgspec.json.encode(request)
    try:
        return _TYPED.decode(converted), _RAW.decode(converted).messages
    except msgspec.ValidationError as e:
        named = _named(str(e), request)
        if match := re.search(r"messages\[(\d+)\]\.content\.parts\[", named):
            if kinds[int(match.group(1))]:  # where the client sent it
                named = named.replace(".content.parts[", ".parts[", 1)
        raise Rejected("schema", f"request does not match ChatRequest: {named}") from None


def check_key(thread: str, key: bytes | None) -> None:
    """A record's key is its value's thread id, byte for byte: a thread's records then share
    one partition, and so one worker, in order."""
    if key is None:
        raise Rejected("key-mismatch", f"record has no key; key records by thread id ({thread!r})")
    if key != thread.encode():
        raise Rejected("key-mismatch", f"record key {key!r} is not the threadId {thread!r}; key records by thread id")


def _check_thread(shape: ChatRequestOf[Message]) -> None:
    """Every message that names a thread or resource names the request's own."""
    thread, resource = shape.threadId, shape.resourceId
    for i, m in enumerate(shape.messages):
        if m.threadId is not UNSET and m.threadId != thread:
            raise Rejected("thread-mismatch", f"messages[{i}] has threadId {m.threadId!r} but the request is for thread {thread!r}")
        if m.resourceId is not UNSET and m.resourceId != resource:
            raise Rejected("thread-mismatch", f"messages[{i}] has resourceId {m.resourceId!r} but the request is from resource {resource!r}")


def _check_storage(shape: ChatRequestOf[Message], view: StoredView, ids: list[str | None], reopen_erased: bool = False) -> None:
    """The checks that need the stored view: erasure, ownership, then ids stored in other threads."""
    if view.erased:
        _check_erased(shape, reopen_erased)
    if view.owner is not None and view.owner != shape.resourceId:
        raise Rejected("ownership", f"thread {shape.threadId} belongs to resource {view.owner}; request from {shape.resourceId} rejected")
    if not view.elsewhere:  # the usual case: no id of the request is stored anywhere else
        return
    for mid in ids:
        if mid is not None and mid in view.elsewhere and mid not in view.rows:
            raise Rejected(
                "foreign-message-id",
                f"message id {mid} is stored in another thread; thread {shape.threadId} cannot reuse it (give the message a new id)",
            )


def reply_pending(replying_ms: int | None, now_ms: int, wait_ms: int) -> bool:
    """Is a reply being made at `now_ms` (epoch ms): asked for by a request of record time
    `replying_ms` (None: no reply asked for and not saved yet) less than `wait_ms` before, so
    that a runner that died holds no thread for ever? The one rule of the turn check, the
    processor's wakes and the worker's sweep."""
    return replying_ms is not None and now_ms - replying_ms < wait_ms


# Requests one thread keeps waiting for their turn at most: one more is refused `busy-thread`,
# so that a client sending on and on while a reply streams cannot grow its thread without bound.
MAX_WAITING = 16


def _check_turn(request: Request, view: StoredView, timestamp_ms: int, turns: TurnPolicy, wait_ms: int) -> TurnPolicy | None:
    """What a request does that arrives while the reply to an earlier request of its thread is
    being made (`view.replying`: decided, asked for an answer, its reply not saved yet, and
    decided less than `wait_ms` before this one by record time, so that a runner that died does
    not hold the thread for ever), or while earlier requests of its thread wait (`view.waiting`):
    None, decided at once on the history as it stands (`concurrent`, or nothing to wait for);
    `enqueue`, it waits for that reply's save; `interrupt`, the same once the reply is stopped
    (the caller stops it); `reject`, refused (`busy-thread`), to send again once the reply ends.
    The request may ask for a stricter policy than the deployment's, never a looser one. A
    request that arrives behind waiting ones waits behind them, so that the thread's turns
    keep their order; behind MAX_WAITING of them, it is refused."""
    asked = request.shape.concurrentTurns
    if asked is not UNSET and TURN_POLICIES.index(asked) > TURN_POLICIES.index(turns):
        turns = asked
    if turns == "concurrent":  # the usual case: nothing to look at
        return None
    busy = reply_pending(view.replying_ms if view.replying is not None else None, timestamp_ms, wait_ms)
    if not (busy or view.waiting):
        return None
    if turns != "reject" and view.waiting < MAX_WAITING:
        return turns if busy and not view.waiting else "enqueue"  # behind others: the reply being made is theirs to stop
    behind = f"is answering request {view.replying}" if turns == "reject" and busy else f"has {view.waiting} requests waiting for their turn"
    raise Rejected(
        "busy-thread",
        f"thread {request.shape.threadId} {behind}; request {request.request_id} refused (concurrent turns: {turns}): send it again once that reply ends",
    )


def _check_erased(shape: ChatRequestOf[Message], reopen: bool) -> None:
    """An erased thread takes no request, unless the operator lets a new conversation start it
    again (MEMFILTER_REOPEN_ERASED): then only a first request, one user message (system
    messages aside), may. A stale browser tab re-sends the whole erased conversation: refused,
    never taken for the seed of an empty thread."""
    conversation = [m for m in shape.messages if m.role != "system"]
    if reopen and len(conversation) == 1 and conversation[0].role == "user":
        return
    if reopen:
        allowed = f"only a new conversation's first request (one user message) may start it again, not {len(conversation)} messages"
    else:
        allowed = "start a new thread"
    raise Rejected("erased", f"thread {shape.threadId} was erased (memfilter forget): its history is gone and it takes no more requests; {allowed}")


def message_ids(shape: ChatRequestOf[Message], request_id: str, id_key: bytes = b"") -> tuple[list[str | None], list[int], list[str]]:
    """Each message's id by position (None for system messages), the positions of the
    conversation's messages and their ids; raise `Rejected` if two conversation messages are
    sent with one id (the schema check beyond types). One pass, as every request pays for it.

    A conversation message sent without an id gets one that is the same whenever the same
    request is decided again, so a replay finds its own rows stored: a keyed hash
    (HMAC-SHA256 under the deployment's secret) of the thread, the request id and the
    position, as a UUID. Keyed, so that no client can compute the id another resource's next
    message will get and occupy it first."""
    ids: list[str | None] = []
    conversation: list[int] = []
    named: list[str] = []
    sent: set[str] = set()
    for pos, m in enumerate(shape.messages):
        if m.role == "system":
            ids.append(None)
            continue
        mid = m.id
        if mid is UNSET:
            digest = hmac.digest(id_key, f"{shape.threadId}\n{request_id}\n{pos}".encode(), hashlib.sha256)
            mid = _uuid4(digest)
        elif mid in sent:
            raise Rejected("schema", f"message id {mid} appears twice in the request; each message needs its own id")
        else:
            sent.add(mid)
        ids.append(mid)
        conversation.append(pos)
        named.append(mid)
    return ids, conversation, named


def _uuid4(digest: bytes) -> str:
    """`str(uuid.UUID(bytes=digest[:16], version=4))`, at a third of its cost: the version
    and variant bits set, then the hex in 8-4-4-4-12."""
    b = bytearray(digest[:16])
    b[6] = b[6] & 0x0F | 0x40
    b[8] = b[8] & 0x3F | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def lookup_ids(request: Request) -> list[str]:
    """The message ids whose stored copies (here or in other threads) a decision needs."""
    return request.named


def window_reach(request: Request, view: StoredView) -> list[str]:
    """The ids of the conversation's rows (stored here, not superseded) the request may keep,
    and its last message's if it may regenerate or edit: the context's window reaches back to
    the first of them (`memfilter.core.window`) and a regenerate or edit supersedes what follows the last,
    so the shell reads the thread's order from there before deciding."""
    shape = request.shape
    _, kept = _select(request, view, exact=False)
    reach = [request.ids[pos] for pos in kept]
    if shape.trigger is not UNSET:  # a regenerate or an edit supersedes what follows its last message
        reach.append(next((mid for mid in reversed(request.ids) if mid is not None), None))
    return [mid for mid in reach if mid in view.rows and mid not in view.superseded]


# ---- tool-invocation states --------------------------------------------------------------


def is_client_outcome(part: Part) -> bool:
    """A client tool outcome; a preliminary output (still streaming) is none."""
    inv = part.toolInvocation
    return part.type == "tool-invocation" and inv is not UNSET and inv.state in CLIENT_OUTCOME_STATES and inv.preliminary is not True


def _invocation(part: Msg) -> Msg | None:
    return part.get("toolInvocation") if part.get("type") == "tool-invocation" else None


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


def apply_outcomes(stored: Msg, outcomes: list[Part]) -> Msg | None:
    """The stored row with the client outcomes applied, or None if none advances it.

    Only `state` and whichever of `result`, `errorText`, `approval` the outcome carries are
    taken from the input; every other key of the stored part and its invocation stays.
    """
    stored_parts = stored["content"]["parts"]
    new_parts: list[Msg] | None = None
    for part in outcomes:
        inv = part.toolInvocation
        for pos, current in enumerate(new_parts or stored_parts):
            cur_inv = _invocation(current)
            if cur_inv is None or cur_inv.get("toolCallId") != inv.toolCallId or not advances(current, inv.state):
                continue
            updated_inv = {**cur_inv, "state": inv.state}
            for key in ("result", "errorText", "approval"):
                value = getattr(inv, key)
                if value is not UNSET:
                    updated_inv[key] = value
            new_parts = new_parts or list(stored_parts)
            new_parts[pos] = {**current, "toolInvocation": updated_inv}
    if new_parts is None:
        return None
    return {**stored, "content": {**stored["content"], "parts": new_parts}}


# ---- the filter ------------------------------------------------------------------------

# What is kept of a message, by input position: None for the whole message, or the indices
# of the parts kept (tool outcomes), with `content.content` emptied.
Kept = dict[int, "list[int] | None"]


def _trailing_outcomes(message: Message) -> list[int]:
    """Indices of the client tool outcomes ending a message, skipping `data-*` parts."""
    run = []
    parts = message.content.parts
    for j in range(len(parts) - 1, -1, -1):
        if parts[j].type.startswith("data-"):
            continue
        if not is_client_outcome(parts[j]):
            break
        run.append(j)
    run.reverse()
    return run


def _select(request: Request, view: StoredView, exact: bool = True) -> tuple[str, Kept]:
    """The outcome, and what is kept of which messages before the base layer. Not `exact`: a
    stored assistant message before a user tail is kept without reading whether the tail's
    echo advances it (a superset, for `window_reach`, that decodes no stored row)."""
    messages, ids, conversation = request.shape.messages, request.ids, request.conversation
    if not conversation:
        return "empty", {}
    if request.shape.retainFullInput:
        return "retain-full-input", dict.fromkeys(conversation)
    last = conversation[-1]
    tail = messages[last]
    if tail.role not in ("user", "assistant"):
        return "unchanged", dict.fromkeys(conversation)

    boundary = None
    run: list[int] = []
    if tail.role == "user":
        boundary = next((i for i in reversed(conversation) if messages[i].role == "assistant"), None)
        if boundary is None:
            return "unchanged", dict.fromkeys(conversation)
    else:
        run = _trailing_outcomes(tail)

    if view.size == 0:
        return "seeded", dict.fromkeys(conversation)

    if boundary is not None:
        kept: Kept = {i: None for i in conversation if i > boundary}
        if ids[boundary] in view.rows and not exact:
            kept[boundary] = None
        elif ids[boundary] in view.rows:
            stored = view.row(ids[boundary])
            parts = messages[boundary].content.parts
            outcomes = [j for j, p in enumerate(parts) if is_client_outcome(p) and apply_outcomes(stored, [p]) is not None]
            if outcomes:
                kept[boundary] = outcomes
        return "user-tail", kept

    if run:
        return "tool-outcomes", {last: run}
    if ids[last] in view.rows:
        return "stored-echo-dropped", {}
    return "unpersisted-assistant-kept", dict.fromkeys(conversation)


def decide(
    request: Request,
    view: StoredView,
    timestamp_ms: int,
    history: int = HISTORY_MESSAGES,
    edits: bool = True,
    budget: window.Budget | None = None,
    reopen_erased: bool = False,
    turns: TurnPolicy = "concurrent",
    turn_wait_ms: int = 120_000,
    woken: bool = False,
    memory: Msg | None = None,
) -> Decision:
    """The filter's decision for one validated request against its thread's stored view, with
    the model's context made of the last `history` rows of the conversation, within `budget`
    tokens if one is given (`memfilter.core.window`); a regenerate or an edit the request asks
    for, unless `edits` is off (MEMFILTER_EDITS); on an erased thread, a refusal unless
    `reopen_erased` lets a new conversation start it (`_check_erased`); while a reply is being
    made in the thread, what `turns` says (`_check_turn`), unless the request has waited for
    its turn already (`woken`). `memory`, a system message of working memory
    (`memfilter.core.working_memory.system_message`), goes into the context after the
    request's own system messages, and counts in the budget as they do."""
    shape = request.shape
    ids = request.ids
    try:
        _check_thread(shape)
        _check_storage(shape, view, ids, reopen_erased)
        wait = None if woken else _check_turn(request, view, timestamp_ms, turns, turn_wait_ms)
    except Rejected as e:
        return Decision("rejected", [], [], [], error=Rejection(e.type, e.message))
    if wait is not None:
        return Decision("waiting", [], [], [], wait=wait)

    outcome, kept = _select(request, view)
    superseded_kept: set[int] = set()
    if view.superseded:  # a superseded row is never a base layer again
        superseded_kept = {pos for pos in kept if ids[pos] in view.superseded}
        kept = {pos: parts for pos, parts in kept.items() if pos not in superseded_kept}
    action = _action(request, view) if edits else None
    superseding: list[str] = []
    last = -1
    if action is not None:
        outcome, last = action
        at = ids[last]
        superseding = view.tail[view.tail.index(at) + 1 :] if at in view.tail else []
    clock = _Clock(timestamp_ms, view.newest_ms)
    out: list[Any] = []
    persist: list[Msg] = []
    system: list[Any] = []
    contributed: list[tuple[str, Any]] = []  # (id, as the model sees it) of each kept conversation message
    for pos, message in enumerate(shape.messages):
        if message.role == "system":
            out.append(_as_dict(request, pos) if pos in request.ui else request.raw[pos])
            system.append(out[-1])
            continue
        if pos not in kept:
            continue
        part_indices = kept[pos]
        mid = ids[pos]
        if outcome == "edited" and pos == last:  # the stored row, with the content the user sent
            out.append({**view.row(mid), "content": _as_dict(request, pos)["content"]})
            row = out[-1]
        elif mid in view.rows:  # the base layer: the stored copy goes on
            sent = parts_of(request, pos)
            outcomes = [sent[j] for j in (part_indices or range(len(sent))) if is_client_outcome(sent[j])]
            updated = apply_outcomes(view.row(mid), outcomes) if outcomes else None
            out.append(updated or msgspec.Raw(view.rows[mid]))
            row = updated and _saveable(updated)
        else:
            new = _new_message(_as_dict(request, pos), mid, part_indices, outcome == "seeded", shape, clock)
            out.append(new)
            row = _saveable(new)
        if row:
            persist.append(row)
        contributed.append((mid, row or out[-1]))
    tail = [mid for mid in view.tail if mid not in superseding] if superseding else view.tail
    if memory is not None:
        system = [*system, memory]
    try:
        chosen = window.choose(contributed, tail, view.rows, history, budget, system, view.counts)
    except window.OverBudget as e:
        return Decision("rejected", [], [], [], error=Rejection("context-budget", str(e)))
    dropped = _dropped(shape, kept, superseded_kept, view, outcome)
    return Decision(outcome, out, dropped, persist, system + chosen.messages, superseding, fit=chosen)


def _action(request: Request, view: StoredView) -> tuple[str, int] | None:
    """The regenerate or edit the request asks for and may make, as (outcome, position of its
    last conversation message L): L must be a user message of the conversation (stored here,
    not superseded); `regenerate-message` regenerates the answer after it, `submit-message`
    with `messageId` naming L edits it if its parts differ from the stored ones. Everything
    after L in the conversation is superseded (`docs/regenerate-edit.md`)."""
    shape = request.shape
    if shape.trigger is UNSET:
        return None
    last = next((i for i in range(len(shape.messages) - 1, -1, -1) if shape.messages[i].role != "system"), None)
    if last is None or shape.messages[last].role != "user":
        return None
    mid = request.ids[last]
    if mid not in view.rows or mid in view.superseded or view.row(mid).get("role") != "user":
        return None
    if shape.trigger == "regenerate-message":
        return "regenerated", last
    if shape.messageId is not UNSET and shape.messageId == shape.messages[last].id:
        if _as_dict(request, last)["content"].get("parts") != view.row(mid).get("content", {}).get("parts"):
            return "edited", last
    return None


def _as_dict(request: Request, pos: int) -> Msg:
    """A message of the request as a dict in the stored form (a UI message converted)."""
    m = msgspec.json.decode(request.raw[pos])
    return ui.to_stored(m) if pos in request.ui else m


def _new_message(m: Msg, mid: str, part_indices: list[int] | None, seed: bool, shape: ChatRequestOf[Message], clock: _Clock) -> Msg:
    """A message not stored in this thread, as it goes on and is saved: trimmed to its kept
    outcomes, or stripped of provider metadata as a seed; id, createdAt, threadId and
    resourceId filled in where missing."""
    if part_indices is not None:
        parts = m["content"]["parts"]
        m = {**m, "content": {**m["content"], "content": "", "parts": [parts[j] for j in part_indices]}}
    elif seed and m["role"] == "assistant":
        m = _strip_provider_metadata(m)
    m.setdefault("id", mid)
    if "createdAt" not in m:
        m["createdAt"] = clock.next()
    m.setdefault("threadId", shape.threadId)
    m.setdefault("resourceId", shape.resourceId)
    return m


def _strip_provider_metadata(message: Msg) -> Msg:
    """An assistant message as a seed: provider item references removed, outcomes kept."""
    content = {k: v for k, v in message["content"].items() if k != "providerMetadata"}
    content["parts"] = [
        p
        if p.get("type") == "tool-invocation" and p["toolInvocation"].get("state") in CLIENT_OUTCOME_STATES
        else {k: v for k, v in p.items() if k not in ("providerMetadata", "providerOptions")}
        for p in content["parts"]
    ]
    return {**message, "content": content}


def _dropped(shape: ChatRequestOf[Message], kept: Kept, superseded: set[int], view: StoredView, outcome: str) -> list[Dropped]:
    """Every id the client sent that does not go on (ids are unique: see `message_ids`),
    and why; where `messageId` names one, why it was no edit."""
    if outcome == "stored-echo-dropped":
        unstored = "the request ends in a stored assistant turn"
    else:
        unstored = "before the kept tail and never stored"
    out = []
    for pos, m in enumerate(shape.messages):
        if pos in kept or m.id is UNSET or m.role == "system":
            continue
        if pos in superseded:
            reason = "superseded: a regenerate or an edit took it out of the conversation; it is not saved again"
        else:
            reason = "echo of a stored message" if m.id in view.rows else unstored
        if m.id == shape.messageId:
            reason += "; messageId names it, but only the request's last message, a user message of the conversation with new parts, is edited"
        out.append(Dropped(m.id, reason))
    return out


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
    return f"{_iso_seconds(seconds)}.{millis:03d}Z"


@functools.lru_cache(maxsize=256)
def _iso_seconds(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def parse_ms(created_at: Any) -> int | None:
    """An ISO-8601 createdAt as epoch milliseconds; None when it is not a timestamp."""
    if not isinstance(created_at, str):
        return None
    try:
        dt = datetime.fromisoformat(created_at)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)

"""`memfilter explain`: the filter's decision for a request and a history, without Kafka.

A case names a request and the stored history it meets (its thread's rows in saved order,
rows of other threads, the thread's owner, the record timestamp); the answer is what the
processor would emit and save. The worker decides with the same functions, so "what would
the processor do with this?" has one answer. The shapes are `Case` and `Explanation` below.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from memfilter.core.filter import HISTORY_MESSAGES, Limits, Policy, Rejected, Rejection, StoredView, decide, decode_request, parse_ms
from memfilter.core.tokens import COUNTERS
from memfilter.core.window import Budget, WindowRow, report
from memfilter.schemas.wire import Dropped


class StoredRow(msgspec.Struct):
    """What a view needs to know of a stored row besides its bytes."""

    id: str
    threadId: str | None = None
    resourceId: str | None = None
    createdAt: Any = None


class Case(msgspec.Struct):
    request: msgspec.Raw
    stored: list[msgspec.Raw] = []
    storedElsewhere: list[StoredRow] = []
    owner: str | None = None
    timestamp: int = 0
    historyMessages: int = HISTORY_MESSAGES  # N of the context's window (MEMFILTER_HISTORY_MESSAGES)
    superseded: list[str] = []  # ids of `stored` rows superseded already
    edits: Literal["on", "off"] = "on"  # MEMFILTER_EDITS
    contextTokens: int | None = None  # the context's token budget (MEMFILTER_CONTEXT_TOKENS); none by default
    tokenCounter: Literal["estimate", "o200k"] = "estimate"  # MEMFILTER_TOKEN_COUNTER
    contextNoHistory: Literal["send", "refuse"] = "send"  # MEMFILTER_CONTEXT_NO_HISTORY


class Explanation(msgspec.Struct, omit_defaults=True):
    outcome: str
    messages: list[Any]
    dropped: list[Dropped]
    persist: list[dict[str, Any]]
    context: list[Any]
    superseded: list[str]
    error: Rejection | None = None
    contextTokens: float | None = None  # with a budget: the context's total
    window: list[WindowRow] | None = None  # with a budget: every stored row, oldest first, and why it is in or out
    historyLeftOut: bool = False  # with a budget: no stored history fits, not even its newest whole turn (the filtered input's `historyLeftOut`)


class UnusableInput(Exception):
    """The command's own input is not a case or a list of cases (exit 2)."""


_ROW = msgspec.json.Decoder(StoredRow)


def view_of(thread_id: str, case: Case) -> StoredView:
    """The stored view a worker would fetch from Redis, built from the case's rows."""
    try:
        heads = [_ROW.decode(raw) for raw in case.stored]
    except msgspec.DecodeError as e:
        raise UnusableInput(f"a stored row is not a message with an id: {e}") from None
    owner = case.owner or next((h.resourceId for h in heads if h.resourceId), None)
    stamps = [ms for ms in (parse_ms(h.createdAt) for h in heads) if ms is not None]
    return StoredView(
        rows={h.id: bytes(raw) for h, raw in zip(heads, case.stored)},
        elsewhere={r.id: r.threadId for r in case.storedElsewhere if r.threadId not in (None, thread_id)},
        owner=owner,
        size=len(heads),
        newest_ms=max(stamps, default=None),
        tail=[h.id for h in heads if h.id not in case.superseded],
        superseded=frozenset(case.superseded),
    )


def policy_of(case: Case) -> Policy:
    """The case's policy: its context's size and budget, its edits setting, the default limits."""
    budget = Budget(case.contextTokens, COUNTERS[case.tokenCounter], case.contextNoHistory) if case.contextTokens else None
    return Policy(Limits(), case.historyMessages, case.edits == "on", budget)


def explain_case(case: Case, position: int = 0, id_key: bytes = b"") -> Explanation:
    policy = policy_of(case)
    try:
        request = decode_request(bytes(case.request), f"explain-0-{position}", policy.limits, id_key)
    except Rejected as e:
        return Explanation("rejected", [], [], [], [], [], error=Rejection(e.type, e.message))
    view = view_of(request.shape.threadId, case)
    d = decide(request, view, case.timestamp, policy.history, policy.edits, policy.budget)
    explanation = Explanation(d.outcome, d.messages, d.dropped, d.persist, d.context if d.error is None else [], d.superseded, error=d.error)
    if policy.budget is not None and d.fit is not None:
        explanation.contextTokens = d.fit.tokens
        explanation.historyLeftOut = d.fit.left_out
        explanation.window = report(d.fit, list(view.rows), [*view.superseded, *d.superseded], view.rows, policy.budget)  # rows in saved order
    return explanation


def explain(raw: bytes, id_key: bytes = b"") -> bytes:
    """One case object or a JSON array of them in; the answer (or answers) out, as JSON.
    `id_key` (MEMFILTER_SECRET, when set) makes the ids of messages sent without one the ones
    a worker of that deployment would give them."""
    try:
        doc = msgspec.json.decode(raw, type=Case | list[Case])
    except RecursionError:
        raise UnusableInput("input nests JSON too deeply") from None
    except msgspec.ValidationError as e:
        raise UnusableInput(f"input is not an explain case or a list of cases: {e}") from None
    except msgspec.DecodeError as e:
        raise UnusableInput(f"input is not JSON: {e}") from None
    if isinstance(doc, list):
        return msgspec.json.encode([explain_case(c, i, id_key) for i, c in enumerate(doc)])
    return msgspec.json.encode(explain_case(doc, 0, id_key))

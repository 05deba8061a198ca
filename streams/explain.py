"""`memfilter explain`: the filter's decision for a request and a history, without Kafka.

A case names a request and the stored history it meets (its thread's rows in saved order,
rows of other threads, the thread's owner, the record timestamp); the answer is what the
processor would emit and save. The worker decides with the same functions, so "what would
the processor do with this?" has one answer. Shapes: `docs/explain.md`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.wire import Dropped
from streams.filter import Decision, Limits, Rejected, Rejection, StoredView, decide, decode_request, lookup_ids, parse_ms

Msg = dict[str, Any]


class Case(msgspec.Struct):
    request: msgspec.Raw
    stored: list[Msg] = []
    storedElsewhere: list[Msg] = []
    owner: str | None = None
    timestamp: int = 0


class Explanation(msgspec.Struct, omit_defaults=True):
    outcome: str
    messages: list[Msg]
    dropped: list[Dropped]
    persist: list[Msg]
    error: Rejection | None = None


class UnusableInput(Exception):
    """The command's own input is not a case or a list of cases (exit 2)."""


def view_of(thread_id: str, ids: list[str], case: Case) -> StoredView:
    """The stored view a worker would fetch from Redis, built from the case's rows."""
    by_id = {row.get("id"): row for row in case.stored}
    owner = case.owner
    if owner is None:
        owner = next((row["resourceId"] for row in case.stored if row.get("resourceId")), None)
    elsewhere = {
        row["id"]: row["threadId"]
        for row in case.storedElsewhere
        if row.get("id") in ids and row.get("threadId") not in (None, thread_id)
    }
    stamps = [ms for ms in (parse_ms(row.get("createdAt")) for row in case.stored) if ms is not None]
    return StoredView(
        rows={i: by_id[i] for i in ids if i in by_id},
        elsewhere=elsewhere,
        owner=owner,
        size=len(case.stored),
        newest_ms=max(stamps, default=None),
    )


def explain_case(case: Case, position: int = 0) -> Explanation:
    try:
        request = decode_request(bytes(case.request), Limits())
    except Rejected as e:
        return _rejection(e)
    request_id = request.requestId or f"explain-0-{position}"
    view = view_of(request.threadId, lookup_ids(request, request_id), case)
    return _explanation(decide(request, view, request_id=request_id, timestamp_ms=case.timestamp))


def _rejection(e: Rejected) -> Explanation:
    return Explanation("rejected", [], [], [], error=Rejection(e.type, e.message))


def _explanation(d: Decision) -> Explanation:
    return Explanation(d.outcome, d.messages, d.dropped, d.persist, error=d.error)


def explain(raw: bytes) -> bytes:
    """One case object or a JSON array of them in; the answer (or answers) out, as JSON."""
    try:
        doc = msgspec.json.decode(raw, type=Case | list[Case])
    except msgspec.ValidationError as e:
        raise UnusableInput(f"input is not an explain case or a list of cases: {e}") from None
    except msgspec.DecodeError as e:
        raise UnusableInput(f"input is not JSON: {e}") from None
    if isinstance(doc, list):
        return msgspec.json.encode([explain_case(c, i) for i, c in enumerate(doc)])
    return msgspec.json.encode(explain_case(doc))

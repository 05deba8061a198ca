"""Benchmark: one whole filter decision against the floor of msgspec decode + encode.

The case is the realistic heavy one: a `useChat` full echo of a 20-turn tool-using thread (40
messages, a client result for the pending call, one new user message) against its stored
history. The decision is everything the worker does per request on the CPU once Redis has
answered: decode and validate the request, take the stored rows as Redis returns them (one
JSON value each; the filter decodes only those a client outcome may change), decide, encode
the FilteredInput and PersistMessages values. The floor, measured in the same run on the same
bytes, is bare `msgspec.json.decode` + `encode` of the request and of every row. The same case
is timed again with the request in AI SDK UI messages (as `useChat` sends it, converted on the
way in: `streams/ui.py`), side by side: the UI form should cost at most 1.5x the stored form.

    .venv/bin/python benchmarks/filter_decision.py [--seconds 3]
"""

from __future__ import annotations

import argparse
import time

import msgspec

from benchmarks.sample_threads import echo_of, stored_thread
from memfilter.core.filter import StoredView, decide, decode_request, lookup_ids
from memfilter.core.ui import to_ui
from memfilter.schemas.wire import FilteredInput, PersistMessages, Source

THREAD, RESOURCE = "t-bench", "r-bench"


def make_case(turns: int, ui: bool = False) -> tuple[bytes, dict[str, bytes]]:
    """The request's bytes (its messages as UI messages with `ui`), and the thread's rows by id
    as the history store returns them."""
    rows = stored_thread(THREAD, RESOURCE, turns)
    messages = echo_of(rows)
    if ui:
        messages = [to_ui(m) for m in messages]
    request = {"requestId": "req-bench", "threadId": THREAD, "resourceId": RESOURCE, "messages": messages}
    return msgspec.json.encode(request), {r["id"]: msgspec.json.encode(r) for r in rows}


def decision(raw_request: bytes, rows: dict[str, bytes], size: int) -> tuple[bytes, bytes]:
    request = decode_request(raw_request, "chat-requests-0-0")
    request_id = request.request_id
    view = StoredView(rows={i: rows[i] for i in lookup_ids(request) if i in rows}, elsewhere={}, owner=RESOURCE, size=size)
    d = decide(request, view, 1772366400000)
    filtered = FilteredInput(request_id, THREAD, RESOURCE, d.outcome, d.messages, d.dropped, Source("chat-requests", 0, 0), size)
    persisted = PersistMessages(request_id, THREAD, RESOURCE, d.persist)
    return msgspec.json.encode(filtered), msgspec.json.encode(persisted)


def floor(raw_request: bytes, rows: dict[str, bytes], size: int) -> None:
    msgspec.json.encode(msgspec.json.decode(raw_request))
    for raw in rows.values():
        msgspec.json.encode(msgspec.json.decode(raw))


def rate(fn, args, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(100):
            fn(*args)
        n += 100
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement (each is taken 3 times, best kept)")
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    cases = {form: make_case(args.turns, ui=form == "UI") for form in ("stored", "UI")}
    cases = {form: (raw_request, raw_rows, len(raw_rows)) for form, (raw_request, raw_rows) in cases.items()}
    for form, (raw_request, raw_rows, _) in cases.items():
        filtered, persisted = decision(*cases[form])
        print(
            f"case ({form} form): {args.turns} turns, request {len(raw_request)} B, {len(raw_rows)} stored rows {sum(map(len, raw_rows.values()))} B, "
            f"outcome {msgspec.json.decode(filtered)['outcome']}, filtered-input {len(filtered)} B, persist {len(persisted)} B"
        )
    best = dict.fromkeys(["floor", "stored", "UI"], 0.0)
    for _ in range(3):  # interleaved, so all see the same machine state
        best["floor"] = max(best["floor"], rate(floor, cases["stored"], args.seconds))
        for form in ("stored", "UI"):
            best[form] = max(best[form], rate(decision, cases[form], args.seconds))
    print(f"floor (msgspec decode+encode):  {best['floor']:10,.0f} /s  {1e6 / best['floor']:7.1f} us")
    print(f"decision, stored form:          {best['stored']:10,.0f} /s  {1e6 / best['stored']:7.1f} us")
    print(f"decision, UI messages:          {best['UI']:10,.0f} /s  {1e6 / best['UI']:7.1f} us")
    print(f"decision time / floor time:     {best['floor'] / best['stored']:10.2f}x (stored form)")
    print(f"UI form / stored form:          {best['stored'] / best['UI']:10.2f}x (goal: at most 1.5x)")


if __name__ == "__main__":
    main()

"""Properties of the filter over thousands of generated threads and requests.

A generated world is a thread's stored rows (user and assistant turns with tool calls in every
state, unknown keys and part types everywhere), some rows of other threads, and a request that
echoes the thread the way clients do (text re-trimmed, metadata lost, tool states "advanced"
by the client, foreign ids, new messages with and without ids). Storage is simulated by
`Thread`, the pure-core stand-in for the Redis history: rows by id in save order.
"""

from __future__ import annotations

import copy
import os

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from memfilter.core.filter import TERMINAL_STATES, Decision, Request, StoredView, advances, decide, decode_request, lookup_ids, parse_ms

# Examples per property: 500 in the suite (a few minutes of both cores on a slow day), more for
# a thorough run: MEMFILTER_PROPERTY_EXAMPLES=5000 .venv/bin/python -m pytest tests/unit -n 2
EXAMPLES = settings(max_examples=int(os.environ.get("MEMFILTER_PROPERTY_EXAMPLES", "500")), deadline=None)
STATES = ["partial-call", "call", "approval-requested", "approval-responded", "result", "output-error", "output-denied"]
OUTCOME_KEYS = {"state", "result", "errorText", "approval"}

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=4))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=4)
extra_keys = st.dictionaries(st.sampled_from(["x-a", "x-b", "custom", "annotations"]), json_value, max_size=2)


@st.composite
def tool_part(draw, call_id: str, states=STATES):
    inv = {"state": draw(st.sampled_from(states)), "toolCallId": call_id, "toolName": "t", "args": {"n": draw(st.integers(0, 3))}}
    if inv["state"] in TERMINAL_STATES:
        inv["result"] = draw(json_leaf)
    if inv["state"].startswith("approval"):
        inv["approval"] = {"id": "ap-" + call_id, "approved": draw(st.booleans())}
    inv.update(draw(extra_keys))
    part = {"type": "tool-invocation", "toolInvocation": inv, **draw(extra_keys)}
    if draw(st.booleans()):
        part["providerMetadata"] = {"openai": {"itemId": "fc_" + call_id}}
    if draw(st.integers(0, 5)) == 0:
        part["providerExecuted"] = True
    return part


@st.composite
def other_part(draw):
    kind = draw(st.sampled_from(["text", "reasoning", "step-start", "data-progress", "source", "x-unknown"]))
    part = {"type": kind, **draw(extra_keys)}
    if kind == "text":
        part["text"] = draw(st.text(max_size=6))
    if draw(st.booleans()):
        part["providerMetadata"] = {"openai": {"itemId": draw(st.text(max_size=3))}}
    return part


@st.composite
def message(draw, role: str, mid: str | None, thread: str, resource: str, stored: bool):
    if role == "assistant":
        n_tools = draw(st.integers(0, 3))
        parts = draw(st.lists(other_part(), max_size=3)) + [draw(tool_part(f"{mid}-c{i}")) for i in range(n_tools)]
        parts = draw(st.permutations(parts)) if parts else [{"type": "step-start"}]
    else:
        parts = [{"type": "text", "text": draw(st.text(max_size=8))}]
    content = {"format": 2, "parts": list(parts), **draw(extra_keys)}
    if role == "assistant" and draw(st.booleans()):
        content["providerMetadata"] = {"openai": {"responseId": "r"}}
    m = {"role": role, "content": content, **draw(extra_keys)}
    if mid is not None:
        m["id"] = mid
    if stored or draw(st.booleans()):
        m["createdAt"] = f"2026-03-01T10:{draw(st.integers(0, 59)):02d}:00.000Z"
    if stored:
        m.update(threadId=thread, resourceId=resource, type="v2")
    return m


@st.composite
def echo_of(draw, row: dict) -> dict:
    """What a client sends back for a stored row: drifted, metadata lost, states moved on."""
    m = {"id": row["id"], "role": row["role"], "content": {"format": 2, "parts": []}}
    for part in row["content"]["parts"]:
        part = {k: v for k, v in part.items() if k != "providerMetadata"}
        if part["type"] == "tool-invocation" and draw(st.booleans()):
            part = draw(tool_part(part["toolInvocation"]["toolCallId"], STATES[3:]))
        if part["type"] == "text" and draw(st.booleans()):
            part = {**part, "text": part["text"] + " "}
        m["content"]["parts"].append(part)
    if draw(st.integers(0, 4)) == 0:
        m["content"]["parts"].append(draw(tool_part("echo-new")))
    return m


@st.composite
def world(draw):
    thread, resource = "t1", draw(st.sampled_from(["r1", "r1", "r1", "r2"]))
    n = draw(st.integers(0, 8))
    stored = [draw(message("user" if i % 2 == 0 else "assistant", f"s{i}", thread, "r1", True)) for i in range(n)]
    elsewhere = [draw(message("user", f"e{i}", "t9", "r1", True)) | {"threadId": "t9"} for i in range(2)]
    cut = draw(st.integers(0, n))
    messages = [draw(echo_of(row)) for row in stored[:cut]]
    for i in range(draw(st.integers(0, 3))):
        role = draw(st.sampled_from(["user", "user", "assistant", "system", "signal"]))
        mid = draw(st.sampled_from([None, f"n{i}", f"n{i}", "e0"]))
        messages.append(draw(message(role, mid, thread, resource, False)))
    request = {"requestId": "req-1", "threadId": thread, "resourceId": resource, "messages": messages}
    if draw(st.integers(0, 6)) == 0:
        request["retainFullInput"] = True
    return request, stored, elsewhere


class Thread:
    """Simulated storage of one thread and its neighbours, as the Redis store keeps it."""

    def __init__(self, rows, elsewhere):
        self.rows = {r["id"]: r for r in rows}
        self.elsewhere = {r["id"]: r["threadId"] for r in elsewhere}

    def view(self, request: Request) -> StoredView:
        ids = lookup_ids(request)
        stamps = [parse_ms(r.get("createdAt")) for r in self.rows.values()]
        owner = next(iter(self.rows.values()))["resourceId"] if self.rows else None
        return StoredView(
            rows={i: msgspec.json.encode(self.rows[i]) for i in ids if i in self.rows},
            elsewhere={i: self.elsewhere[i] for i in ids if i in self.elsewhere},
            owner=owner,
            size=len(self.rows),
            newest_ms=max((s for s in stamps if s is not None), default=None),
        )

    def save(self, rows):
        for row in rows:
            self.rows[row["id"]] = row


def decision_json(request: dict, thread: Thread) -> bytes:
    req = decode_request(msgspec.json.encode(request), "chat-requests-0-0")
    return msgspec.json.encode(decide(req, thread.view(req), 1772366400000))


def decide_bytes(request: dict, thread: Thread) -> Decision:
    """The decision for `request` against `thread`, as JSON values (as consumers see it)."""
    return msgspec.json.decode(decision_json(request, thread), type=Decision)


def valid(request: dict) -> bool:
    try:
        decode_request(msgspec.json.encode(request), "q")
    except Exception:
        return False
    return True


def changed_only_by_advancing_outcomes(before: dict, after: dict) -> bool:
    """`after` is `before` but for tool parts whose state a client outcome advanced (and,
    in a saved row, `partial-call` parts removed)."""
    if len(before["content"]["parts"]) != len(after["content"]["parts"]):
        calls = {p["toolInvocation"]["toolCallId"] for p in after["content"]["parts"] if "toolInvocation" in p}
        parts = [
            p for p in before["content"]["parts"] if p.get("toolInvocation", {}).get("state") != "partial-call" or p["toolInvocation"]["toolCallId"] in calls
        ]
        before = {**before, "content": {**before["content"], "parts": parts}}
    if {k: v for k, v in before.items() if k != "content"} != {k: v for k, v in after.items() if k != "content"}:
        return False
    bc, ac = before["content"], after["content"]
    if {k: v for k, v in bc.items() if k != "parts"} != {k: v for k, v in ac.items() if k != "parts"}:
        return False
    if len(bc["parts"]) != len(ac["parts"]):
        return False
    for b, a in zip(bc["parts"], ac["parts"]):
        if b == a:
            continue
        if b.get("type") != "tool-invocation" or {k: v for k, v in b.items() if k != "toolInvocation"} != {k: v for k, v in a.items() if k != "toolInvocation"}:
            return False
        bi, ai = b["toolInvocation"], a["toolInvocation"]
        if any(bi.get(k) != ai.get(k) for k in bi.keys() | ai.keys() if k not in OUTCOME_KEYS):
            return False
        if not advances(b, ai["state"]):
            return False
    return True


class TestStoredRowsAreTheTruth:
    @EXAMPLES
    @given(world())
    def test_a_stored_row_changes_only_by_an_outcome_that_advances_a_pending_call(self, w):
        request, stored, elsewhere = w
        thread = Thread(stored, elsewhere)
        if not valid(request):
            return
        d = decide_bytes(request, thread)
        for row in d.persist + d.messages:
            before = thread.rows.get(row.get("id"))
            if before is not None and row["role"] != "system":
                assert changed_only_by_advancing_outcomes(before, row)

    @EXAMPLES
    @given(world())
    def test_an_echo_of_an_unchanged_stored_row_is_never_saved_again(self, w):
        request, stored, elsewhere = w
        thread = Thread(stored, elsewhere)
        if not valid(request):
            return
        for row in decide_bytes(request, thread).persist:
            assert thread.rows.get(row["id"]) != row


class TestThreadsStayApart:
    @EXAMPLES
    @given(world())
    def test_nothing_is_saved_under_or_changed_in_another_thread_and_the_owner_never_changes(self, w):
        request, stored, elsewhere = w
        thread = Thread(stored, elsewhere)
        if not valid(request):
            return
        d = decide_bytes(request, thread)
        if stored and request["resourceId"] != "r1":
            assert d.outcome == "rejected" and d.error.type == "ownership"
        for row in d.persist:
            assert row["threadId"] == "t1"
            assert row["resourceId"] == request["resourceId"]
            assert row["id"] not in thread.elsewhere
        if d.persist and stored:
            assert request["resourceId"] == "r1"


class TestReplaysAreHarmless:
    @EXAMPLES
    @given(world())
    def test_the_same_case_gives_byte_identical_output_twice(self, w):
        request, stored, elsewhere = w
        if not valid(request):
            return
        first = decision_json(copy.deepcopy(request), Thread(copy.deepcopy(stored), elsewhere))
        second = decision_json(copy.deepcopy(request), Thread(copy.deepcopy(stored), elsewhere))
        assert first == second

    @EXAMPLES
    @given(world())
    def test_after_saving_a_decision_the_same_full_echo_saves_nothing_new(self, w):
        request, stored, elsewhere = w
        thread = Thread(stored, elsewhere)
        if not valid(request):
            return
        thread.save(decide_bytes(request, thread).persist)
        assert decide_bytes(request, thread).persist == []


class TestLossless:
    @EXAMPLES
    @given(world())
    def test_unknown_keys_and_part_types_survive_the_round_trip(self, w):
        request, stored, elsewhere = w
        if not valid(request):
            return
        raw = msgspec.json.encode(request)
        assert msgspec.json.encode(decode_request(raw, "q").raw) == msgspec.json.encode(request["messages"])

    @EXAMPLES
    @given(world())
    def test_a_new_message_goes_on_as_sent_plus_only_the_fields_the_server_fills(self, w):
        request, stored, elsewhere = w
        thread = Thread(stored, elsewhere)
        if not valid(request):
            return
        d = decide_bytes(request, thread)
        sent = dict(zip(decode_request(msgspec.json.encode(request), "q").ids, request["messages"]))
        for out in d.messages:
            if out["role"] == "system" or out["id"] in thread.rows:
                continue
            source = sent[out["id"]]
            for key, value in source.items():
                if key != "content":
                    assert out[key] == value
            for key, value in source["content"].items():
                if key not in ("parts", "content", "providerMetadata"):
                    assert out["content"][key] == value
            for part in out["content"]["parts"]:
                assert any(
                    {k: v for k, v in part.items() if k not in ("providerMetadata", "providerOptions")}
                    == {k: v for k, v in p.items() if k not in ("providerMetadata", "providerOptions")}
                    for p in source["content"]["parts"]
                )

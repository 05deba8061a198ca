"""Rules of the filter that the shared conformance cases do not pin, one class per rule."""

import msgspec
import pytest
from factories import T0

from memfilter.core.filter import MAX_WAITING, Limits, Rejected, StoredView, advances, check_key, decide, decode_request, iso_ms, parse_ms
from memfilter.core.ui import to_ui


def request(*messages, request_id="q", **fields):
    raw = msgspec.json.encode({"threadId": "t1", "resourceId": "r1", "messages": list(messages), **fields})
    return decode_request(raw, request_id)


def user(mid=None, text="hi", **extra):
    m = {"role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": text}]}, **extra}
    return m | ({"id": mid} if mid else {})


def tool(state, call="c1", **part_keys):
    return {"type": "tool-invocation", "toolInvocation": {"state": state, "toolCallId": call, "toolName": "t"}, **part_keys}


def assistant(mid, *parts):
    return {"id": mid, "role": "assistant", "content": {"format": 2, "parts": list(parts)}}


def stored_row(m, created="2026-03-01T10:00:00.000Z"):
    return {**m, "threadId": "t1", "resourceId": "r1", "createdAt": created}


def empty_view():
    return StoredView(rows={}, elsewhere={})


def view_of(*rows, **fields):
    return StoredView(rows={r["id"]: msgspec.json.encode(r) for r in rows}, elsewhere={}, owner="r1", size=len(rows), **fields)


def as_json(decision):
    """A decision as consumers see it: messages and rows as JSON values."""
    return msgspec.json.decode(msgspec.json.encode(decision))


class TestAdvances:
    @pytest.mark.parametrize(
        "stored, incoming, expected",
        [
            ("call", "result", True),
            ("partial-call", "output-error", True),
            ("approval-requested", "output-denied", True),
            ("approval-responded", "result", True),
            ("approval-requested", "approval-responded", True),
            ("call", "approval-responded", False),
            ("approval-responded", "approval-responded", False),
            ("result", "output-error", False),
            ("output-denied", "approval-responded", False),
        ],
    )
    def test_the_state_relation(self, stored, incoming, expected):
        assert advances(tool(stored), incoming) is expected

    def test_a_provider_executed_call_only_takes_an_approval_answer(self):
        assert not advances(tool("call", providerExecuted=True), "result")
        assert not advances(tool("approval-requested", providerExecuted=True), "result")
        assert advances(tool("approval-requested", providerExecuted=True), "approval-responded")


class TestDecoding:
    def test_bytes_that_are_not_json_are_a_decode_error(self):
        with pytest.raises(Rejected) as e:
            decode_request(b"\xff{", "q")
        assert e.value.type == "decode"

    def test_malformed_json_is_a_decode_error_even_where_its_start_has_the_wrong_shape(self):
        with pytest.raises(Rejected) as e:
            decode_request(b"[1,2", "q")
        assert e.value.type == "decode"

    def test_json_of_the_wrong_shape_is_a_schema_error_naming_the_field(self):
        with pytest.raises(Rejected) as e:
            decode_request(b'{"threadId": "t1", "resourceId": "r1", "messages": [{"role": "user", "content": {"format": 2, "parts": [{"type": 3}]}}]}', "q")
        assert e.value.type == "schema"
        assert "messages[0].content.parts[0].type" in e.value.message

    def test_limits_are_configurable(self):
        raw = msgspec.json.encode({"threadId": "t1", "resourceId": "r1", "messages": [user("a"), user("b")]})
        with pytest.raises(Rejected) as e:
            decode_request(raw, "q", Limits(max_messages=1))
        assert e.value.type == "too-large" and "MEMFILTER_MAX_MESSAGES" in e.value.message
        with pytest.raises(Rejected) as e:
            decode_request(raw, "q", Limits(max_bytes=10))
        assert e.value.type == "too-large"

    def test_a_record_keyed_by_another_thread_is_a_key_mismatch(self):
        with pytest.raises(Rejected) as e:
            check_key(request(user("u1")).shape.threadId, b"t2")
        assert e.value.type == "key-mismatch"


class TestServerMadeIdsAndTimestamps:
    def test_new_messages_get_increasing_stamps_after_the_newest_stored_row(self):
        view = StoredView(rows={}, elsewhere={}, owner="r1", size=1, newest_ms=T0 + 5000)
        d = decide(request(user(), user()), view, T0)
        stamps = [m["createdAt"] for m in d.persist]
        assert stamps == [iso_ms(T0 + 5001), iso_ms(T0 + 5002)]

    def test_stamps_follow_the_record_timestamp_when_it_is_newer(self):
        view = StoredView(rows={}, elsewhere={}, owner="r1", size=1, newest_ms=T0 - 1)
        d = decide(request(user()), view, T0)
        assert parse_ms(d.persist[0]["createdAt"]) == T0

    def test_a_stamp_the_client_sent_is_kept(self):
        d = decide(request(user(createdAt="1999-01-01T00:00:00Z")), empty_view(), T0)
        assert d.persist[0]["createdAt"] == "1999-01-01T00:00:00Z"

    def test_ids_are_the_same_for_the_same_request_and_differ_between_requests(self):
        first = decide(request(user(), user(), request_id="q1"), empty_view(), T0)
        again = decide(request(user(), user(), request_id="q1"), empty_view(), T0)
        other = decide(request(user(), user(), request_id="q2"), empty_view(), T0)
        ids = [m["id"] for m in first.persist]
        assert ids == [m["id"] for m in again.persist]
        assert len(set(ids)) == 2 and not set(ids) & {m["id"] for m in other.persist}

    def test_a_request_id_sent_by_the_client_wins_over_the_derived_one(self):
        sent = decide(request(user(), requestId="client-1", request_id="chat-requests-0-5"), empty_view(), T0)
        same = decide(request(user(), requestId="client-1", request_id="chat-requests-3-9"), empty_view(), T0)
        assert sent.persist == same.persist

    def test_a_replayed_request_finds_its_assigned_ids_stored_and_saves_nothing(self):
        first = decide(request(user(), request_id="q1"), empty_view(), T0)
        row = first.persist[0]
        again = decide(request(user(), request_id="q1"), view_of(row), T0 + 10)
        assert again.persist == [] and as_json(again)["messages"] == [row]


class TestWhatIsSaved:
    def test_partial_calls_are_removed_from_saved_rows(self):
        req = request(user("u1"), assistant("a1", {"type": "text", "text": "x"}, tool("partial-call")))
        d = decide(req, empty_view(), T0)
        assert d.outcome == "seeded"
        assert d.persist[1]["content"]["parts"] == [{"type": "text", "text": "x"}]

    def test_a_row_left_without_parts_is_not_saved(self):
        req = request(user("u1"), assistant("a1", tool("partial-call")))
        d = decide(req, empty_view(), T0)
        assert [m["id"] for m in d.persist] == ["u1"]

    def test_an_applied_outcome_saves_the_whole_stored_row_with_its_other_keys(self):
        stored = stored_row(assistant("a1", {"type": "text", "text": "t", "providerMetadata": {"k": 1}}, tool("call", title="T")))
        view = view_of(stored)
        echo = assistant("a1", {"type": "text", "text": "t "}, tool("result") | {"x": 1})
        echo["content"]["parts"][1]["toolInvocation"]["result"] = 42
        d = decide(request(echo), view, T0)
        assert d.outcome == "tool-outcomes"
        saved = as_json(d)["persist"][0]
        assert saved["content"]["parts"][0] == stored["content"]["parts"][0]
        assert saved["content"]["parts"][1] == tool("call", title="T") | {
            "toolInvocation": {"state": "result", "toolCallId": "c1", "toolName": "t", "result": 42}
        }


class TestOlderMessagesParts:
    """A decoded request keeps the typed parts of its last assistant message and what follows;
    a decision that keeps an older stored message reads that message's parts again."""

    def thread(self, ui: bool):
        a1 = stored_row(assistant("a1", tool("call")))
        u1, a2 = stored_row(user("u1")), stored_row(assistant("a2", {"type": "text", "text": "ok"}))
        answered = assistant("a1", tool("result") | {"toolInvocation": {"state": "result", "toolCallId": "c1", "toolName": "t", "result": 7}})
        sent = [answered, u1, a2, user("u2")]
        return view_of(a1, u1, a2), [to_ui(m) for m in sent] if ui else sent

    @pytest.mark.parametrize("ui", [False, True], ids=["stored form", "UI messages"])
    def test_an_older_assistant_messages_outcome_is_applied_when_the_whole_input_is_retained(self, ui):
        view, sent = self.thread(ui)
        d = decide(request(*sent, retainFullInput=True), view, T0)
        assert d.outcome == "retain-full-input"
        saved = as_json(d)["persist"]
        assert [row["id"] for row in saved] == ["a1", "u2"]
        assert saved[0]["content"]["parts"][0]["toolInvocation"] == {"state": "result", "toolCallId": "c1", "toolName": "t", "result": 7}

    @pytest.mark.parametrize("ui", [False, True], ids=["stored form", "UI messages"])
    def test_the_parts_before_the_last_assistant_message_are_not_held_once_decoded(self, ui):
        _, sent = self.thread(ui)
        messages = request(*sent).shape.messages
        assert [len(m.content.parts) for m in messages[2:]] == [1, 1]
        for m in messages[:2]:
            for read in (lambda parts: parts[0], len, list, reversed):
                with pytest.raises(AssertionError, match="released"):
                    read(m.content.parts)


class TestDropped:
    def test_every_id_sent_and_not_kept_is_listed_once_with_a_reason(self):
        u1, a1 = stored_row(user("u1")), stored_row(assistant("a1", {"type": "text", "text": "x"}))
        view = view_of(u1, a1)
        req = request(user("u0"), u1, a1, user("u2"))
        d = decide(req, view, T0)
        assert d.outcome == "user-tail"
        assert [(x.id, x.reason) for x in d.dropped] == [
            ("u0", "before the kept tail and never stored"),
            ("u1", "echo of a stored message"),
            ("a1", "echo of a stored message"),
        ]


class TestTheModelsContext:
    """The context: system messages, the window of the conversation's last rows with the
    request's updates in place, then what else the request contributes."""

    def thread(self, n):
        rows = [stored_row(user(f"u{i}", f"q{i}")) if i % 2 == 0 else stored_row(assistant(f"a{i}", {"type": "text", "text": f"r{i}"})) for i in range(n)]
        return rows, view_of(*rows, tail=[r["id"] for r in rows])

    def ids(self, decision):
        return [m.get("id", m["role"]) for m in as_json(decision)["context"]]

    def test_system_messages_go_first_then_the_window_then_the_new_message(self):
        rows, view = self.thread(4)
        d = decide(request(*rows, {"role": "system", "content": {"format": 2, "parts": []}}, user("u4")), view, T0)
        assert self.ids(d) == ["system", "u0", "a1", "u2", "a3", "u4"]

    def test_the_window_is_the_last_n_rows_and_n_0_is_the_requests_messages_only(self):
        rows, view = self.thread(6)
        assert self.ids(decide(request(*rows, user("u6")), view, T0, history=2)) == ["u4", "a5", "u6"]
        assert self.ids(decide(request(*rows, user("u6")), view, T0, history=0)) == ["u6"]

    def test_a_pure_echo_has_the_conversation_as_its_context_and_no_messages(self):
        rows, view = self.thread(4)
        d = decide(request(*rows), view, T0)
        assert (as_json(d)["messages"], self.ids(d)) == ([], ["u0", "a1", "u2", "a3"])

    def test_rows_the_client_did_not_echo_are_in_the_window_as_stored(self):
        rows, view = self.thread(4)
        d = decide(request(user("u4")), view, T0)
        assert as_json(d)["context"][:4] == rows

    def test_a_kept_message_that_is_not_saved_is_in_the_context_as_it_goes_on(self):
        rows, view = self.thread(2)
        streaming = assistant("a2", tool("partial-call"))
        d = decide(request(*rows, streaming), view, T0)
        assert (d.outcome, d.persist) == ("unpersisted-assistant-kept", [])
        assert as_json(d)["context"][-1]["content"] == streaming["content"]

    def test_a_kept_stored_row_the_shell_did_not_read_in_order_follows_the_window(self):
        """A view whose tail lacks a stored row the request keeps (not what the processor
        reads, which reaches back to it) still gives every kept message, once."""
        rows, view = self.thread(4)
        view.tail = ["u2", "a3"]
        d = decide(request(*rows[:2], retainFullInput=True), view, T0, history=2)
        assert self.ids(d) == ["u2", "a3", "u0", "a1"]


class TestTurns:
    """A request while its thread's reply is being made (`view.replying`), or behind requests
    waiting for their turn (`view.waiting`): what each policy makes of it."""

    BUSY = {"replying": "q0", "replying_ms": T0}

    def turn(self, turns, asked=None, at=T0 + 1_000, woken=False, **view):
        r = request(user("u1"), **({"concurrentTurns": asked} if asked else {}))
        return decide(r, view_of(**(self.BUSY | view)), at, turns=turns, turn_wait_ms=60_000, woken=woken)

    def test_enqueue_and_interrupt_wait_while_a_reply_is_being_made(self):
        assert [self.turn(t).wait for t in ("enqueue", "interrupt")] == ["enqueue", "interrupt"]
        assert self.turn("enqueue").outcome == "waiting" and self.turn("enqueue").persist == []

    def test_concurrent_never_waits_even_behind_waiting_requests(self):
        assert self.turn("concurrent", waiting=2).wait is None and self.turn("concurrent", waiting=2).error is None

    def test_a_request_behind_waiting_ones_waits_without_interrupting_their_reply(self):
        assert self.turn("interrupt", waiting=1).wait == "enqueue"
        assert self.turn("enqueue", replying=None, waiting=1).wait == "enqueue"  # the reply ended, its turn not come yet

    def test_nothing_to_wait_for_decides_at_once(self):
        assert self.turn("enqueue", replying=None).wait is None
        assert self.turn("enqueue", at=T0 + 60_000).wait is None  # the reply lapsed

    def test_a_woken_request_is_decided_whatever_the_thread_says(self):
        decided = self.turn("reject", woken=True, waiting=3)
        assert decided.wait is None and decided.error is None and decided.outcome != "waiting"

    def test_reject_names_what_the_thread_is_busy_with(self):
        assert "is answering request q0" in self.turn("reject").error.message
        assert "has 2 requests waiting for their turn" in self.turn("reject", replying=None, waiting=2).error.message

    def test_a_thread_keeps_a_bounded_number_waiting_and_refuses_one_more(self):
        assert self.turn("enqueue", waiting=MAX_WAITING - 1).wait == "enqueue"
        refused = self.turn("interrupt", waiting=MAX_WAITING).error
        assert refused.type == "busy-thread" and f"has {MAX_WAITING} requests waiting for their turn" in refused.message

    def test_a_request_may_narrow_the_policy_never_widen_it(self):
        assert self.turn("concurrent", asked="enqueue").wait == "enqueue"
        assert self.turn("enqueue", asked="interrupt").wait == "enqueue"
        assert self.turn("interrupt", asked="reject").error.type == "busy-thread"
        assert self.turn("reject", asked="concurrent").error.type == "busy-thread"

"""The checker (`checker.py`) finds each violation it names, on histories made by hand, and
passes a history that keeps every promise: a checker that finds nothing proves nothing."""

from __future__ import annotations

from checker import Outcome, Sent, check, outcome_of


def thread(turns: int, name: str = "t") -> list[Sent]:
    """A thread's full echoes, turn k at (0, k) on the requests topic."""
    return [Sent(name, k, f"{name}-r{k}", [f"{name}-u{i}" for i in range(k + 1)], (0, k)) for k in range(turns)]


def answered(sent: list[Sent]) -> tuple[list[Outcome], dict, dict]:
    """What a correct product makes of `sent`: an outcome each, in order; each turn saves its new message."""
    outcomes = [Outcome(s.at, (0, n), s.thread, s.messages) for n, s in enumerate(sent)]
    saved = {"t": [(s.request_id, [s.messages[-1]]) for s in sent]}
    return outcomes, saved, {"t": [s.messages[-1] for s in sent]}


class TestTheCheckerFindsWhatItNames:
    def test_a_history_that_keeps_every_promise_passes(self):
        sent = thread(4)
        assert check(sent, *answered(sent)).ok

    def test_an_acknowledged_request_without_an_outcome_is_lost(self):
        sent = thread(4)
        outcomes, saved, stored = answered(sent)
        problems = check(sent, outcomes[:-1], saved, {"t": stored["t"][:-1]}).problems
        assert any(p.startswith("lost: request t-r3") for p in problems)

    def test_a_request_not_acknowledged_may_have_no_outcome(self):
        sent = thread(4)
        outcomes, saved, stored = answered(sent)
        sent[-1].at = None
        assert check(sent, outcomes[:-1], {"t": saved["t"][:-1]}, {"t": stored["t"][:-1]}).ok

    def test_a_request_not_acknowledged_but_written_and_decided_counts_in_the_history_its_thread_saw(self):
        sent = thread(4)
        outcomes, saved, stored = answered(sent)
        for o, s in zip(outcomes, sent, strict=True):
            o.request_id = s.request_id
        sent[1].at = None  # its publish timed out, but the request was on the topic and decided
        assert check(sent, outcomes, saved, stored).ok
        saved["t"][1] = ("t-r1", [])  # had it saved nothing, the next decision would have saved u1
        assert any(p.startswith("stale: request t-r2") for p in check(sent, outcomes, saved, stored).problems)

    def test_two_outcomes_of_one_request_and_a_message_saved_twice_are_found(self):
        sent = thread(3)
        outcomes, saved, stored = answered(sent)
        outcomes.append(Outcome((0, 2), (0, 9), "t", sent[2].messages))
        saved["t"].append(("another-service", ["t-u2"]))  # a save of another request id: not a repeat of r2's
        problems = check(sent, outcomes, saved, stored).problems
        assert any(p.startswith("twice: request t-r2") for p in problems) and any(p.startswith("twice: message t-u2") for p in problems)

    def test_outcomes_out_of_their_requests_order_are_found(self):
        sent = thread(3)
        outcomes, saved, stored = answered(sent)
        outcomes[1].where, outcomes[2].where = outcomes[2].where, outcomes[1].where
        assert any(p.startswith("order: thread t") for p in check(sent, outcomes, saved, stored).problems)

    def test_a_decision_that_saves_a_stored_message_again_saw_stale_history(self):
        sent = thread(3)
        outcomes, saved, stored = answered(sent)
        saved["t"][2] = ("t-r2", ["t-u1", "t-u2"])  # as if u1's save were lost before r2 was decided
        assert any(p.startswith("stale: request t-r2") for p in check(sent, outcomes, saved, stored).problems)

    def test_redis_holding_other_than_what_was_saved_is_found(self):
        sent = thread(3)
        outcomes, saved, stored = answered(sent)
        assert any(p.startswith("stored: thread t") for p in check(sent, outcomes, saved, {"t": ["t-u0", "t-u2"]}).problems)

    def test_postgresql_holding_other_than_what_was_saved_is_found_and_a_copy_that_agrees_passes(self):
        sent = thread(3)
        outcomes, saved, stored = answered(sent)
        assert check(sent, outcomes, saved, stored, kept=stored).ok
        problems = check(sent, outcomes, saved, stored, kept={"t": ["t-u0", "t-u1"]}).problems
        assert problems == ["postgres: thread t holds ['t-u0', 't-u1'] in PostgreSQL; its decisions saved ['t-u0', 't-u1', 't-u2'], its replies []"]

    def test_a_dead_letter_without_its_reason_is_found(self):
        sent = thread(2)
        outcomes, saved, stored = answered(sent)
        outcomes[1] = Outcome((0, 1), (1, 0), "t", None, "")
        problems = check(sent, outcomes, {"t": saved["t"][:1]}, {"t": stored["t"][:1]}).problems
        assert problems == ["dead letter: the outcome at (1, 0) of request (0, 1) has no error.type"]


def conversation(turns: int) -> tuple[list[Sent], list[Outcome], dict, list[str]]:
    """A conversation that waited for each reply: turn k echoes u0 a0 .. u(k-1) a(k-1) uk; each
    decision saves uk, each reply ak; stored in that order."""
    sent, history = [], []
    for k in range(turns):
        history.append(f"t-u{k}")
        sent.append(Sent("t", k, f"t-r{k}", list(history), (0, k), waited=True))
        history.append(f"t-a{k}")
    outcomes = [Outcome(s.at, (0, n), "t", s.messages) for n, s in enumerate(sent)]
    saved = {"t": [e for k in range(turns) for e in ((f"t-r{k}", [f"t-u{k}"]), (f"t-r{k}/reply", [f"t-a{k}"]))]}
    return sent, outcomes, saved, history


class TestTheCheckerHoldsRepliesToTheirPromise:
    def test_a_conversation_that_waited_for_each_reply_passes_stored_turn_then_reply(self):
        sent, outcomes, saved, history = conversation(3)
        assert check(sent, outcomes, saved, {"t": history}, {"t": history}).ok

    def test_a_reply_stored_after_the_next_turn_of_a_conversation_that_waited_is_found(self):
        sent, outcomes, saved, history = conversation(3)
        swapped = ["t-u0", "t-a0", "t-u1", "t-u2", "t-a1", "t-a2"]
        assert any(p.startswith("stored: thread t") for p in check(sent, outcomes, saved, {"t": swapped}).problems)

    def test_a_save_repeated_under_its_request_id_changes_nothing_and_passes(self):
        sent, outcomes, saved, history = conversation(2)
        saved["t"].append(("t-r0/reply", ["t-a0"]))
        assert check(sent, outcomes, saved, {"t": history}).ok

    def test_a_reply_anywhere_once_passes_where_the_turns_did_not_wait_and_a_lost_one_is_found(self):
        sent, outcomes, saved, history = conversation(3)
        for s in sent:
            s.waited = None
        assert check(sent, outcomes, saved, {"t": ["t-u0", "t-u1", "t-a0", "t-u2", "t-a2", "t-a1"]}).ok
        assert any(p.startswith("stored: thread t") for p in check(sent, outcomes, saved, {"t": ["t-u0", "t-u1", "t-a0", "t-u2", "t-a2"]}).problems)


def chat() -> tuple[list[Sent], list[Outcome], dict, dict, list[str]]:
    """A chat through the gateway, each turn answered: ask (u0, reply a0), regenerate (a0 taken
    out, reply b0), call a tool (u2, reply c2 with a pending call), answer it (c2 saved with
    the outcome, the reply continuing c2)."""
    sent = [
        Sent("t", 0, "t-r0", ["t-u0"], None, waited=True, told="answered"),
        Sent("t", 1, "t-r1", ["t-u0"], None, waited=True, told="answered", kind="regenerate"),
        Sent("t", 2, "t-r2", ["t-u0", "t-b0", "t-u2"], None, waited=True, told="answered"),
        Sent("t", 3, "t-r3", ["t-u0", "t-b0", "t-u2", "t-c2"], None, waited=True, told="answered", kind="tool"),
    ]
    outcomes = [Outcome((0, k), (0, k), "t", s.messages[-1:], request_id=s.request_id) for k, s in enumerate(sent)]
    saved = {
        "t": [
            ("t-r0", ["t-u0"]),
            ("t-r0/reply", ["t-a0"]),
            ("t-r1", []),
            ("t-r1/reply", ["t-b0"]),
            ("t-r2", ["t-u2"]),
            ("t-r2/reply", ["t-c2"]),
            ("t-r3", ["t-c2"]),
            ("t-r3/reply", ["t-c2"]),
        ]
    }
    return sent, outcomes, saved, {"t": {"t-r1": ["t-a0"]}}, ["t-u0", "t-b0", "t-u2", "t-c2"]


class TestTheCheckerHoldsTheGatewayToWhatItTold:
    def test_a_chat_that_regenerates_and_answers_a_tool_call_passes(self):
        sent, outcomes, saved, superseded, history = chat()
        assert check(sent, outcomes, saved, {"t": history}, {"t": history}, superseded).ok

    def test_an_echo_of_a_user_message_a_regenerate_took_out_saves_nothing_of_it(self):
        """The spec's "Regenerate": a row taken out is never saved again from an echo. A chat
        told 504 on its regenerate reads the thread before the regenerate is applied, and its
        next turn echoes what the regenerate took out (seed 7)."""
        sent = [
            Sent("t", 0, "t-r0", ["t-u0"], None, waited=True, told="answered"),
            Sent("t", 1, "t-r1", ["t-u0", "t-a0", "t-u1"], None, waited=True, told="answered"),
            Sent("t", 2, "t-r2", ["t-u0"], None, waited=False, told="http 504 timeout", kind="regenerate"),
            Sent("t", 3, "t-r3", ["t-u0", "t-a0", "t-u1", "t-a1", "t-u3"], None, waited=True, told="answered"),
        ]
        outcomes = [Outcome((0, k), (0, k), "t", s.messages[-1:], request_id=s.request_id) for k, s in enumerate(sent)]
        saved = {
            "t": [
                ("t-r0", ["t-u0"]),
                ("t-r0/reply", ["t-a0"]),
                ("t-r1", ["t-u1"]),
                ("t-r1/reply", ["t-a1"]),
                ("t-r2", []),
                ("t-r2/reply", ["t-b0"]),
                ("t-r3", ["t-u3"]),
                ("t-r3/reply", ["t-d3"]),
            ]
        }
        superseded = {"t": {"t-r2": ["t-a0", "t-u1", "t-a1"]}}
        history = ["t-u0", "t-b0", "t-u3", "t-d3"]
        assert check(sent, outcomes, saved, {"t": history}, {"t": history}, superseded).ok
        saved["t"][6] = ("t-r3", ["t-u1", "t-u3"])  # the taken-out message saved again from the echo
        assert any(p.startswith("stale: request t-r3") for p in check(sent, outcomes, saved, {"t": history}, None, superseded).problems)

    def test_a_regenerate_that_takes_out_other_rows_than_followed_its_message_is_stale(self):
        sent, outcomes, saved, _, history = chat()
        problems = check(sent, outcomes, saved, {"t": history}, None, {"t": {"t-r1": []}}).problems
        assert any(p.startswith("stale: regenerate t-r1") for p in problems)

    def test_a_row_taken_out_still_in_the_stored_order_is_found(self):
        sent, outcomes, saved, superseded, history = chat()
        problems = check(sent, outcomes, saved, {"t": ["t-u0", "t-a0", *history[1:]]}, None, superseded).problems
        assert any(p.startswith("stored: thread t") for p in problems)

    def test_a_message_saved_again_by_other_than_its_tool_outcome_is_twice(self):
        sent, outcomes, saved, superseded, history = chat()
        saved["t"].append(("t-r9", ["t-c2"]))
        assert any(p.startswith("twice: message t-c2") for p in check(sent, outcomes, saved, {"t": history}, None, superseded).problems)

    def test_a_turn_answered_without_its_filtered_input_or_its_reply_is_lost(self):
        sent, outcomes, saved, superseded, history = chat()
        problems = check(sent, outcomes[:-1], {"t": saved["t"][:-2]}, {"t": history}, None, superseded).problems
        assert any(p.startswith("lost: request t-r3 was told 'answered' by the gateway, but has no filtered input") for p in problems)
        saved["t"].pop()
        problems = check(sent, outcomes, saved, {"t": history}, None, superseded).problems
        assert any(p.startswith("lost: request t-r3 was answered through the gateway, but its reply is not saved") for p in problems)

    def test_a_turn_that_asked_for_no_reply_needs_its_filtered_input_and_no_reply(self):
        """The gateway's empty stream (start, finish) for a request whose context asks for no answer."""
        sent, outcomes, saved, superseded, history = chat()
        sent[3].told = "no reply"
        saved["t"].pop()  # no reply saved
        assert check(sent, outcomes, saved, {"t": history[:3] + ["t-c2"]}, None, superseded).ok
        assert any(p.startswith("lost: request t-r3 was told 'no reply'") for p in check(sent, outcomes[:-1], saved, {"t": history}, None, superseded).problems)

    def test_a_refusal_needs_its_dead_letter_with_that_reason(self):
        sent = [Sent("t", 0, "t-r0", ["t-u0"], None, waited=True, told="rejected too-large")]
        refused = Outcome((0, 0), (0, 0), "t", None, "too-large", "t-r0")
        assert check(sent, [refused], {}, {"t": []}).ok
        assert any(p.startswith("lost: request t-r0 was told 'rejected too-large'") for p in check(sent, [], {}, {"t": []}).problems)
        refused.reason = "schema"
        assert any(p.startswith("lost: request t-r0 was told") for p in check(sent, [refused], {}, {"t": []}).problems)

    def test_a_turn_the_gateway_did_not_answer_may_or_may_not_have_been_written(self):
        sent, outcomes, saved, superseded, history = chat()
        sent[3].told, sent[3].waited = "no answer (TimeoutError)", False
        assert check(sent, outcomes, saved, {"t": history}, None, superseded).ok
        assert check(sent, outcomes[:-1], {"t": saved["t"][:-2]}, {"t": history}, None, superseded).ok

    def test_a_turn_refused_by_the_gateway_that_was_decided_all_the_same_is_found(self):
        """Found on the replicated stack (a broker bridging two sides): the gateway's producer
        wrote a request twice; the first copy was decided, the second dead-lettered as its
        `duplicate`, and that is what the caller was told."""
        sent, outcomes, saved, superseded, history = chat()
        sent[3].told = "rejected duplicate"
        outcomes.append(Outcome((0, 4), (0, 0), "t", None, "duplicate", "t-r3"))
        problems = check(sent, outcomes, saved, {"t": history}, None, superseded).problems
        assert problems == ["told: request t-r3 was told 'rejected duplicate' by the gateway, but it was decided"]

    def test_outcomes_are_ordered_on_each_topic_by_their_requests_a_dead_letter_beside_filtered_inputs_passes(self):
        sent, outcomes, saved, superseded, history = chat()
        outcomes[1].where = (5, 0)
        assert any(p.startswith("order: thread t") for p in check(sent, outcomes, saved, {"t": history}, None, superseded).problems)
        sent.append(Sent("t", 4, "t-r4", ["t-u0"], None, waited=True, told="rejected too-large"))
        _, outcomes, _, _, _ = chat()
        outcomes.append(Outcome((0, 4), (0, 0), "t", None, "too-large", "t-r4"))  # first on the dead-letter topic, after them all on the requests'
        assert check(sent, outcomes, saved, {"t": history}, None, superseded).ok


class TestTheCheckerReadsTheWire:
    def test_a_dead_letter_of_a_request_names_its_request_id_and_one_of_a_save_is_not_an_outcome(self):
        headers = {"error.type": "too-large", "source.topic": "chat-requests", "source.partition": "2", "source.offset": "7"}
        o = outcome_of("dlq", 0, 5, b"t", b'{"requestId": "t-r3"}', headers)
        assert (o.at, o.request_id, o.reason, o.contributed) == ((2, 7), "t-r3", "too-large", None)
        assert outcome_of("dlq", 0, 6, b"t", b"\xff not json", headers).request_id == ""
        assert outcome_of("dlq", 0, 7, b"t", b"{}", headers | {"source.topic": "persist-messages"}) is None

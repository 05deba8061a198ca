"""The agent runner's pure core (`memfilter.core.replies`): when the model is asked, what it is
sent, the echo model, and the reply as it is saved."""

from __future__ import annotations

import json

from factories import SECRET, filtered, text, tool

from memfilter.core import replies
from memfilter.core.reply_stream import Reply
from memfilter.core.ui import to_ui


class TestWhenTheModelIsAsked:
    def test_a_context_ending_with_the_users_message_is_answered(self):
        assert replies.wants_reply([text("u1", "user", "hi")])

    def test_a_context_ending_with_an_answer_or_a_pending_call_is_not(self):
        assert not replies.wants_reply([text("u1", "user", "hi"), text("a1", "assistant", "hello")])
        assert not replies.wants_reply([text("u1", "user", "hi"), tool("a1", "call")])
        assert not replies.wants_reply([])

    def test_a_tool_call_the_client_has_just_answered_is_answered(self):
        for state, extra in (("result", {"result": 1}), ("output-error", {"errorText": "x"}), ("output-denied", {})):
            assert replies.wants_reply([text("u1", "user", "hi"), tool("a1", state, **extra)])

    def test_system_messages_after_the_conversation_do_not_count(self):
        assert replies.wants_reply([text("u1", "user", "hi"), text(None, "system", "be brief")])


class TestWhatTheModelIsGiven:
    def test_text_tool_calls_and_their_results_map_to_chat_messages(self):
        context = [text(None, "system", "be brief"), text("u1", "user", "find"), tool("a1", "result", result={"n": 2})]
        assert replies.chat_messages(context) == [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "find"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"n": 2}'},
        ]

    def test_a_call_still_pending_is_left_out(self):
        assert replies.chat_messages([text("u1", "user", "find"), tool("a1", "call"), text("u2", "user", "never mind")]) == [
            {"role": "user", "content": "find"},
            {"role": "user", "content": "never mind"},
        ]


def echoed(context, key="k"):
    """The echo model's reply to `context`, as its chunks add up."""
    reply = Reply("m")
    for chunk in replies.echo_reply(context, key):
        reply.add(chunk)
    return reply.ui()


class TestTheEchoModel:
    def test_it_echoes_the_last_user_text_a_word_at_a_time(self):
        chunks = replies.echo_reply([text("u1", "user", "hello there")], "k")
        assert [c["delta"] for c in chunks if c["type"] == "text-delta"] == ["echo: ", "hello ", "there"]
        assert echoed([text("u1", "user", "hello there")])["parts"][-1] == {"type": "text", "text": "echo: hello there", "state": "done"}

    def test_a_tool_command_makes_a_pending_client_call(self):
        part = echoed([text("u1", "user", '/tool pickSeat {"flight": "TP1"}')], "abc")["parts"][-1]
        assert part == {"type": "tool-pickSeat", "toolCallId": "call_abc", "state": "input-available", "input": {"flight": "TP1"}}

    def test_a_tool_outcome_is_reported(self):
        part = echoed([text("u1", "user", "x"), tool("a1", "result", result={"seat": "2A"})])["parts"][-1]
        assert part["text"] == 'lookup returned {"seat": "2A"}'


class TestTheSavedReply:
    def test_a_redelivered_input_saves_the_same_reply(self):
        event = filtered([text("u1", "user", "hi", createdAt="2026-03-01T10:00:00.000Z")])
        ui = {"id": "x", "role": "assistant", "parts": [{"type": "text", "text": "a"}]}
        assert replies.reply_event(event, replies.reply_message(event, ui, 5, SECRET)) == replies.reply_event(
            event, replies.reply_message(event, ui, 5, SECRET)
        )

    def test_a_continuation_after_the_clients_tool_outcome_is_the_same_message_with_a_step_more(self):
        answered = tool("a1", "result", result={"seat": "2A"}) | {"createdAt": "2026-03-01T10:00:01.000Z"}
        event = filtered([text("u1", "user", "x"), answered])
        reply_id, base = replies.continued(event, SECRET)
        assert (reply_id, base) == ("a1", answered)
        reply = Reply(reply_id, to_ui(base))
        for chunk in replies.echo_reply(event.context, "k"):
            reply.add(chunk)
        saved = replies.reply_message(event, reply.ui(), 5, SECRET)
        assert (saved["id"], saved["createdAt"]) == ("a1", "2026-03-01T10:00:01.000Z")
        assert saved["content"]["parts"][:2] == answered["content"]["parts"]
        assert [p["type"] for p in saved["content"]["parts"][2:]] == ["step-start", "text"]

    def test_its_id_is_the_requests_own_and_unknowable_without_the_secret(self):
        event = filtered([])
        assert replies.reply_id(event, SECRET) != replies.reply_id(filtered([], request_id="q2"), SECRET)
        assert replies.reply_id(event, SECRET) != replies.reply_id(event, b"another-deployment-secret")

    def test_it_follows_everything_in_the_context(self):
        event = filtered([text("u1", "user", "hi", createdAt="2026-03-01T10:00:00.000Z")])
        assert replies.reply_message(event, {"parts": []}, 0, SECRET)["createdAt"] == "2026-03-01T10:00:00.001Z"

    def test_the_event_saves_it_in_the_inputs_thread_for_its_resource(self):
        event = json.loads(replies.reply_event(filtered([], thread="t9"), {"id": "m", "role": "assistant", "content": {"format": 2, "parts": []}}))
        assert (event["requestId"], event["threadId"], event["resourceId"]) == ("q1/reply", "t9", "r1")
        assert (event["messages"][0]["threadId"], event["messages"][0]["resourceId"]) == ("t9", "r1")

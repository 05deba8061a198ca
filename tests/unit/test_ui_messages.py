"""AI SDK UI messages in, stored messages out, and back (`streams/ui.py`): the conversion's
promises as properties over generated messages, and its place in front of the filter."""

from __future__ import annotations

import json

import msgspec
import pytest
from factories import T0
from hypothesis import given, settings
from hypothesis import strategies as st

from memfilter.core.filter import Rejected, StoredView, decide, decode_request
from memfilter.core.ui import NotConvertible, is_ui, to_stored, to_ui

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
metadata = st.dictionaries(st.sampled_from(["openai", "anthropic", "x"]), st.dictionaries(st.text(max_size=5), json_values, max_size=2), max_size=2)
ids = st.text("abcdefghij0123456789-_", min_size=1, max_size=12)


def optional(**fields) -> st.SearchStrategy[dict]:
    """A dict with any subset of these fields."""
    return st.fixed_dictionaries({}, optional=fields)


def tool_part(dynamic: bool) -> st.SearchStrategy[dict]:
    state = st.sampled_from(
        ["input-streaming", "input-available", "output-available", "output-error", "approval-requested", "approval-responded", "output-denied"]
    )
    extra = optional(
        input=json_values,
        output=json_values,
        errorText=st.text(max_size=8),
        providerExecuted=st.booleans(),
        callProviderMetadata=metadata,
        preliminary=st.booleans(),
        rawInput=json_values,
        approval=st.fixed_dictionaries({"id": ids}, optional={"approved": st.booleans(), "reason": st.text(max_size=5)}),
        title=st.text(max_size=8),
    )
    if dynamic:
        head = st.fixed_dictionaries({"type": st.just("dynamic-tool"), "toolName": st.text(max_size=10), "toolCallId": ids, "state": state})
    else:
        head = st.fixed_dictionaries({"type": st.text(max_size=10).map(lambda n: f"tool-{n}"), "toolCallId": ids, "state": state})
    return st.tuples(head, extra).map(lambda t: {**t[1], **t[0]})


# Every part type of AI SDK v5 UI messages, with the keys each may carry.
parts = st.one_of(
    st.tuples(
        st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
        optional(state=st.sampled_from(["streaming", "done"]), providerMetadata=metadata),
    ).map(lambda t: {**t[1], **t[0]}),
    st.tuples(
        st.fixed_dictionaries({"type": st.just("reasoning"), "text": st.text(max_size=20)}),
        optional(state=st.sampled_from(["streaming", "done"]), providerMetadata=metadata),
    ).map(lambda t: {**t[1], **t[0]}),
    st.tuples(
        st.fixed_dictionaries({"type": st.just("file"), "mediaType": st.sampled_from(["image/png", "application/pdf"]), "url": st.text(max_size=20)}),
        optional(filename=st.text(max_size=8), providerMetadata=metadata),
    ).map(lambda t: {**t[1], **t[0]}),
    st.tuples(
        st.fixed_dictionaries({"type": st.just("source-url"), "sourceId": ids, "url": st.text(max_size=20)}),
        optional(title=st.text(max_size=8), providerMetadata=metadata),
    ).map(lambda t: {**t[1], **t[0]}),
    st.tuples(
        st.fixed_dictionaries({"type": st.just("source-document"), "sourceId": ids, "mediaType": st.just("text/plain"), "title": st.text(max_size=8)}),
        optional(filename=st.text(max_size=8), providerMetadata=metadata),
    ).map(lambda t: {**t[1], **t[0]}),
    st.just({"type": "step-start"}),
    st.tuples(st.fixed_dictionaries({"type": st.sampled_from(["data-weather", "data-trip"]), "data": json_values}), optional(id=ids)).map(
        lambda t: {**t[1], **t[0]}
    ),
    tool_part(dynamic=False),
    tool_part(dynamic=True),
)
ui_messages = st.tuples(
    st.fixed_dictionaries({"id": ids, "role": st.sampled_from(["user", "assistant", "system"]), "parts": st.lists(parts, max_size=5)}),
    optional(metadata=st.dictionaries(st.text(max_size=6), json_values, max_size=3), createdAt=st.just("2026-03-01T10:00:00.000Z")),
).map(lambda t: {**t[1], **t[0]})


class TestTheRoundTrip:
    @settings(max_examples=400, deadline=None)
    @given(ui_messages)
    def test_every_v5_ui_message_comes_back_from_its_stored_form_unchanged(self, m):
        stored = to_stored(m)
        assert not is_ui(stored) and stored["content"]["format"] == 2
        assert to_ui(json.loads(json.dumps(stored))) == m

    def test_a_stored_v4_row_converts_to_v5_tool_parts(self):
        row = {
            "id": "a1",
            "role": "assistant",
            "content": {
                "format": 2,
                "parts": [
                    {
                        "type": "tool-invocation",
                        "toolInvocation": {
                            "state": "result",
                            "toolCallId": "c1",
                            "toolName": "weather",
                            "args": {"city": "Oslo"},
                            "result": {"c": 4},
                            "step": 0,
                        },
                    },
                    {"type": "tool-invocation", "toolInvocation": {"state": "partial-call", "toolCallId": "c2", "toolName": "map"}},
                ],
            },
        }
        assert to_ui(row)["parts"] == [
            {"type": "tool-weather", "toolCallId": "c1", "state": "output-available", "input": {"city": "Oslo"}, "output": {"c": 4}, "step": 0},
            {"type": "tool-map", "toolCallId": "c2", "state": "input-streaming"},
        ]


def request(messages: list[dict]) -> bytes:
    return json.dumps({"requestId": "q", "threadId": "t1", "resourceId": "r1", "messages": messages}).encode()


class TestInFrontOfTheFilter:
    @settings(max_examples=200, deadline=None)
    @given(st.lists(ui_messages, min_size=1, max_size=3, unique_by=lambda m: m["id"]), st.integers(0, 3))
    def test_an_echo_of_a_stored_message_is_recognized_whichever_form_it_has(self, messages, stored_count):
        """Rows are stored in format 2 whatever form they came in; an echo of them decides the
        same sent as UI messages as sent in the stored form, a mix of both too."""
        stored_form = [to_stored(m) for m in messages]
        rows = {s["id"]: msgspec.json.encode(s) for s in stored_form[:stored_count] if s["role"] != "system"}
        view = StoredView(rows, {}, "r1", len(rows), None)
        mixed = [m if i % 2 else s for i, (m, s) in enumerate(zip(messages, stored_form))]
        decisions = [decide(decode_request(request(sent), "q"), view, T0) for sent in (messages, stored_form, mixed)]
        as_json = [json.loads(msgspec.json.encode((d.outcome, d.dropped, d.persist, d.messages))) for d in decisions]
        assert as_json[0] == as_json[1] == as_json[2]

    @settings(max_examples=400, deadline=None)
    @given(
        st.dictionaries(st.sampled_from(["id", "role", "content", "metadata", "createdAt", "x"]), json_values, max_size=5),
        st.lists(
            json_values
            | st.dictionaries(
                st.sampled_from(
                    ["type", "state", "toolCallId", "text", "url", "mediaType", "sourceId", "input", "toolName", "reasoning", "toolInvocation", "output"]
                ),
                json_values | st.sampled_from(["tool-x", "dynamic-tool", "file", "reasoning", "source-url", "input-available"]),
                max_size=5,
            ),
            max_size=4,
        ),
    )
    def test_any_object_with_a_parts_array_converts_or_is_a_schema_rejection(self, fields, message_parts):
        message = {**fields, "parts": message_parts}
        try:
            accepted = decode_request(request([message]), "q")
        except Rejected as e:
            assert e.type == "schema" and "messages[0]" in e.message, e.message
            accepted = None
        try:
            converted = to_stored(message, "messages[0]")
        except NotConvertible as e:
            assert str(e).startswith("messages[0].parts[")
            converted = None
        if is_ui(message):  # the fast typed view accepts exactly what converting it whole does, and reads the same
            try:
                whole = decode_request(request([converted]), "q") if converted is not None else None
            except Rejected:
                whole = None
            assert (accepted is None) == (whole is None)
            if accepted is not None:  # what the filter reads of a part: its type, and a tool invocation's

                def read(r):
                    return [(p.type, p.toolInvocation if p.type == "tool-invocation" else None) for p in r.shape.messages[0].content.parts]

                assert read(accepted) == read(whole)

    @pytest.mark.parametrize(
        "part, path",
        [
            ({"type": "tool-weather", "toolCallId": "c1", "state": "done"}, "messages[0].parts[0].state"),
            ({"type": "file", "url": "https://x"}, "messages[0].parts[0].mediaType"),
            ({"type": "text", "text": 5}, "messages[0].parts[0].text"),
            ("hello", "messages[0].parts[0]"),
        ],
    )
    def test_a_bad_part_is_named_by_where_the_client_sent_it(self, part, path):
        with pytest.raises(Rejected) as e:
            decode_request(request([{"id": "u1", "role": "user", "parts": [part]}]), "q")
        assert e.value.type == "schema" and path in e.value.message

    def test_a_request_may_mix_both_forms_and_a_bad_stored_message_is_still_named(self):
        ui = {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}
        stored = {"id": "u0", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "before"}]}}
        assert [m.id for m in decode_request(request([stored, ui]), "q").shape.messages] == ["u0", "u1"]
        with pytest.raises(Rejected) as e:
            decode_request(request([{**stored, "role": "tool"}, ui]), "q")
        assert e.value.type == "schema" and "messages[0].role" in e.value.message

    def test_a_request_with_no_ui_message_is_rejected_as_before(self):
        with pytest.raises(Rejected) as e:
            decode_request(request([{"id": "u1", "role": "user", "content": {"format": 2, "parts": "x"}}]), "q")
        assert e.value.type == "schema" and "content.parts" in e.value.message

"""A reply as it streams: the chunks fold into the message saved (`memfilter.core.reply_stream`),
and a streamed chat completion becomes those chunks (`memfilter.core.chat_completions`). The
AI SDK's own client folds the same chunks in tests/node/gateway.test.mjs, where the stored
message and the client's are compared."""

from __future__ import annotations

import pytest

from memfilter.core import origin
from memfilter.core.chat_completions import Completion, request
from memfilter.core.reply_stream import BadChunk, Reply


def folded(chunks, reply=None):
    reply = reply or Reply("m1")
    for chunk in chunks:
        reply.add(chunk)
    return reply


def text_chunks(id_, *deltas):
    return [{"type": "text-start", "id": id_}, *({"type": "text-delta", "id": id_, "delta": d} for d in deltas), {"type": "text-end", "id": id_}]


class TestChunksFoldAsTheAISDKFoldsThem:
    def test_text_deltas_make_one_done_text_part_per_text_id(self):
        reply = folded([{"type": "start-step"}, *text_chunks("a", "hel", "lo"), {"type": "finish-step"}])
        assert reply.ui() == {"id": "m1", "role": "assistant", "parts": [{"type": "step-start"}, {"type": "text", "text": "hello", "state": "done"}]}

    def test_reasoning_keeps_its_id(self):
        reply = folded([{"type": "reasoning-start", "id": "r"}, {"type": "reasoning-delta", "id": "r", "delta": "hmm"}, {"type": "reasoning-end", "id": "r"}])
        assert reply.parts == [{"type": "reasoning", "id": "r", "text": "hmm", "state": "done"}]

    def test_a_tool_input_streams_then_becomes_available_as_a_client_call(self):
        reply = folded(
            [
                {"type": "tool-input-start", "toolCallId": "c1", "toolName": "weather"},
                {"type": "tool-input-delta", "toolCallId": "c1", "inputTextDelta": '{"city"'},
                {"type": "tool-input-delta", "toolCallId": "c1", "inputTextDelta": ': "Oslo"}'},
                {"type": "tool-input-available", "toolCallId": "c1", "toolName": "weather", "input": {"city": "Oslo"}},
            ]
        )
        assert reply.parts == [{"type": "tool-weather", "toolCallId": "c1", "state": "input-available", "input": {"city": "Oslo"}}]

    def test_metadata_of_start_and_finish_merge_key_by_key(self):
        reply = folded([{"type": "start", "messageMetadata": {"a": {"x": 1}}}, {"type": "finish", "finishReason": "stop", "messageMetadata": {"a": {"y": 2}}}])
        assert reply.ui()["metadata"] == {"a": {"x": 1, "y": 2}}

    def test_a_delta_for_a_part_never_started_is_refused(self):
        with pytest.raises(BadChunk, match="text-delta for text part 'x'"):
            folded([{"type": "text-delta", "id": "x", "delta": "a"}])
        with pytest.raises(BadChunk, match="tool-input-delta for tool call 'c9'"):
            folded([{"type": "tool-input-delta", "toolCallId": "c9", "inputTextDelta": "{"}])

    def test_a_continuation_appends_a_step_to_the_message_it_continues_with_the_same_id(self):
        answered = {
            "id": "a1",
            "role": "assistant",
            "parts": [{"type": "tool-weather", "toolCallId": "c1", "state": "output-available", "input": {}, "output": 21}],
            "metadata": {"finishReason": "tool-calls"},
        }
        reply = folded(
            [{"type": "start-step"}, *text_chunks("t", "warm"), {"type": "finish", "messageMetadata": {"finishReason": "stop"}}], Reply("a1", answered)
        )
        assert reply.ui()["id"] == "a1" and reply.ui()["metadata"] == {"finishReason": "stop"}
        assert [p["type"] for p in reply.parts] == ["tool-weather", "step-start", "text"]
        assert answered["parts"][0]["state"] == "output-available" and len(answered["parts"]) == 1  # not changed in place


class TestAReplyCutShort:
    def test_its_streaming_text_is_closed_and_a_call_still_streaming_is_an_error_naming_why(self):
        reply = folded(
            [
                {"type": "text-start", "id": "t"},
                {"type": "text-delta", "id": "t", "delta": "let me look"},
                {"type": "tool-input-start", "toolCallId": "c1", "toolName": "search"},
                {"type": "tool-input-delta", "toolCallId": "c1", "inputTextDelta": '{"q": "os'},
            ]
        )
        closing = reply.ended("stopped by the client")
        assert reply.parts == [
            {"type": "text", "text": "let me look", "state": "done"},
            {"type": "tool-search", "toolCallId": "c1", "state": "output-error", "errorText": "stopped by the client"},
        ]
        # the chunks that say so make the client's copy the same
        client = folded([{"type": "text-start", "id": "t"}, {"type": "text-delta", "id": "t", "delta": "let me look"}, *closing[:1]])
        client.add({"type": "tool-input-start", "toolCallId": "c1", "toolName": "search"})
        client.add(closing[1])
        assert client.parts == reply.parts

    def test_a_call_whose_input_was_whole_keeps_it(self):
        reply = folded(
            [{"type": "tool-input-start", "toolCallId": "c1", "toolName": "f"}, {"type": "tool-input-delta", "toolCallId": "c1", "inputTextDelta": "{}"}]
        )
        reply.ended("failed")
        assert reply.parts[0]["input"] == {} and reply.parts[0]["state"] == "output-error"


def streamed(*deltas, finish="stop", usage=None):
    """Chat-completion chunks with these deltas, the last with `finish`."""
    chunks = [{"model": "gpt-x", "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({"model": "gpt-x", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    if usage:
        chunks.append({"model": "gpt-x", "choices": [], "usage": usage})
    return chunks


def completed(chunks):
    completion = Completion("k")
    out = [c for chunk in chunks for c in completion.add(chunk)]
    return out + completion.finish()


class TestAStreamedChatCompletion:
    def test_content_deltas_are_text_deltas_and_the_finish_carries_model_reason_and_usage(self):
        out = completed(
            streamed(
                {"role": "assistant", "content": ""},
                {"content": "Hel"},
                {"content": "lo"},
                usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
            )
        )
        assert [c["type"] for c in out] == ["start-step", "text-start", "text-delta", "text-delta", "text-end", "finish-step", "finish"]
        assert out[-1] == {
            "type": "finish",
            "finishReason": "stop",
            "messageMetadata": {"model": "gpt-x", "finishReason": "stop", "usage": {"inputTokens": 5, "outputTokens": 2, "totalTokens": 7}},
        }
        assert folded(out).parts[1] == {"type": "text", "text": "Hello", "state": "done"}

    def test_a_tool_call_streams_its_arguments_and_is_available_at_the_end(self):
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}
        pieces = [
            {"tool_calls": [call]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]},
        ]
        out = completed(streamed(*pieces, finish="tool_calls"))
        assert [c["type"] for c in out] == [
            "start-step",
            "tool-input-start",
            "tool-input-delta",
            "tool-input-delta",
            "tool-input-available",
            "finish-step",
            "finish",
        ]
        assert out[-1]["finishReason"] == "tool-calls"
        assert folded(out).parts[1] == {"type": "tool-weather", "toolCallId": "call_1", "state": "input-available", "input": {"city": "Oslo"}}

    def test_arguments_that_are_not_json_are_a_tool_input_error_not_a_call_to_answer(self):
        call = {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{oops"}}
        part = folded(completed(streamed({"tool_calls": [call]}, finish="tool_calls"))).parts[1]
        assert part["state"] == "output-error" and "not JSON" in part["errorText"]

    def test_reasoning_comes_before_the_text_and_is_closed_when_the_text_begins(self):
        out = completed(streamed({"reasoning_content": "hmm"}, {"content": "yes"}))
        assert [p["type"] for p in folded(out).parts] == ["step-start", "reasoning", "text"]

    def test_finish_reasons_are_the_protocols(self):
        assert completed(streamed({"content": "a"}, finish="length"))[-1]["finishReason"] == "length"
        assert completed(streamed({"content": "a"}, finish="content_filter"))[-1]["finishReason"] == "content-filter"
        assert completed(streamed({"content": "a"}, finish="something_new"))[-1]["finishReason"] == "other"


class TestWhatTheModelIsSent:
    def test_the_system_prompt_comes_first_and_unset_sampling_is_left_to_the_endpoint(self):
        context = [{"role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "hi"}]}}]
        body = request(context, "m", "be terse", [{"name": "f", "description": "", "parameters": {"type": "object"}}], temperature=0.3, top_p=None)
        assert body["messages"] == [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]
        assert (body["stream"], body["stream_options"], body["temperature"]) == (True, {"include_usage": True}, 0.3)
        assert "top_p" not in body and body["tools"] == [{"type": "function", "function": {"name": "f", "description": "", "parameters": {"type": "object"}}}]

    def test_a_users_image_and_data_file_go_as_content_parts(self):
        parts = [
            {"type": "text", "text": "look"},
            {"type": "file", "mimeType": "image/png", "data": "https://x/cat.png"},
            {"type": "file", "mimeType": "application/pdf", "data": "data:application/pdf;base64,AAAA", "filename": "a.pdf"},
            {"type": "file", "mimeType": "application/pdf", "data": "https://x/b.pdf"},  # a URL the API cannot take: left out
        ]
        [message] = request([{"role": "user", "content": {"format": 2, "parts": parts}}], "m")["messages"]
        assert message["content"] == [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
            {"type": "file", "file": {"file_data": "data:application/pdf;base64,AAAA", "filename": "a.pdf"}},
        ]


class TestOnlyTheRunnerMakesAReplyStream:
    def test_an_attempt_verifies_for_its_request_thread_and_resource_only(self):
        made = origin.attempt(b"s" * 32, "q1", "t1", "r1", "nonce")
        assert origin.is_attempt(made, b"s" * 32, "q1", "t1", "r1")
        for request_id, thread, resource in (("q2", "t1", "r1"), ("q1", "t2", "r1"), ("q1", "t1", "r2")):
            assert not origin.is_attempt(made, b"s" * 32, request_id, thread, resource)
        assert not origin.is_attempt(made, b"another secret!!", "q1", "t1", "r1")
        assert not origin.is_attempt("nonce", b"s" * 32, "q1", "t1", "r1") and not origin.is_attempt("", b"s" * 32, "q1", "t1", "r1")

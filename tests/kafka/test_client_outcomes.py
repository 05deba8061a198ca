"""A client never waits forever: `Client.ask` returns a request's filtered input, raises its
rejection with the dead letter's reason, or times out saying what it waited for; `memfilter
converse` never reuses a request id and reports a rejection by its reason."""

from __future__ import annotations

import asyncio

import pytest
from factories import msg
from pipeline import Pipeline

from memfilter.client import Client, RequestRejected


def request(thread: str, resource: str, request_id: str, *mids: str) -> dict:
    return {"requestId": request_id, "threadId": thread, "resourceId": resource, "messages": [msg(m) for m in mids]}


def test_ask_returns_the_filtered_input_or_raises_the_rejection_by_its_reason(pipeline):
    pipeline.start_worker()

    async def go():
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            accepted = await client.ask(request("ask-a", "A", "ask-1", "ask-u1"), timeout=90)
            with pytest.raises(RequestRejected) as not_yours:
                await client.ask(request("ask-a", "B", "ask-2", "ask-u1", "ask-u2"), timeout=60)
            with pytest.raises(RequestRejected) as again:
                await client.ask(request("ask-a", "A", "ask-1", "ask-u1"), timeout=60)
            return accepted, not_yours.value, again.value

    accepted, not_yours, again = asyncio.run(go())
    assert (accepted.requestId, [m["id"] for m in accepted.messages]) == ("ask-1", ["ask-u1"])
    assert (not_yours.request_id, not_yours.type) == ("ask-2", "ownership") and "belongs to" in not_yours.message
    assert again.type == "duplicate" and pipeline.topics.requests in again.message


def test_ask_without_a_worker_times_out_naming_the_request_and_the_topics(pipeline):
    async def go():
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            await client.ask(request("ask-b", "A", "ask-lonely", "ask-u1"), timeout=3)

    with pytest.raises(TimeoutError, match=f"no filtered input or dead letter for request ask-lonely on {pipeline.topics.filtered}.*is a worker running"):
        asyncio.run(go())


def test_converse_twice_on_one_thread_reuses_no_request_id_and_names_a_rejection(pipeline: Pipeline):
    pipeline.start_worker()
    pipeline.start_agent()
    first = pipeline.memfilter("converse", "--thread", "conv-1", "--resource", "A", "hello", timeout=180)
    second = pipeline.memfilter("converse", "--thread", "conv-1", "--resource", "A", "hello again", timeout=180)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "< " in second.stdout  # answered: not a duplicate of the first run's request
    other = pipeline.memfilter("converse", "--thread", "conv-1", "--resource", "B", "mine now", timeout=180)
    assert other.returncode == 1 and "was rejected (ownership)" in other.stderr, other.stdout + other.stderr

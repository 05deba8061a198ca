"""What Redis keeps of processed requests, on the real stack: a request whose outputs a crashed
worker never committed is emitted by the next one byte for byte; once outputs are committed
the record is dropped; a client's retry inside the thread's retry window is a `duplicate`
dead letter, never a second filtered input, and after the window it is decided again."""

from __future__ import annotations

import asyncio
import json

from factories import T0
from pipeline import Collector, header, publish, read

from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record


def request(thread: str, request_id: str, texts: list[str], ts: int = T0) -> tuple[bytes, bytes, int]:
    messages = [{"id": f"{thread}-u{k}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": t}]}} for k, t in enumerate(texts)]
    body = {"requestId": request_id, "threadId": thread, "resourceId": "r1", "messages": messages}
    return thread.encode(), json.dumps(body).encode(), ts


async def pending_keys(pipeline) -> list[bytes]:
    client, _ = pipeline.store()
    try:
        return [k async for k in client.scan_iter(match=f"{pipeline.prefix}:t:*:pending:*")]
    finally:
        await client.aclose()


def test_a_request_saved_by_a_worker_that_died_before_its_kafka_commit_comes_out_byte_for_byte(pipeline):
    """The dead worker is played by the processor itself: it decides and saves the request in
    Redis, and nothing reaches Kafka. The worker that takes up the partition then consumes the
    request from the same position."""
    t = pipeline.topics

    async def run():
        await publish(pipeline.bootstrap, t.requests, [request("crash-t", "crash-r0", ["hello", "again"])])
        [consumed] = await read(pipeline.bootstrap, [t.requests], until=lambda recs: len(recs) == 1)
        client, store = pipeline.store()
        try:
            died_with = await Processor(store, t, secret=pipeline.secret).process([Record.of(consumed)])
        finally:
            await client.aclose()
        assert len(await pending_keys(pipeline)) == 1
        pipeline.start_worker()
        async with Collector(pipeline.bootstrap, [t.filtered, t.persist], isolation_level="read_committed") as seen:
            assert await seen.wait_for(lambda recs: len(recs) == 2)
            emitted = sorted((r.topic, r.key, r.value) for r in seen.records)
        for _ in range(50):  # dropped once the worker's transaction committed
            if not await pending_keys(pipeline):
                break
            await asyncio.sleep(0.1)
        return died_with, emitted, await pending_keys(pipeline)

    died_with, emitted, left = asyncio.run(run())
    assert emitted == sorted((o.topic, o.key, o.value) for o in died_with)
    assert left == []


def test_a_retry_inside_the_window_is_a_duplicate_and_after_it_is_decided_again(pipeline):
    t = pipeline.topics

    async def run():
        pipeline.start_worker(MEMFILTER_RETRY_WINDOW="3")
        async with Collector(pipeline.bootstrap, [t.filtered, t.dlq], isolation_level="read_committed") as seen:
            first = request("retry-t", "retry-r0", ["hello"])
            await publish(pipeline.bootstrap, t.requests, [first])
            assert await seen.wait_for(lambda recs: len(recs) == 1)
            await publish(pipeline.bootstrap, t.requests, [first])  # the client did not hear back, and retries
            assert await seen.wait_for(lambda recs: len(recs) == 2)
            later = [request("retry-t", f"retry-r{k}", ["hello"] + [f"more {j}" for j in range(1, k + 1)]) for k in range(1, 4)]
            await publish(pipeline.bootstrap, t.requests, later + [first])  # three requests later: out of the window of 3
            assert await seen.wait_for(lambda recs: len(recs) == 6)
            await asyncio.sleep(1)
            return list(seen.records), await pending_keys(pipeline)

    records, pending = asyncio.run(run())
    filtered = [json.loads(r.value) for r in records if r.topic == t.filtered]
    [letter] = [r for r in records if r.topic == t.dlq]
    original = filtered[0]["source"]
    assert header(letter, "error.type") == "duplicate"
    assert header(letter, "memfilter.duplicate-of") == f"{t.requests}-{original['partition']}-{original['offset']}"
    assert [f["requestId"] for f in filtered] == ["retry-r0", "retry-r1", "retry-r2", "retry-r3", "retry-r0"]
    assert filtered[-1]["source"]["offset"] > filtered[-2]["source"]["offset"]  # decided again, at its own position
    assert pending == []

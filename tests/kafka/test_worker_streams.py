"""The worker on long interleaved streams: per-thread order, read-your-writes, crashes, outages.

The stream: 1,000 threads of 10 requests each, published interleaved (every thread's first
request, then every thread's second, ...). Request k of a thread is what `useChat` sends
when the user types message k: the echo of messages 0..k-1 and the new message k, with the
client's ids and no timestamps. So request k must see what request k-1 saved: its filtered
input holds the stored copies of 0..k-1 (with their server-made `createdAt`) and only message
k is saved.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections import defaultdict

import pytest
from factories import T0
from pipeline import Collector, Pipeline, free_port, publish

from memfilter.core.filtered import whole

THREADS, TURNS = 1000, 10


def user(thread: str, k: int) -> dict:
    return {"id": f"{thread}-u{k}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"message {k}"}]}}


def stream(threads: int = THREADS, turns: int = TURNS, tag: str = "s"):
    """(key, value, timestamp) of every request, interleaved across threads."""
    for k in range(turns):
        for i in range(threads):
            thread = f"{tag}{i}"
            request = {
                "requestId": f"{thread}-r{k}",
                "threadId": thread,
                "resourceId": f"user-{i % 50}",
                "messages": [user(thread, j) for j in range(k + 1)],
            }
            yield thread.encode(), json.dumps(request).encode(), T0 + k


def requests_seen(records, topic: str) -> int:
    return len({json.loads(r.value)["requestId"] for r in records if r.topic == topic})


def check(records, topics, threads: int = THREADS, turns: int = TURNS, tag: str = "s") -> dict[str, int]:
    """Every request once in per-thread order (repeats byte-identical), each seeing its past."""
    first: dict[str, bytes] = {}
    order: dict[str, list[str]] = defaultdict(list)
    persisted: dict[str, list] = {}
    repeats = 0
    for r in records:
        if r.topic == topics.dlq:
            raise AssertionError(f"unexpected dead letter: {dict(r.headers)}")
        event = json.loads(r.value)
        key = (r.topic, event["requestId"])
        if key in first:
            assert first[key] == r.value, f"a repeat of {key} differs from its first copy"
            repeats += 1
            continue
        first[key] = r.value
        if r.topic == topics.filtered:
            order[event["threadId"]].append(event["requestId"])
        else:
            persisted[event["requestId"]] = event["messages"]

    assert len(order) == threads
    for i in range(threads):
        thread = f"{tag}{i}"
        assert order[thread] == [f"{thread}-r{k}" for k in range(turns)], f"{thread} out of order or missing"
        stamps = []
        for k in range(turns):
            event = whole(json.loads(first[(topics.filtered, f"{thread}-r{k}")]))
            assert [m["id"] for m in event["messages"]] == [f"{thread}-u{j}" for j in range(k + 1)]
            [saved] = persisted[f"{thread}-r{k}"]
            assert saved["id"] == f"{thread}-u{k}"
            for j, m in enumerate(event["messages"][:-1]):
                assert m == persisted[f"{thread}-r{j}"][0], f"{thread} request {k} did not see message {j} as saved"
            stamps.append(saved["createdAt"])
        assert stamps == sorted(stamps) and len(set(stamps)) == turns
    return {"repeats": repeats}


async def check_redis(pipeline: Pipeline, threads: int = THREADS, turns: int = TURNS, tag: str = "s") -> None:
    """Redis holds every row of every thread once, in save order."""
    client, store = pipeline.store()
    try:
        pipe = client.pipeline(transaction=False)
        for i in range(threads):
            k = store.keys(f"{tag}{i}")
            pipe.lrange(k.order, 0, -1)
            pipe.hlen(k.rows)
        replies = await pipe.execute()
    finally:
        await client.aclose()
    for i in range(threads):
        ids, count = replies[2 * i], replies[2 * i + 1]
        assert [x.decode() for x in ids] == [f"{tag}{i}-u{k}" for k in range(turns)]
        assert count == turns


def all_done(topics, n):
    return lambda recs: requests_seen(recs, topics.filtered) >= n


def test_two_workers_keep_per_thread_order_and_each_request_sees_the_previous_ones_writes(pipeline):
    t = pipeline.topics

    async def run():
        pipeline.start_worker()
        pipeline.start_worker()
        async with Collector(pipeline.bootstrap, [t.filtered, t.persist, t.dlq]) as seen:
            await publish(pipeline.bootstrap, t.requests, stream())
            assert await seen.wait_for(all_done(t, THREADS * TURNS)), "not every request came out"
            await asyncio.sleep(1)  # anything still in flight
            return list(seen.records)

    records = asyncio.run(run())
    check(records, t)
    asyncio.run(check_redis(pipeline))


@pytest.mark.containers
def test_workers_killed_mid_stream_lose_nothing_and_change_nothing(pipeline):
    """SIGKILL one worker a third of the way, restart it; kill the other at two thirds (on
    the container backend: SIGKILL to the worker's container, and a new container).
    A consumer reading everything may see an event again (sent in a transaction the crash left
    open, aborted when a worker takes up the partitions), byte-identical; a `read_committed`
    consumer sees every event exactly once."""
    t = pipeline.topics
    total = THREADS * TURNS

    async def run():
        first, second = pipeline.start_worker(), pipeline.start_worker()
        async with (
            Collector(pipeline.bootstrap, [t.filtered, t.persist, t.dlq]) as seen,
            Collector(pipeline.bootstrap, [t.filtered, t.persist, t.dlq], isolation_level="read_committed") as committed,
        ):
            publishing = asyncio.create_task(publish(pipeline.bootstrap, t.requests, stream()))
            assert await seen.wait_for(all_done(t, total // 3))
            pipeline.kill(first)
            pipeline.start_worker()
            assert await seen.wait_for(all_done(t, 2 * total // 3))
            pipeline.kill(second)  # the restarted worker takes over its partitions
            await publishing
            assert await committed.wait_for(all_done(t, total)), "not every request came out after the crashes"
            await asyncio.sleep(1)
            return list(seen.records), list(committed.records)

    everything, committed = asyncio.run(run())
    print(f"events seen again by a read_uncommitted consumer: {check(everything, t)['repeats']}")
    assert check(committed, t)["repeats"] == 0
    asyncio.run(check_redis(pipeline))


def test_a_redis_restart_mid_stream_stalls_the_worker_and_loses_nothing(services, tmp_path):
    """The worker's Redis is stopped after the first third of the stream is decided, the rest
    is published while it is down, and Redis comes back a few seconds later. It comes back
    slowly, as a big one does: replaying its append-only file (~9,000 commands) at 0.7 ms a
    command (`key-load-delay`), for over 6 s it accepts connections and answers LOADING. The
    worker's retries, at most 5 s apart, meet that answer at least once."""
    port = free_port()
    conf = tmp_path / "redis.conf"
    conf.write_text(f'bind 127.0.0.1\nport {port}\ndir {tmp_path}\nappendonly yes\nappendfsync always\nsave ""\n')

    def start_redis() -> subprocess.Popen:
        server = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout.strip() != b"PONG":
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        return server

    server = start_redis()
    pipeline = Pipeline(services.bootstrap, f"redis://127.0.0.1:{port}/0")
    asyncio.run(pipeline.create_topics())
    t = pipeline.topics
    threads = 300

    async def run():
        nonlocal server
        pipeline.start_worker()
        requests = list(stream(threads=threads))
        first = len(requests) // 3
        async with Collector(pipeline.bootstrap, [t.filtered, t.persist, t.dlq]) as seen:
            await publish(pipeline.bootstrap, t.requests, requests[:first])
            assert await seen.wait_for(all_done(t, first))
            subprocess.run(["redis-cli", "-p", str(port), "shutdown"], capture_output=True)
            server.wait(10)
            await publish(pipeline.bootstrap, t.requests, requests[first:])
            await asyncio.sleep(3)
            assert requests_seen(seen.records, t.filtered) == first  # nothing decided without Redis
            with conf.open("a") as more:
                more.write("key-load-delay 700\n")
            server = start_redis()
            assert await seen.wait_for(all_done(t, threads * TURNS)), "the worker did not go on after Redis came back"
            await asyncio.sleep(1)
            return list(seen.records)

    try:
        records = asyncio.run(run())
        check(records, t, threads=threads)
        asyncio.run(check_redis(pipeline, threads=threads))
        log = pipeline.log_path(0).read_text()
        loading = "Redis unavailable while handling a batch (BusyLoadingError: Redis is loading the dataset in memory)"
        assert loading in log
        assert "Redis unavailable" not in log.rsplit(loading, 1)[1], "batches failed again after Redis was back"
    finally:
        pipeline.stop_all()
        server.terminate()
        server.wait(10)


def test_outputs_larger_than_a_producer_batch_come_out_whole_and_in_order(pipeline):
    """Five 400 KB requests of one thread in one fetch: their outputs fill more than one
    1 MiB producer batch of the same partition."""
    t = pipeline.topics
    text = "x" * 400_000
    requests = [
        (
            b"big",
            json.dumps(
                {
                    "requestId": f"big-r{k}",
                    "threadId": "big",
                    "resourceId": "r1",
                    "messages": [{**user("big", k), "content": {"format": 2, "parts": [{"type": "text", "text": text}]}}],
                }
            ).encode(),
            T0 + k,
        )
        for k in range(5)
    ]

    async def run():
        await publish(pipeline.bootstrap, t.requests, requests)
        pipeline.start_worker(MEMFILTER_MAX_BYTES=str(4 << 20))
        async with Collector(pipeline.bootstrap, [t.filtered, t.persist, t.dlq]) as seen:
            assert await seen.wait_for(lambda recs: sum(r.topic == t.persist for r in recs) >= 5), "not every output came out"
            await asyncio.sleep(1)
            return list(seen.records)

    records = asyncio.run(run())
    for topic in (t.filtered, t.persist):
        events = [json.loads(r.value) if topic == t.persist else whole(json.loads(r.value)) for r in records if r.topic == topic]
        assert [e["requestId"] for e in events] == [f"big-r{k}" for k in range(5)]
        assert all(len(e["messages"][-1]["content"]["parts"][0]["text"]) == len(text) for e in events)
    assert not [r for r in records if r.topic == t.dlq]

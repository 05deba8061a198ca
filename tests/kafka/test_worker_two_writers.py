"""A thread's two writers on the real stack: `useChat` clients and an agent runner that saves its
replies through `persist-messages`, with workers crashing and stalling under them.

Each client sends its next request only once the agent's reply to the last one is
acknowledged by the broker (a pending client tool call is answered with its result first), as
a chat UI does. The agent (here, in the test) reads `filtered-inputs` (read_committed) and
saves each reply keyed by the thread id. Whatever the timing, each thread's stored history
must be its conversation in the order it happened, with every tool result kept.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import murmur2
from pipeline import Collector, Pipeline, dump, end_offsets, header, publish, read

from memfilter.store import reads

TURNS = 3


def user(thread: str, k: int) -> dict:
    return {"id": f"{thread}-u{k}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"question {k}"}]}}


def answer(mid: str, words: str) -> dict:
    return {"id": mid, "role": "assistant", "createdAt": _now(), "content": {"format": 2, "parts": [{"type": "text", "text": words}]}}


def pending_call(thread: str, k: int) -> dict:
    invocation = {"state": "call", "toolCallId": f"{thread}-c{k}", "toolName": "confirm", "args": {"turn": k}}
    return {
        "id": f"{thread}-a{k}",
        "role": "assistant",
        "createdAt": _now(),
        "content": {"format": 2, "parts": [{"type": "tool-invocation", "toolInvocation": invocation}]},
    }


def with_result(call: dict) -> dict:
    part = call["content"]["parts"][0]
    return {
        **call,
        "content": {**call["content"], "parts": [{**part, "toolInvocation": {**part["toolInvocation"], "state": "result", "result": {"ok": True}}}]},
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() * 1000) % 1000:03d}Z"


@dataclass
class Agent:
    """Answers every filtered input of the conversations: a pending tool call on even turns of
    even threads, a text otherwise; a tool result is answered with a text (`-b<k>`). Each
    reply is acknowledged (acks=all) before the client is told. `repeats`: each reply is
    published again that many times, at random later moments."""

    pipeline: Pipeline
    repeats: int = 0
    replies: dict[str, asyncio.Future] = field(default_factory=dict)  # requestId -> the reply, once acknowledged
    sent: dict[str, dict] = field(default_factory=dict)  # reply id -> the reply as saved
    _later: list[asyncio.Task] = field(default_factory=list)

    def reply_to(self, request_id: str) -> asyncio.Future:
        return self.replies.setdefault(request_id, asyncio.get_running_loop().create_future())

    async def run(self) -> None:
        t = self.pipeline.topics
        consumer = AIOKafkaConsumer(
            t.filtered, bootstrap_servers=self.pipeline.bootstrap, group_id=None, auto_offset_reset="earliest", isolation_level="read_committed"
        )
        self.producer = AIOKafkaProducer(bootstrap_servers=self.pipeline.bootstrap, acks="all", enable_idempotence=True)
        await consumer.start()
        await self.producer.start()
        try:
            async for record in consumer:
                filtered = json.loads(record.value)
                if filtered["requestId"] not in self.replies or self.replies[filtered["requestId"]].done():
                    continue  # the load's requests, or a copy
                await self._answer(filtered)
        finally:
            for task in self._later:
                task.cancel()
            await consumer.stop()
            await self.producer.stop()

    async def _answer(self, filtered: dict) -> None:
        thread, request_id = filtered["threadId"], filtered["requestId"]
        k = int(request_id.rsplit("-", 1)[1][1:])
        if request_id.split("-")[-1].startswith("t"):  # the client's tool result
            reply = answer(f"{thread}-b{k}", f"done {k}")
        elif k % 2 == 0 and int(thread.rsplit("-", 1)[1]) % 2 == 0:
            reply = pending_call(thread, k)
        else:
            reply = answer(f"{thread}-a{k}", f"answer {k}")
        value = json.dumps({"requestId": f"reply-{request_id}", "threadId": thread, "resourceId": filtered["resourceId"], "messages": [reply]}).encode()
        await self.producer.send_and_wait(self.pipeline.topics.persist, value, key=thread.encode())
        self.sent[reply["id"]] = reply
        for _ in range(self.repeats):
            self._later.append(asyncio.create_task(self._again(thread, value)))
        self.replies[request_id].set_result(reply)

    async def _again(self, thread: str, value: bytes) -> None:
        await asyncio.sleep(random.uniform(0.05, 3))
        await self.producer.send_and_wait(self.pipeline.topics.persist, value, key=thread.encode())


@dataclass
class Clients:
    """`useChat` clients, publishing through one producer."""

    pipeline: Pipeline
    agent: Agent

    async def __aenter__(self) -> Clients:
        self.producer = AIOKafkaProducer(bootstrap_servers=self.pipeline.bootstrap, acks="all", enable_idempotence=True)
        await self.producer.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.producer.stop()

    async def converse(self, thread: str, gap: float, turns: int = TURNS, until: asyncio.Event | None = None) -> list[dict]:
        """One client's conversation (`turns` turns, or fewer once `until` is set); its
        messages in the order they happened."""
        echo: list[dict] = []
        for k in range(turns):
            if until is not None and until.is_set():
                break
            echo.append(user(thread, k))
            reply = await self._send(thread, f"{thread}-r{k}", echo)
            echo.append(reply)
            if reply["content"]["parts"][0]["type"] == "tool-invocation":
                await asyncio.sleep(gap)
                echo[-1] = with_result(reply)
                echo.append(await self._send(thread, f"{thread}-t{k}", echo))
            await asyncio.sleep(gap)
        return echo

    async def _send(self, thread: str, request_id: str, messages: list[dict]) -> dict:
        """Publish a request; the agent's reply to it, once acknowledged."""
        waiting = self.agent.reply_to(request_id)
        value = {"requestId": request_id, "threadId": thread, "resourceId": "r1", "messages": messages}
        await self.producer.send_and_wait(self.pipeline.topics.requests, json.dumps(value).encode(), key=thread.encode())
        return await asyncio.wait_for(waiting, 120)


async def load(pipeline: Pipeline, stop: asyncio.Event, tag: str) -> int:
    """Other threads' requests, a few hundred a second, until `stop`."""
    n = 0
    while not stop.is_set():
        batch = []
        for _i in range(200):
            thread = f"{tag}-load{n % 500}"
            value = {"requestId": f"{thread}-{n}", "threadId": thread, "resourceId": "r1", "messages": [user(thread, n)]}
            batch.append((thread.encode(), json.dumps(value).encode(), int(time.time() * 1000)))
            n += 1
        await publish(pipeline.bootstrap, pipeline.topics.requests, batch)
        await asyncio.sleep(0.3)
    return n


async def problems(pipeline: Pipeline, agent: Agent, conversations: dict[str, list[dict]]) -> list[str]:
    """How each thread's stored history differs from its conversation: ids in order, every
    reply stored as the agent saved it (tool calls with the client's result). The last
    replies are waited for (30 s at most): a client does not wait for its last one to be stored."""
    client, store = pipeline.store()
    out = []
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            counts = [await client.llen(store.keys(thread).order) for thread in conversations]
            if counts == [len(messages) for messages in conversations.values()]:
                break
            await asyncio.sleep(0.2)
        for thread, messages in conversations.items():
            rows = [json.loads(r) for r in await reads.thread_rows(store, thread)]
            ids = [r["id"] for r in rows]
            if ids != [m["id"] for m in messages]:
                out.append(f"{thread}: stored {ids}")
                continue
            for row, m in zip(rows, messages):
                if m["role"] == "assistant" and row["content"]["parts"] != m["content"]["parts"]:
                    out.append(f"{thread}: {m['id']} stored as {row['content']['parts']}")
    finally:
        await client.aclose()
    return out


async def log_of(pipeline: Pipeline, threads: set[str]) -> str:
    """These threads' records on the requests and persist topics, in log order, for a failure's
    report: where each request and save was, and when it was stamped."""
    t = pipeline.topics
    records = await read(pipeline.bootstrap, [t.requests, t.persist, t.dlq], until=lambda _: False, timeout=3)
    lines = []
    for r in records:
        if r.key is not None and r.key.decode() in threads:
            event = json.loads(r.value)
            ids = [m.get("id") for m in event.get("messages", [])][-2:]
            lines.append(f"{r.topic}-{r.partition}@{r.offset} ts={r.timestamp} {event.get('requestId')} {ids} {dict(r.headers).get('error.type') or ''}")
    return "\n".join(lines)


def not_once(records, request_ids) -> list[str]:
    """Request ids seen more than once, and those of `request_ids` never seen."""
    seen: dict[str, int] = {}
    for r in records:
        rid = json.loads(r.value)["requestId"]
        seen[rid] = seen.get(rid, 0) + 1
    return [rid for rid, n in seen.items() if n > 1] + [rid for rid in request_ids if rid not in seen]


def test_replies_are_stored_between_the_requests_they_came_between_at_any_gap_under_load(pipeline):
    """30 threads × 3 turns, at gaps of 0, 20 and 100 ms between a reply's ack and the next
    request, while other threads' requests keep the worker busy."""
    pipeline.start_worker()

    async def run():
        agent = Agent(pipeline)
        answering = asyncio.create_task(agent.run())
        stop = asyncio.Event()
        loading = asyncio.create_task(load(pipeline, stop, "l"))
        try:
            conversations = {}
            async with Clients(pipeline, agent) as clients:
                for gap in (0, 0.02, 0.1):
                    threads = [f"g{int(gap * 1000)}-{i}" for i in range(30)]
                    done = await asyncio.gather(*(clients.converse(t, gap) for t in threads))
                    conversations.update(zip(threads, done))
            return await problems(pipeline, agent, conversations)
        finally:
            stop.set()
            await loading
            answering.cancel()
            await asyncio.gather(answering, return_exceptions=True)

    assert asyncio.run(run()) == []


def test_a_killed_worker_and_replies_published_again_leave_the_same_history(pipeline):
    """Two workers, one SIGKILLed mid-run (and restarted); every reply is published three more
    times at random later moments. Every request's filtered input is committed once, and a
    rebuild from the log gives the live history: the processor's saves go back among the
    agent's where they were applied, and the repeats change nothing there either."""
    env = {"MEMFILTER_SESSION_TIMEOUT": "3"}
    first, _ = pipeline.start_worker(**env), pipeline.start_worker(**env)

    async def run():
        agent = Agent(pipeline, repeats=3)
        answering = asyncio.create_task(agent.run())
        try:
            async with (
                Collector(pipeline.bootstrap, [pipeline.topics.filtered], isolation_level="read_committed") as committed,
                Clients(pipeline, agent) as clients,
            ):
                threads = [f"k-{i}" for i in range(30)]
                talking = asyncio.gather(*(clients.converse(t, random.choice((0, 0.02, 0.1)), turns=8) for t in threads))
                while len(agent.sent) < 60:  # mid-run
                    await asyncio.sleep(0.05)
                pipeline.kill(first)
                pipeline.start_worker(**env)
                conversations = dict(zip(threads, await talking))
                await asyncio.sleep(4)  # the last repeats land
                return await problems(pipeline, agent, conversations), not_once(committed.records, list(agent.replies))
        finally:
            answering.cancel()
            await asyncio.gather(answering, return_exceptions=True)

    wrong, repeated_or_missing = asyncio.run(run())
    assert wrong == [] and repeated_or_missing == [], asyncio.run(log_of(pipeline, {w.split(":")[0] for w in wrong}))
    other_db = pipeline.redis_url.rsplit("/", 1)[0] + "/3"
    rebuilt = pipeline.memfilter("history", "rebuild", "--redis-url", other_db)
    assert rebuilt.returncode == 0, rebuilt.stderr
    live, again = asyncio.run(dump(pipeline, pipeline.prefix)), asyncio.run(dump(pipeline, pipeline.prefix, other_db))
    assert len(live) > 90 and again == live


def test_a_stalled_worker_that_wakes_after_losing_its_tasks_changes_nothing_and_rejoins_in_process(pipeline):
    """Ten times, a worker is stopped (SIGSTOP) past its session timeout, with conversations and
    other load running, and resumed at a random moment: just as the others take over its tasks,
    or well after. Fenced out (by Kafka or by Redis), it gives up its tasks and rejoins the
    group in-process: no worker exits, nothing is answered twice or lost."""
    env = {"MEMFILTER_SESSION_TIMEOUT": "3"}
    workers = [pipeline.start_worker(**env), pipeline.start_worker(**env)]

    async def run():
        agent = Agent(pipeline)
        answering = asyncio.create_task(agent.run())
        stop = asyncio.Event()
        loading = asyncio.create_task(load(pipeline, stop, "z"))
        try:
            async with (
                Collector(pipeline.bootstrap, [pipeline.topics.filtered], isolation_level="read_committed") as committed,
                Clients(pipeline, agent) as clients,
            ):
                threads = [f"z-{i}" for i in range(20)]
                stalls_over = asyncio.Event()
                talking = asyncio.gather(*(clients.converse(t, 0.2, turns=40, until=stalls_over) for t in threads))
                for _ in range(10):
                    await asyncio.sleep(random.uniform(0.5, 2))
                    stalled = random.choice(workers)
                    stalled.send_signal(signal.SIGSTOP)
                    await asyncio.sleep(random.uniform(3, 5))  # past the session timeout: 1 to 1.7 times it
                    stalled.send_signal(signal.SIGCONT)
                stalls_over.set()
                conversations = dict(zip(threads, await talking))
                stop.set()
                await asyncio.sleep(5)  # the load's last requests come out
                return await problems(pipeline, agent, conversations), not_once(committed.records, list(agent.replies))
        finally:
            stop.set()
            await loading
            answering.cancel()
            await asyncio.gather(answering, return_exceptions=True)

    wrong, repeated_or_missing = asyncio.run(run())
    assert wrong == [] and repeated_or_missing == []
    logs = [pipeline.log_path(n).read_text() for n in range(len(workers))]
    assert [w.poll() for w in workers] == [None, None], [log[-3000:] for log in logs]
    assert not any("unexpected error" in log for log in logs), [log[-3000:] for log in logs]
    assert any("lost" in log and "rejoining the group" in log for log in logs), [log[-3000:] for log in logs]


def test_an_audit_of_a_healthy_log_finds_no_difference_with_ids_shared_across_partitions(pipeline, tmp_path):
    """10,000 requests of 1,000 threads by two workers, with agent replies saved between them;
    one thread in ten sends, as its first message, the id another thread on another partition
    sends too: whichever was decided first owns it, and the other is refused for good. A
    replay of the whole log, and of a range in its middle, finds every decision as recorded."""
    threads, turns = 1000, 10
    names = [f"h-{i}" for i in range(threads)]
    partition = {name: (murmur2(name.encode()) & 0x7FFFFFFF) % pipeline.partitions for name in names}
    sharing = {}  # thread -> the thread, on another partition, whose first message id it sends too
    for i in range(0, threads, 10):
        other = next(n for n in names[i + 1 :] if partition[n] != partition[names[i]])
        sharing[names[i]] = other

    shared_id = {name: f"shared-{name}" for name in sharing} | {other: f"shared-{name}" for name, other in sharing.items()}

    def turn(name: str, k: int) -> tuple[bytes, bytes, int]:
        messages = [user(name, j) for j in range(k + 1)]
        if name in shared_id:
            messages[0] = {**messages[0], "id": shared_id[name]}
        value = {"requestId": f"{name}-r{k}", "threadId": name, "resourceId": "r1", "messages": messages}
        return name.encode(), json.dumps(value).encode(), int(time.time() * 1000)

    def reply(name: str, k: int) -> tuple[bytes, bytes, int]:
        value = {"requestId": f"reply-{name}-{k}", "threadId": name, "resourceId": "r1", "messages": [answer(f"{name}-a{k}", f"answer {k}")]}
        return name.encode(), json.dumps(value).encode(), int(time.time() * 1000)

    async def run():
        pipeline.start_worker(), pipeline.start_worker()
        t = pipeline.topics
        async with Collector(pipeline.bootstrap, [t.filtered, t.dlq], isolation_level="read_committed") as seen:
            middle = None
            for k in range(turns):
                await publish(pipeline.bootstrap, t.requests, [turn(name, k) for name in names])
                await asyncio.sleep(0.5)
                # replies of a quarter of the threads: saved while the next requests are decided
                await publish(pipeline.bootstrap, t.persist, [reply(name, k) for name in names[k % 4 :: 4]])
                if k == 3:
                    middle = await end_offsets(pipeline.bootstrap, t.requests)
            assert await seen.wait_for(lambda recs: len(decided(recs)) >= threads * turns, timeout=300)
            await asyncio.sleep(3)  # the last replies are applied
            return middle, await end_offsets(pipeline.bootstrap, t.requests), seen.records

    middle, end, records = asyncio.run(run())
    refused = [r for r in decided(records) if r.topic == pipeline.topics.dlq]
    assert len(refused) == len(sharing) * turns  # one thread of each pair, every turn
    whole = pipeline.memfilter("replay", "--strict", "--report", str(tmp_path / "whole.json"), timeout=600)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-2000:]
    assert f"replayed {threads * turns:,} requests: {threads * turns:,} identical, 0 different" in whole.stdout
    part = pipeline.memfilter("replay", "--from", middle, "--to", end, "--strict", timeout=600)
    assert part.returncode == 0, part.stdout[-2000:] + part.stderr[-2000:]
    assert "identical, 0 different" in part.stdout


def decided(records) -> list:
    """The filtered inputs and dead letters of requests (not of refused saves)."""
    return [r for r in records if r.topic.startswith("filtered-inputs") or header(r, "source.topic").startswith("chat-requests")]


def test_a_worker_refuses_topics_whose_partitions_do_not_pair_up(services):
    """A thread's requests and saves must land on partitions of the same number: a worker given
    `persist-messages` with another partition count exits, naming both topics."""
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    t = pipeline.topics

    async def create():
        admin = AIOKafkaAdminClient(bootstrap_servers=pipeline.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, 4 if name == t.persist else 8, 1) for name in t.all()])
        finally:
            await admin.close()

    asyncio.run(create())
    worker = pipeline.start_worker()
    try:
        assert worker.wait(60) == 1
    finally:
        pipeline.stop_all()
    log = pipeline.log_path(0).read_text()
    assert f"{t.requests} has 8 partitions and {t.persist} 4; a thread's requests and saves must be read by one worker" in log

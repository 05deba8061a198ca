"""The workload's clients, and what the checker reads after.

`Clients.watch` notes when each outcome and each reply's save arrives, while `Clients.run`
makes turns from the test process and records what each was told (`checker.Sent`):
- `threads` pipelined threads publish straight onto `chat-requests` (a producer with acks=all
  and idempotence, as a `useChat` backend publishes), turn k of each the full echo of its user
  messages u0..uk, `rate` turns a second in all;
- `conversations` publish there too, their turns echoing the agent runner's replies, each sent
  once the last reply is saved;
- `chats` go through the gateway as a `useChat` page does (`chat_turn`: questions,
  regenerates, a client tool call answered), each turn once the last one's answer is read.
`read` then takes every record of `filtered-inputs`, the dead-letter topic
(`chat-requests-dlq`) and `persist-messages` (read_committed, as downstream reads), and each
thread's stored order from Redis (`mf:t:{<thread>}:order`, docs: store/layout.py's table);
`kept`, its messages in PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import aiohttp
import asyncpg
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from checker import REPLY, Outcome, Sent, outcome_of
from product import RESOURCE_HEADER
from redis.asyncio.cluster import RedisCluster

PUBLISH_TIMEOUT_S = 10.0
REPLY_WAIT_S = 60.0  # the longest a conversation waits for a turn's reply before its next turn
TURN_TIMEOUT_S = 90.0  # the longest a caller of the gateway waits for a turn's answer (its reply waits 60 s: `product.GATEWAY`)
KINDS = ("submit", "regenerate", "submit", "tool")  # a turn through the gateway, by its number: ask, regenerate, call a tool, answer it


def user(message_id: str, k: int) -> dict:
    return {"id": message_id, "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"question {k}"}]}}


class Clients:
    def __init__(self, bootstrap: str, threads: int, turns: int, conversations: int = 0, gateway: str = "", chats: int = 0):
        self.bootstrap = bootstrap
        self.gateway = gateway  # its URL, for `chats`
        tag = secrets.token_hex(3)
        self.threads = [f"jt-{tag}-{i}" for i in range(threads)]  # pipelined: each turn on the clock, whatever came of the last
        self.conversations = [f"jc-{tag}-{i}" for i in range(conversations)]  # each turn once the last one's reply is saved
        self.chats = [f"jg-{tag}-{i}" for i in range(chats)]  # through the gateway, as `useChat` talks to it
        self.told_s: dict[str, float] = {}  # a gateway turn's request id -> how long until it was told
        self.turns = turns
        self.sent: list[Sent] = []
        self.answered: dict[tuple[int, int], float] = {}  # a request's position -> when its outcome arrived (epoch s)
        self.dead: set[tuple[int, int]] = set()  # the positions of requests dead-lettered
        self.replies: dict[str, dict | None] = {}  # a request's id -> its reply's saved row (None: no reply will come)
        self.watching = asyncio.Event()

    @property
    def all(self) -> list[str]:
        return self.threads + self.conversations + self.chats

    def body(self, thread: str, request_id: str, messages: list[dict]) -> bytes:
        return json.dumps({"requestId": request_id, "threadId": thread, "resourceId": f"res-{thread}", "messages": messages}).encode()

    def request(self, thread: str, k: int) -> tuple[str, list[str], bytes]:
        ids = [f"{thread}-u{i}" for i in range(k + 1)]
        request_id = f"{thread}-r{k}"
        return request_id, ids, self.body(thread, request_id, [user(m, i) for i, m in enumerate(ids)])

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: when each outcome arrives (`answered`, by the request's position), read
        as downstream reads, from the topics' ends at the start."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, isolation_level="read_committed", enable_auto_commit=False, group_id=None)
        await consumer.start()
        try:
            kinds = {"filtered-inputs": "filtered", "chat-requests-dlq": "dlq", "persist-messages": "persist"}
            tps = [TopicPartition(t, p) for t, ps in (await _partitions(self.bootstrap, list(kinds))).items() for p in ps]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            self.watching.set()
            while not stop.is_set():
                for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                    for r in records:
                        if kinds[tp.topic] == "persist":
                            event = json.loads(r.value)
                            if event.get("requestId", "").endswith(REPLY):
                                self.replies[event["requestId"].removesuffix(REPLY)] = (event.get("messages") or [None])[0]
                            continue
                        headers = {k: v.decode(errors="replace") for k, v in r.headers or ()}
                        if (o := outcome_of(kinds[tp.topic], r.partition, r.offset, r.key, r.value, headers)) is not None:
                            self.answered.setdefault(o.at, time.time())
                            if o.contributed is None:
                                self.dead.add(o.at)
        finally:
            await consumer.stop()

    async def run(self, rate: float, think_s: float = 1.0) -> None:
        """Every turn of every pipelined thread, in order within a thread, `rate` a second in
        all; beside them, the conversations, each turn `think_s` after the last one's reply."""
        await self.watching.wait()
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True, request_timeout_ms=int(PUBLISH_TIMEOUT_S * 1000))
        await producer.start()
        try:
            until = time.monotonic() + self.turns * think_s  # the run's length: no conversation starts a turn after it
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TURN_TIMEOUT_S)) as http:
                await asyncio.gather(
                    self._pipelined(producer, rate),
                    *(self._converse(producer, thread, think_s, until) for thread in self.conversations),
                    *(self._chat(http, thread, think_s, until) for thread in self.chats),
                )
        finally:
            await producer.stop()

    async def _pipelined(self, producer: AIOKafkaProducer, rate: float) -> None:
        started = time.monotonic()
        pending = []
        for n in range(self.turns * len(self.threads)):
            await asyncio.sleep(max(0.0, started + n / rate - time.monotonic()))
            thread, k = self.threads[n % len(self.threads)], n // len(self.threads)
            request_id, ids, value = self.request(thread, k)
            sent = Sent(thread, k, request_id, ids, None, int(time.time() * 1000))
            self.sent.append(sent)
            pending.append(asyncio.create_task(self._publish(producer, sent, value)))
        await asyncio.gather(*pending)

    async def _converse(self, producer: AIOKafkaProducer, thread: str, think_s: float, until: float) -> None:
        """As `useChat` does: each turn echoes the conversation so far, the replies as saved
        included, and is sent once the last turn's reply is saved (or it was dead-lettered), or
        REPLY_WAIT_S have passed (then the turn is not `waited`: its reply may be stored after
        the next turn)."""
        history: list[dict] = []
        for k in range(self.turns):
            await asyncio.sleep(think_s)
            if time.monotonic() > until:  # the product stalled it past the run's length: the turns left are not sent
                return
            history.append(user(f"{thread}-u{k}", k))
            request_id = f"{thread}-r{k}"
            sent = Sent(thread, k, request_id, [m["id"] for m in history], None, int(time.time() * 1000), waited=False)
            self.sent.append(sent)
            await self._publish(producer, sent, self.body(thread, request_id, history))
            deadline = time.monotonic() + REPLY_WAIT_S
            while sent.at is not None and time.monotonic() < deadline:
                if sent.at in self.dead or request_id in self.replies:
                    if (reply := self.replies.get(request_id)) is not None:
                        history.append(reply)
                    sent.waited = True
                    break
                await asyncio.sleep(0.05)

    async def _chat(self, http: aiohttp.ClientSession, thread: str, think_s: float, until: float) -> None:
        """As a `useChat` page does through the gateway: each turn (KINDS, by its number) posts
        the conversation as the page holds it, and reads the answer's stream to its end; the
        page then holds the thread as stored (`GET /api/threads/{id}/messages`, as a reload
        shows it), or, if that cannot be read, what it sent."""
        history: list[dict] = []
        for k in range(self.turns):
            await asyncio.sleep(think_s)
            if time.monotonic() > until:
                return
            request_id = f"{thread}-r{k}"
            kind, body = chat_turn(thread, k, history)
            sent = Sent(thread, k, request_id, [m["id"] for m in body["messages"]], None, int(time.time() * 1000), waited=False, kind=kind)
            self.sent.append(sent)
            started = time.monotonic()
            sent.told = await self._post(http, thread, request_id, body)
            self.told_s[request_id] = time.monotonic() - started
            sent.waited = sent.told in ("answered", "no reply") or sent.told.startswith("rejected")
            history = await self._stored(http, thread) or body["messages"]

    async def _post(self, http: aiohttp.ClientSession, thread: str, request_id: str, body: dict) -> str:
        """A turn posted to the gateway and its answer read to the end: what the caller was
        told ("cut (...)": the stream ended with neither `finish` nor `error`)."""
        headers = {RESOURCE_HEADER: f"res-{thread}", "Idempotency-Key": request_id}
        began = False
        try:
            async with http.post(f"{self.gateway}/api/chat", json=body, headers=headers) as answer:
                if answer.status != 200:
                    code = ((await answer.json(content_type=None)) or {}).get("error", {}).get("code", "")
                    return f"rejected {code}" if 400 <= answer.status < 500 and code not in ("rate-limited", "starting") else f"http {answer.status} {code}"
                began, told, made = True, "cut (no finish)", False
                async for line in answer.content:
                    chunk = line.decode().removeprefix("data: ").strip()
                    if chunk and chunk != "[DONE]":
                        event = json.loads(chunk)
                        made = made or event.get("type") not in ("start", "finish")
                        if event.get("type") == "finish":  # a reply's, or the empty stream of a request that asks for none
                            told = "answered" if made else "no reply"
                        elif event.get("type") == "error":
                            told = f"error {event.get('errorText', '')[:80]}"
                return told
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            return f"{'cut' if began else 'no answer'} ({type(e).__name__})"

    async def _stored(self, http: aiohttp.ClientSession, thread: str) -> list[dict] | None:
        """The thread as stored, read through the gateway; None if it cannot be read now."""
        try:
            async with http.get(
                f"{self.gateway}/api/threads/{thread}/messages", headers={RESOURCE_HEADER: f"res-{thread}"}, timeout=aiohttp.ClientTimeout(total=10)
            ) as answer:
                return await answer.json() if answer.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _publish(self, producer: AIOKafkaProducer, sent: Sent, value: bytes) -> None:
        try:
            meta = await asyncio.wait_for(await producer.send("chat-requests", value, key=sent.thread.encode()), PUBLISH_TIMEOUT_S * 2)
            sent.at = (meta.partition, meta.offset)
        except Exception:  # not acknowledged: it may or may not be on the topic (the checker allows either)
            sent.at = None


def chat_turn(thread: str, k: int, history: list[dict]) -> tuple[str, dict]:
    """Turn k of a gateway conversation, from the UI messages the page holds (`history`): the
    kind it is (KINDS; a regenerate without an answer to regenerate, or a tool's answer without
    a call pending, is a question instead) and the body `useChat`'s transport posts for it."""
    kind = KINDS[k % len(KINDS)]
    last = history[-1] if history else {}
    calls = [p for p in last.get("parts", []) if p.get("type", "").startswith("tool-") and p.get("state") == "input-available"]
    if kind == "regenerate" and last.get("role") == "assistant" and any(m["role"] == "user" for m in history):
        cut = max(i for i, m in enumerate(history) if m["role"] == "user") + 1
        return kind, {"id": thread, "messages": history[:cut], "trigger": "regenerate-message"}
    if kind == "tool" and calls:  # addToolOutput: the call's part given its output, the whole sent again
        answered = {**last, "parts": [{**p, "state": "output-available", "output": {"turn": k}} if p in calls else p for p in last["parts"]]}
        return kind, {"id": thread, "messages": [*history[:-1], answered], "trigger": "submit-message"}
    text = f'/tool weather {{"turn": {k}}}' if k % len(KINDS) == 2 else f"question {k}"
    asked = {"id": f"{thread}-u{k}", "role": "user", "parts": [{"type": "text", "text": text}]}
    return "submit", {"id": thread, "messages": [*history, asked], "trigger": "submit-message"}


Saves = dict[str, list[tuple[str, list[str]]]]  # by thread: each event's request id and the message ids it saves, in log order


async def read(bootstrap: str, redis_url: str, threads: list[str]) -> tuple[list[Outcome], Saves, dict[str, list[str]], dict[str, dict[str, list[str]]]]:
    """Every outcome of `threads`, their saves, their stored orders and what each event took
    out of its thread's conversation (`superseded`, by thread and request id)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed", enable_auto_commit=False, group_id=None)
    await consumer.start()
    outcomes: list[Outcome] = []
    ours = set(threads)  # the topics hold earlier runs' too
    saved: Saves = {}
    superseded: dict[str, dict[str, list[str]]] = {}
    try:
        kinds = {"filtered-inputs": "filtered", "chat-requests-dlq": "dlq", "persist-messages": "persist"}
        tps = [TopicPartition(t, p) for t, ps in (await _partitions(bootstrap, list(kinds))).items() for p in ps]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                for r in records:
                    kind = kinds[tp.topic]
                    if kind == "persist":
                        event = json.loads(r.value)
                        saved.setdefault(event.get("threadId", ""), []).append((event.get("requestId", ""), [m.get("id") for m in event.get("messages", [])]))
                        if event.get("superseded"):
                            superseded.setdefault(event.get("threadId", ""), {}).setdefault(event.get("requestId", ""), event["superseded"])
                        continue
                    headers = {k: v.decode(errors="replace") for k, v in r.headers or ()}
                    if (o := outcome_of(kind, r.partition, r.offset, r.key, r.value, headers)) is not None and o.thread in ours:
                        outcomes.append(o)
    finally:
        await consumer.stop()
    # a Redis Cluster's URL (`redis+cluster://host:port,...`): redis-py's cluster client, from its first node
    client = (
        RedisCluster.from_url("redis://" + redis_url.split("://", 1)[1].split(",")[0])
        if redis_url.startswith("redis+cluster")
        else aioredis.from_url(redis_url)
    )
    try:
        stored = {t: [m.decode() for m in await client.lrange(f"mf:t:{{{t}}}:order", 0, -1)] for t in threads}
    finally:
        await client.aclose()
    return outcomes, saved, stored, superseded


async def kept(postgres_url: str, threads: list[str]) -> dict[str, list[str]]:
    """Each thread's messages in PostgreSQL, in their places (`mf.mastra_messages.position`;
    docs/postgres.md), as the sink wrote them."""
    connection = await asyncpg.connect(postgres_url, timeout=10)
    try:
        rows = await connection.fetch(
            "SELECT thread_id, id FROM mf.mastra_messages WHERE thread_id = ANY($1) AND position IS NOT NULL ORDER BY thread_id, position", threads
        )
    except asyncpg.UndefinedTableError:  # nothing written yet
        rows = []
    finally:
        await connection.close()
    found: dict[str, list[str]] = {t: [] for t in threads}
    for row in rows:
        found[row["thread_id"]].append(row["id"])
    return found


async def _partitions(bootstrap: str, topics: list[str]) -> dict[str, list[int]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return {t["topic"]: sorted(p["partition"] for p in t["partitions"]) for t in await admin.describe_topics(topics)}
    finally:
        await admin.close()

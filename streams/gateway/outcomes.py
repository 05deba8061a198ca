"""What became of the gateway's requests: one reader per gateway of the topics that say so.

A request published by the gateway is answered by two other services: the worker (a filtered
input on `filtered-inputs`, or a dead letter) and the agent runner (its reply as it is made,
chunk by chunk on `reply-streams`, then saved through `persist-messages` as the event
`<requestId>/reply`). One consumer per gateway, in no group, reads those four topics
(read_committed): every partition, or, for gateways that share them
(`memfilter.gateway.shards`), this gateway's share and the partitions of the requests it holds
(`waiting` takes a request's partition before it is published). It hands each record to the
requests of the gateway waiting on its thread (the record key):

- a decision is matched by where the request landed on `chat-requests` (partition, offset),
  which no other client can claim (`memfilter.client.outcome_of`); a request waits from
  before it is published, so a decision that comes before the publish is acknowledged is
  kept for it;
- a reply's chunks are matched by their `requestId` and resource, and queued for the request
  as they come, once their attempt verifies under the deployment's secret (only the agent
  runner can make one: `memfilter.core.origin`);
- a reply is matched by its event's `requestId` (`<the request's id>/reply`) in the thread, and must be for the request's resource.

It also keeps, for a resume (`GET /api/chat/{id}/stream`), every reply still being made: the
chunks of each thread's latest stream, from its `start` to its end (`error` or `abort`; or
`finish` and its reply stored in Redis, so a page reloaded in between resumes it rather
than find it nowhere), when it is dropped (or `since_s` after its start, when no
runner is left to end it). So that a gateway can resume the replies begun before it took a
partition (at its start, or when the partition moved to it), `reply-streams` is read from
`since_s` seconds back (the longest a reply is waited for); the other topics from their ends.
Until it has read a partition of `reply-streams` up to where its end was when it was taken, it
cannot tell that no reply is being made in a thread there: a resume on that partition waits
for it, and the gateway is not ready until its first partitions are read so (`caught_up`).

Any gateway can serve any request and resume any reply: it reads the partition of what it
holds for as long as it holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from memfilter.client import Client, outcome_of
from memfilter.core import origin
from memfilter.core.filter import Rejection
from memfilter.gateway.shards import Peers, owners
from memfilter.runtime.loop import ASSIGNED_ONCE_FETCH_MAX_WAIT_MS, key_hash
from memfilter.schemas.wire import FilteredInput, ReplyChunk
from memfilter.settings import Topics
from memfilter.store import reads
from memfilter.store.history import HistoryStore
from memfilter.store.transport import UNAVAILABLE

log = logging.getLogger("memfilter")
_CHUNK = msgspec.json.Decoder(ReplyChunk)
# How long the reader waits for records before it looks again at what to read: a request on a
# partition not read here yet waits for it at most this long, beside the seek.
FETCH_WAIT_MS = 100
# How long a resume waits for a gateway to read the replies begun before it took their partition.
RESUME_CATCH_UP_S = 10.0
ENDS = frozenset({"finish", "error", "abort"})  # the chunks that end a stream


class _Saved(msgspec.Struct):
    """What the reader needs of a `persist-messages` value; the rest is read once it is ours."""

    requestId: str = ""  # of a reply: `<the request's id>/reply`
    threadId: str = ""
    resourceId: str = ""
    messages: list[dict[str, Any]] = []


_SAVED = msgspec.json.Decoder(_Saved)


async def stored(store: HistoryStore, reply: dict[str, Any], thread: str, deadline: float) -> bool:
    """Wait until the worker has applied a saved reply (its row is stored as saved); False at
    `deadline`."""
    return await stored_row(store, thread, reply["id"], deadline, reply) is not None


async def stored_row(store: HistoryStore, thread: str, message_id: str, deadline: float, like: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The row of `message_id` in `thread` once the worker has stored it (equal to `like`, if
    given); None at `deadline`. A Redis that does not answer is asked again until then: the
    reply is saved on Kafka, and the worker applies it once Redis is back."""
    pause = 0.005
    while True:
        try:
            row = await reads.row(store, thread, message_id)
        except UNAVAILABLE:
            row = None
        if row is not None and (found := json.loads(row)) == (like if like is not None else found):
            return found
        if time.monotonic() + pause > deadline:
            return None
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.1)


class NotTaken(Exception):
    """A thread's partition, or the replies being made on it, not read within RESUME_CATCH_UP_S (`Outcomes.waiting`)."""


class BadTopics(Exception):
    """A topic the gateway reads does not exist, or they cannot be shared; the message names them and the fix."""


@dataclass(eq=False)
class Waiting:
    """One request's wait: for its decision, then for its reply."""

    thread: str
    resource: str
    request_id: str
    at: tuple[int, int] | None = None  # where it landed, once published
    decided: asyncio.Future[FilteredInput | Rejection] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    reply: asyncio.Future[dict[str, Any]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    chunks: asyncio.Queue[ReplyChunk] = field(default_factory=asyncio.Queue)  # its reply's, as they come
    early: list[ConsumerRecord] = field(default_factory=list)  # decisions on its thread before `at` was known


@dataclass(eq=False)
class Live:
    """A reply being made: its chunks so far, and the resumes following it."""

    request_id: str
    resource: str
    attempt: str
    began: float = field(default_factory=time.monotonic)
    finished: bool = False  # its `finish` is read
    saved: dict[str, Any] | None = None  # its reply, once read on `persist-messages`
    chunks: list[dict[str, Any]] = field(default_factory=list)
    followers: list[asyncio.Queue[dict[str, Any] | None]] = field(default_factory=list)  # None: the stream was replaced

    def follow(self) -> tuple[list[dict[str, Any]], asyncio.Queue[dict[str, Any] | None]]:
        """The chunks so far, and a queue of those to come."""
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.followers.append(queue)
        return list(self.chunks), queue


class Outcomes:
    def __init__(self, bootstrap: str, topics: Topics, since_s: float, secret: bytes, store: HistoryStore, peers: Peers | None = None):
        self.store = store  # where a reply in flight is looked for, to know when it is stored
        self.bootstrap = bootstrap
        self.topics = topics
        self.since_s = since_s
        self.secret = secret  # MEMFILTER_SECRET, which verifies a reply's attempt (`memfilter.core.origin`)
        self.peers = peers  # the gateways this one shares the partitions with (None: it reads them all)
        self._topics = (topics.filtered, topics.dlq, topics.persist, topics.streams)
        self._waiting: dict[bytes, list[Waiting]] = {}  # thread (record key) -> its requests waiting here
        self._live: dict[bytes, Live] = {}  # thread -> the reply being made in it
        self._forgetting: set[asyncio.Task] = set()  # replies ended, waited for in Redis
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None
        self._counts: dict[str, int] = {}  # topic -> its partitions
        self._partitions = 1  # of `filtered-inputs`: what a thread's partition is taken modulo
        self._owners: list[str] = []  # partition -> its gateway's address, when shared
        self._mine: set[int] = set()  # the partitions of this gateway's share (all, when not shared)
        self._held: dict[int, int] = {}  # partition -> requests held here on its threads
        self._assigned: set[TopicPartition] = set()
        self.reading: set[int] = set()  # the partitions read now: this gateway's, and those it holds requests on
        self._dirty = False  # the partitions to read have changed
        self._progress = asyncio.Event()  # set, then replaced, each time `reading` or `_behind` changes
        self._behind: dict[TopicPartition, int] = {}  # a `reply-streams` partition read from back -> its end when it was taken
        self.caught_up = asyncio.Event()  # every reply begun before the start, on this gateway's partitions, is known (`live`)

    async def start(self, client: Client) -> None:
        """Read from the topics' ends as of now (`client` says what partitions they have): every
        partition, or this gateway's share of them (`memfilter.gateway.shards`) once `share`d."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            isolation_level="read_committed",
            fetch_max_wait_ms=ASSIGNED_ONCE_FETCH_MAX_WAIT_MS,  # a change of assignment cancels the fetch in flight: it waits for nothing else
            group_id=None,
        )
        await consumer.start()
        deadline = time.monotonic() + 10  # topics made a moment ago may not be in the brokers' metadata yet
        while (missing := sorted(set(self._topics) - await consumer.topics())) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        if missing:
            await consumer.stop()
            raise BadTopics(f"topics {', '.join(missing)} do not exist on {self.bootstrap}: `memfilter stack up` makes them (docs/operations.md: Upgrading)")
        counts = {t: len(await client.partitions(t)) for t in self._topics}
        self._partitions = counts[self.topics.filtered]
        if self.peers is not None and len(set(counts.values())) > 1:
            await consumer.stop()
            raise BadTopics(
                "gateways share partitions by number (MEMFILTER_GATEWAY_ADDRESS), but the topics have "
                + ", ".join(f"{t} {n}" for t, n in counts.items())
                + ": give them one count (docs/operations.md: Partitions), or leave MEMFILTER_GATEWAY_ADDRESS unset"
            )
        self._counts = counts
        self._consumer = consumer
        await self._reassign()
        self._task = asyncio.create_task(self._run())

    def share(self) -> None:
        """The live gateways changed (`memfilter.gateway.shards.Peers`): this one's partitions are read again."""
        self._dirty = True

    def partition_of(self, thread: str) -> int:
        """The partition of `thread`'s records on the topics read here (they are keyed by it)."""
        return key_hash(thread.encode()) % self._partitions

    def owner(self, thread: str) -> str | None:
        """The address of the gateway whose share `thread` is in, if not this one's."""
        if self.peers is None:
            return None
        owner = self._owners[self.partition_of(thread)] if self._owners else self.peers.address
        return None if owner == self.peers.address else owner

    def _owned(self) -> set[int]:
        if self.peers is None:  # every partition of every topic, whatever their counts
            self._mine = set(range(max(self._counts.values())))
        else:
            self._owners = owners(self._partitions, self.peers.live)
            self._mine = {p for p, a in enumerate(self._owners) if a == self.peers.address}
        return self._mine

    async def _reassign(self) -> None:
        """Read this gateway's partitions and those it holds requests for: those kept from where
        they were, those new from their ends (`reply-streams` from `since_s` back, so that the
        replies being made there are known: `caught_up`)."""
        assert self._consumer is not None
        consumer, self._dirty = self._consumer, False
        wanted = self._owned() | {p for p, n in self._held.items() if n}
        tps = {TopicPartition(t, p) for t in self._topics for p in wanted if p < self._counts[t]}
        if tps == self._assigned:
            return
        kept = {tp: await consumer.position(tp) for tp in self._assigned & tps}
        new = sorted(tps - self._assigned)
        consumer.assign(sorted(tps))
        for tp, at in kept.items():
            consumer.seek(tp, at)
        if new:
            await consumer.seek_to_end(*new)
            ends = {tp: await consumer.position(tp) for tp in new}  # the ends as of now: every record after is read
            since = int((time.time() - self.since_s) * 1000)
            streams = {tp: since for tp in new if tp.topic == self.topics.streams}
            for tp, found in (await consumer.offsets_for_times(streams)).items() if streams else ():
                if found is not None:  # replies begun in the last `since_s` seconds: resumable here too
                    self._behind[tp] = ends[tp]
                    consumer.seek(tp, found.offset)
        self._behind = {tp: end for tp, end in self._behind.items() if tp in tps}
        if dropped := {tp.partition for tp in self._assigned - tps}:
            for thread in [t for t in self._live if self.partition_of(t.decode()) in dropped]:
                del self._live[thread]  # no longer followed here: a resume of it goes to its gateway
        self._assigned, self.reading = tps, wanted
        self._progressed()

    async def stop(self) -> None:
        for task in list(self._forgetting):
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @contextlib.asynccontextmanager
    async def waiting(self, thread: str, resource: str, request_id: str, replies: bool = False):
        """A request's wait, registered for as long as the block runs, once its thread's partition
        is read (from before now: what is published after is seen), and, with `replies`, once the
        replies being made there are known (`live`); NotTaken if not within RESUME_CATCH_UP_S."""
        w = Waiting(thread, resource, request_id)
        key, partition = thread.encode(), self.partition_of(thread)
        self._held[partition] = self._held.get(partition, 0) + 1
        self._waiting.setdefault(key, []).append(w)
        try:
            deadline = time.monotonic() + RESUME_CATCH_UP_S
            while partition not in self.reading or (replies and self._behind_in(partition)):
                if partition not in self.reading:
                    self._dirty = True
                try:
                    await asyncio.wait_for(self._progress.wait(), deadline - time.monotonic())
                except TimeoutError:
                    raise NotTaken(f"partition {partition} of thread {thread}") from None
            yield w
        finally:
            waiting = self._waiting[key]
            waiting.remove(w)
            if not waiting:
                del self._waiting[key]
            self._held[partition] -= 1
            if not self._held[partition]:
                del self._held[partition]
                self._dirty = self._dirty or partition not in self._mine

    def landed(self, w: Waiting, at: tuple[int, int]) -> None:
        """Where the request landed: its decision is the record naming that position."""
        w.at = at
        early, w.early = w.early, []
        for record in early:
            self._decision(w, record)

    async def _run(self) -> None:
        assert self._consumer is not None
        pruned = time.monotonic()
        while True:
            if self._dirty:
                try:
                    await self._reassign()
                except Exception:
                    log.exception("memfilter gateway: taking its partitions failed; trying again")
                    self._dirty = True
                    await asyncio.sleep(1)
                    continue
            if time.monotonic() - pruned > self.since_s:  # replies that never ended (no runner left to end them)
                pruned = time.monotonic()
                for thread in [t for t, live in self._live.items() if pruned - live.began > self.since_s]:
                    del self._live[thread]
            try:
                batch = await self._consumer.getmany(timeout_ms=FETCH_WAIT_MS)
            except Exception:
                log.exception("memfilter gateway: reading outcomes failed; trying again")
                await asyncio.sleep(1)
                continue
            for records in batch.values():
                for record in records:
                    if record.topic == self.topics.streams:
                        self._chunk(record)
                        continue
                    if record.topic == self.topics.persist and record.key in self._live:
                        self._reply_saved(record)
                    for w in self._waiting.get(record.key, ()) if record.key is not None else ():
                        if record.topic == self.topics.persist:
                            self._saved(w, record)
                        elif w.at is None:
                            w.early.append(record)
                        else:
                            self._decision(w, record)
            if self._behind:
                behind = {tp: end for tp, end in self._behind.items() if await self._consumer.position(tp) < end}
                if behind != self._behind:
                    self._behind = behind
                    self._progressed()

    def _progressed(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()
        if not self._behind:
            self.caught_up.set()

    def _behind_in(self, partition: int) -> bool:
        """Whether the replies begun on `partition` before it was taken are still being read."""
        return TopicPartition(self.topics.streams, partition) in self._behind

    def live(self, thread: str, resource: str) -> Live | None:
        """The reply being made in `thread` for `resource`, if any."""
        live = self._live.get(thread.encode())
        return live if live is not None and live.resource == resource else None

    def _chunk(self, record: ConsumerRecord) -> None:
        if record.key is None:
            return
        try:
            c = _CHUNK.decode(record.value)
        except (msgspec.DecodeError, TypeError):
            return
        if c.threadId.encode() != record.key or not origin.is_attempt(c.attempt, self.secret, c.requestId, c.threadId, c.resourceId):
            return  # not the runner's: no writer without the secret puts words in a reply
        for w in self._waiting.get(record.key, ()):
            if w.request_id == c.requestId and w.resource == c.resourceId:
                w.chunks.put_nowait(c)
        live = self._live.get(record.key)
        if c.chunk.get("type") == "start":
            if live is not None:  # replaced: its runner died, or it never ended
                for q in live.followers:
                    q.put_nowait(None)
            live = self._live[record.key] = Live(c.requestId, c.resourceId, c.attempt)
        elif live is None or (live.request_id, live.resource, live.attempt) != (c.requestId, c.resourceId, c.attempt):
            return  # a stream begun before this gateway's window, or a stale attempt's
        live.chunks.append(c.chunk)
        for q in live.followers:
            q.put_nowait(c.chunk)
        if c.chunk.get("type") == "finish":
            live.finished = True
            self._forget_once_stored(record.key, live)
        elif c.chunk.get("type") in ENDS:
            del self._live[record.key]

    def _reply_saved(self, record: ConsumerRecord) -> None:
        live = self._live[record.key]
        try:
            saved = _SAVED.decode(record.value)
        except (msgspec.DecodeError, TypeError):
            return
        replies = [m for m in saved.messages if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("id"), str)]
        if saved.requestId == f"{live.request_id}/reply" and saved.resourceId == live.resource and replies:
            live.saved = replies[-1]
            self._forget_once_stored(record.key, live)

    def _forget_once_stored(self, key: bytes, live: Live) -> None:
        """A reply stays resumable until it is stored, not only until its `finish`: a page
        reloaded in between would find it neither in the thread nor in flight."""
        if not (live.finished and live.saved is not None):
            return

        async def forget() -> None:
            with contextlib.suppress(Exception):  # Redis not answering: forgotten at `since_s`, as a reply that never ended
                await stored(self.store, live.saved or {}, key.decode(), time.monotonic() + self.since_s)
            if self._live.get(key) is live:
                del self._live[key]

        task = asyncio.create_task(forget())
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)

    def _decision(self, w: Waiting, record: ConsumerRecord) -> None:
        found = outcome_of(record, self.topics)
        if found is not None and found[0] == w.at and not w.decided.done():
            w.decided.set_result(found[1])

    def _saved(self, w: Waiting, record: ConsumerRecord) -> None:
        try:
            saved = _SAVED.decode(record.value)
        except (msgspec.DecodeError, TypeError):
            return
        if saved.requestId != f"{w.request_id}/reply" or saved.threadId != w.thread or saved.resourceId != w.resource or w.reply.done():
            return
        # a reply the worker would store: an assistant message with an id (one without is left, and the request times out naming it)
        replies = [m for m in saved.messages if isinstance(m, dict) and m.get("role") == "assistant" and isinstance(m.get("id"), str) and m["id"]]
        if replies:
            w.reply.set_result(replies[-1])

"""The agent runner's side of the relay topics: replies streamed out, stops read in.

While the runner makes a reply, each chunk goes to `reply-streams` as it comes (a plain,
idempotent producer: the chunks are a live view for the browser, not part of the exactly-once
history, so they are not held back in the batch's transaction), keyed by thread so a thread's
chunks stay in order on one partition. A gateway relays them (`memfilter.gateway.outcomes`).

A client's stop comes the other way, on `reply-stops`: every runner reads all of its
partitions from their ends (no group: the reply may be made by any runner) and sets the
`stopped` event of the reply it names, when that reply is being made here, for that resource.

What it promises: it waits out a Kafka that does not answer and topics not made yet, as the
task loop does (a reply waits for it); a chunk is sent only after the one before it (one
producer, ordered); a chunk that cannot be sent does not stop the reply (the browser misses it
and a resume fetches the reply saved); a stop for another resource, or for a reply not being
made here, is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError
from mode import Service

from memfilter.core import origin
from memfilter.runtime.loop import ASSIGNED_ONCE_FETCH_MAX_WAIT_MS, wait_for_topics
from memfilter.schemas.wire import FilteredInput, ReplyChunk, StopReply
from memfilter.settings import Kafka, Topics

log = logging.getLogger("memfilter")
_STOP = msgspec.json.Decoder(StopReply)


@dataclass(eq=False)
class Streaming:
    """One reply being made: where its chunks go, and whether a client stopped it."""

    relay: Relay
    event: FilteredInput
    attempt: str  # `memfilter.core.origin.attempt`: a gateway relays only chunks whose attempt verifies
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _last: asyncio.Future | None = None

    async def send(self, chunk: dict[str, Any]) -> None:
        e = self.event
        value = msgspec.json.encode(ReplyChunk(e.requestId, e.threadId, e.resourceId, self.attempt, chunk))
        await self.relay.ready.wait()
        assert self.relay.producer is not None
        try:
            self._last = await self.relay.producer.send(self.relay.topics.streams, value, key=e.threadId.encode())
        except Exception as err:  # the live view only: the reply goes on, and is saved
            log.warning("memfilter agent: a chunk of request %s's reply was not relayed (%s)", e.requestId, err)

    async def flush(self) -> None:
        """Until every chunk sent is on the topic (or failed)."""
        if self._last is not None:
            with contextlib.suppress(Exception):
                await self._last


class Relay(Service):
    def __init__(self, kafka: Kafka, topics: Topics, secret: bytes, **kwargs: Any):
        super().__init__(**kwargs)
        self.kafka = kafka
        self.topics = topics
        self.secret = secret
        self.producer: AIOKafkaProducer | None = None  # made on start (in the event loop)
        self.ready = asyncio.Event()  # connected, and the topics are there
        self._stops: AIOKafkaConsumer | None = None
        self._making: dict[str, Streaming] = {}  # thread -> the reply being made in it here

    async def on_start(self) -> None:
        self.add_future(self._run())

    async def _run(self) -> None:
        """Connect (waiting out a Kafka that does not answer, and the topics, as the task loop
        does), then read stops for as long as the runner runs."""
        while self.producer is None:
            producer = AIOKafkaProducer(bootstrap_servers=self.kafka.bootstrap, enable_idempotence=True, linger_ms=2)
            consumer = AIOKafkaConsumer(
                bootstrap_servers=self.kafka.bootstrap, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=ASSIGNED_ONCE_FETCH_MAX_WAIT_MS
            )
            try:
                await producer.start()
                await consumer.start()
            except KafkaError as e:
                log.warning("memfilter agent: Kafka at %s not answering for the relay topics (%s); retrying", self.kafka.bootstrap, e)
                await asyncio.gather(producer.stop(), consumer.stop(), return_exceptions=True)
                await asyncio.sleep(1)
                continue
            self.producer, self._stops = producer, consumer
        assert self._stops is not None
        await wait_for_topics(self._stops, self.topics.relays())  # a chunk sent to a topic that is not there would wait for it
        tps = [TopicPartition(self.topics.stops, p) for p in sorted(await self.producer.partitions_for(self.topics.stops))]
        self._stops.assign(tps)
        await self._stops.seek_to_end(*tps)
        self.ready.set()
        await self._read_stops()

    async def on_stop(self) -> None:
        if self._stops is not None:
            await self._stops.stop()
        if self.producer is not None:
            await self.producer.stop()

    @contextlib.asynccontextmanager
    async def streaming(self, event: FilteredInput):
        """A reply to `event` being made, stoppable for as long as the block runs."""
        s = Streaming(self, event, origin.attempt(self.secret, event.requestId, event.threadId, event.resourceId, uuid.uuid4().hex))
        self._making[event.threadId] = s
        try:
            yield s
        finally:
            if self._making.get(event.threadId) is s:
                del self._making[event.threadId]
            await s.flush()

    async def _read_stops(self) -> None:
        assert self._stops is not None
        while not self.should_stop:
            try:
                batch = await self._stops.getmany(timeout_ms=500)
            except Exception:
                log.exception("memfilter agent: reading %s failed; trying again", self.topics.stops)
                await asyncio.sleep(1)
                continue
            for record in (r for records in batch.values() for r in records):
                try:
                    stop = _STOP.decode(record.value)
                except (msgspec.DecodeError, TypeError):
                    continue
                making = self._making.get(stop.threadId)
                if making is not None and making.event.resourceId == stop.resourceId and stop.requestId in ("", making.event.requestId):
                    making.stopped.set()

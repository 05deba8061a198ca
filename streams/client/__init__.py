"""A small async client for services around the processor: publish chat requests, follow a
topic's events (optionally one thread's), consume filtered inputs as a group and save replies,
typed with the `schemas` Structs.

    async with Client("127.0.0.1:9092") as client:
        ids = await client.publish([{"threadId": "t1", "resourceId": "u1", "messages": [...]}])
        async for event in client.filtered_inputs(thread="t1"):
            ...  # event.requestId is one of `ids`

Downstream, an agent of one's own (the reference one is `memfilter agent`):

    async with Client("127.0.0.1:9092") as client:
        async for delivery in client.consume("my-agent"):
            reply = await my_model(delivery.event.context)  # an assistant message (format 2)
            await client.reply(delivery.event, reply)
            await delivery.commit()  # the group resumes after it

`publish` checks every request as the processor will (`InvalidRequest` names the first that
would be a dead letter, and then nothing is sent), and returns each one's `requestId`: its own,
or the one the processor gives a request without one (from where it landed), so a caller can
find its filtered inputs. `ask` publishes one request and waits for its outcome: the filtered
input, or `RequestRejected` with the dead letter's reason, or a `TimeoutError` that says what
it waited for: nothing waits forever. `memfilter publish` and `memfilter tail` are this client on the
command line.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

from memfilter.core.filter import Limits, Rejected, decode_request
from memfilter.core.replies import reply_event
from memfilter.schemas.wire import ChatRequest, FilteredInput
from memfilter.settings import Topics

_FILTERED = msgspec.json.Decoder(FilteredInput)


class InvalidRequest(ValueError):
    """A request the processor would reject; nothing was published."""

    def __init__(self, index: int, error: Rejected):
        super().__init__(f"request {index} would be rejected ({error.type}): {error.message}")
        self.index, self.type = index, error.type


class RequestRejected(Exception):
    """The processor dead-lettered a request (`Client.ask`): its reason code (`type`: ownership,
    foreign-message-id, duplicate, schema, too-large, ...) and message, as the dead letter says."""

    def __init__(self, request_id: str, type_: str, message: str):
        super().__init__(f"request {request_id} was rejected ({type_}): {message}")
        self.request_id, self.type, self.message = request_id, type_, message


@dataclass
class Delivery:
    """A filtered input consumed as a member of a group (`Client.consume`)."""

    event: FilteredInput
    record: ConsumerRecord
    _consumer: AIOKafkaConsumer

    async def commit(self) -> None:
        """The group has handled this input and every one before it in its partition."""
        tp = TopicPartition(self.record.topic, self.record.partition)
        await self._consumer.commit({tp: self.record.offset + 1})


class Client:
    def __init__(self, bootstrap: str, topics: Topics = Topics(), limits: Limits = Limits()):
        self.bootstrap = bootstrap
        self.topics = topics
        self.limits = limits
        self._producer: AIOKafkaProducer | None = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        if self._producer is not None:
            await self._producer.stop()

    async def publish(self, requests: Iterable[ChatRequest | dict | bytes], on_sent=None) -> list[str]:
        """Publish requests (Structs, dicts or JSON bytes) to the requests topic, keyed by thread
        id, once every one of them passed the processor's checks (else `InvalidRequest`); wait
        until the broker has them all. Returns their request ids, in order."""
        return [request_id for request_id, _ in await self._publish(requests, on_sent)]

    async def _publish(self, requests: Iterable[ChatRequest | dict | bytes], on_sent=None) -> list[tuple[str, Any]]:
        """`publish`: each request's id and where it landed (aiokafka's RecordMetadata)."""
        values = [r if isinstance(r, bytes) else msgspec.json.encode(r) for r in requests]
        checked = []
        for n, value in enumerate(values):
            try:
                checked.append(decode_request(value, "", self.limits).shape)
            except Rejected as e:
                raise InvalidRequest(n, e) from None
        producer = await self._started()
        pending = [await producer.send(self.topics.requests, v, key=r.threadId.encode()) for v, r in zip(values, checked)]
        ids = []
        for request, future in zip(checked, pending):
            sent = await future
            ids.append((request.requestId or f"{sent.topic}-{sent.partition}-{sent.offset}", sent))
            if on_sent is not None:
                on_sent(len(ids))
        return ids

    async def ask(self, request: ChatRequest | dict | bytes, timeout: float = 30.0) -> FilteredInput:
        """Publish one request and wait for what the processor made of it: its filtered input,
        or `RequestRejected` with the reason its dead letter gives; `TimeoutError` naming the
        request and the topics when neither comes within `timeout` seconds (is a worker running?)."""
        value = request if isinstance(request, bytes) else msgspec.json.encode(request)
        outcomes = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, isolation_level="read_committed", fetch_max_wait_ms=100)
        await outcomes.start()
        try:
            producer = await self._started()
            tps = [TopicPartition(t, p) for t in (self.topics.filtered, self.topics.dlq) for p in sorted(await producer.partitions_for(t))]
            outcomes.assign(tps)
            await outcomes.seek_to_end(*tps)
            for tp in tps:  # the ends as of now, before the request is sent
                await outcomes.position(tp)
            [(request_id, sent)] = await self._publish([value])
            source = (self.topics.requests, sent.partition, sent.offset)
            async with asyncio.timeout(timeout):
                while True:
                    for records in (await outcomes.getmany(timeout_ms=500)).values():
                        for r in records:
                            if r.topic == self.topics.filtered:
                                with contextlib.suppress(msgspec.DecodeError):
                                    event = _FILTERED.decode(r.value)
                                    if (event.source.topic, event.source.partition, event.source.offset) == source:
                                        return event
                            else:
                                h = {k: v.decode(errors="replace") for k, v in r.headers}
                                if (h.get("source.topic"), h.get("source.partition"), h.get("source.offset")) == tuple(map(str, source)):
                                    raise RequestRejected(request_id, h.get("error.type", ""), h.get("error.message", ""))
        except TimeoutError:
            raise TimeoutError(
                f"no filtered input or dead letter for request {request_id} on {self.topics.filtered} or {self.topics.dlq} "
                f"within {timeout:g} s: is a worker running on {self.topics.requests}?"
            ) from None
        finally:
            await outcomes.stop()

    async def _started(self) -> AIOKafkaProducer:
        if self._producer is None:
            self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5, max_request_size=4 << 20)
            await self._producer.start()
        return self._producer

    async def reply(self, event: FilteredInput, message: dict[str, Any]) -> None:
        """Save `message` (an assistant message, format 2, with its own id) as the reply to a
        filtered input: a PersistMessages event on the persist topic, keyed by the thread; the
        worker applies it, once however often it is sent. Waits until the broker has it."""
        producer = await self._started()
        await (await producer.send(self.topics.persist, reply_event(event, message), key=event.threadId.encode()))

    async def consume(self, group: str, from_beginning: bool = True) -> AsyncIterator[Delivery]:
        """Filtered inputs as a member of consumer group `group` (read_committed: each once),
        from where the group committed (else the topic's start, or its end); commit each one
        handled (`Delivery.commit`). A record that is not a FilteredInput is passed over."""
        consumer = AIOKafkaConsumer(
            self.topics.filtered,
            bootstrap_servers=self.bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            isolation_level="read_committed",
        )
        await consumer.start()
        decoder = msgspec.json.Decoder(FilteredInput)
        try:
            async for record in consumer:
                try:
                    event = decoder.decode(record.value)
                except msgspec.DecodeError:  # not the processor's: passed over, committed with the next
                    continue
                yield Delivery(event, record, consumer)
        finally:
            await consumer.stop()

    async def records(self, topic: str, thread: str | None = None, from_beginning: bool = False, idle_ms: int | None = None) -> AsyncIterator[ConsumerRecord]:
        """Follow a topic's records (of one thread if `thread`); stop after `idle_ms` without any
        (counted from the first fetch, which waits at least a second for a new consumer's
        partitions)."""
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=self.bootstrap,
            group_id=None,
            auto_offset_reset="earliest" if from_beginning else "latest",
            fetch_max_wait_ms=100,
            isolation_level="read_committed",  # as downstream reads: each event once
        )
        await consumer.start()
        key = thread.encode() if thread is not None else None
        wait_ms = max(idle_ms or 0, 1000)
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=wait_ms)
                if not batch and idle_ms is not None:
                    return
                wait_ms = idle_ms if idle_ms is not None else 1000
                for records in batch.values():
                    for record in records:
                        if key is None or record.key == key:
                            yield record
        finally:
            await consumer.stop()

    async def filtered_inputs(self, thread: str | None = None, from_beginning: bool = False) -> AsyncIterator[FilteredInput]:
        decoder = msgspec.json.Decoder(FilteredInput)
        async for record in self.records(self.topics.filtered, thread, from_beginning):
            yield decoder.decode(record.value)

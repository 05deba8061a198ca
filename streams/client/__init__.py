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
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord, TopicPartition

from memfilter.core.filter import Limits, Rejected, Rejection, decode_request
from memfilter.core.filtered import decode_whole
from memfilter.core.replies import reply_event
from memfilter.runtime.kafka_driver import group_consumer
from memfilter.schemas.wire import ChatRequest, FilteredInput, StopReply
from memfilter.settings import Topics


def outcome_of(record: ConsumerRecord, topics: Topics) -> tuple[tuple[int, int], FilteredInput | Rejection] | None:
    """What a record of the filtered-inputs or dead-letter topic says of a request: the request's
    position on the requests topic (partition, offset), and its filtered input or why it was
    rejected;
    None for a record that says nothing of one (another topic's dead letter, a value that is not
    a filtered input)."""
    if record.topic == topics.filtered:
        try:
            event = decode_whole(record.value)
        except (msgspec.DecodeError, TypeError):
            return None
        return ((event.source.partition, event.source.offset), event) if event.source.topic == topics.requests else None
    headers = {k: v.decode(errors="replace") for k, v in record.headers or ()}
    if headers.get("source.topic") != topics.requests or not (headers.get("source.partition", "").isdigit() and headers.get("source.offset", "").isdigit()):
        return None
    at = (int(headers["source.partition"]), int(headers["source.offset"]))
    return at, Rejection(headers.get("error.type", ""), headers.get("error.message", ""))


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
        return [request_id for request_id, _ in await self.publish_at(requests, on_sent)]

    async def publish_at(self, requests: Iterable[ChatRequest | dict | bytes], on_sent=None) -> list[tuple[str, tuple[int, int]]]:
        """`publish`, with where each request landed: (its request id, (partition, offset))."""
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
            ids.append((request.requestId or f"{sent.topic}-{sent.partition}-{sent.offset}", (sent.partition, sent.offset)))
            if on_sent is not None:
                on_sent(len(ids))
        return ids

    async def ask(self, request: ChatRequest | dict | bytes, timeout: float = 30.0) -> FilteredInput:
        """Publish one request and wait for what the processor made of it: its filtered input,
        or `RequestRejected` with the reason its dead letter gives; `TimeoutError` naming the
        request and the topics when neither comes within `timeout` seconds (is a worker running?).
        The outcome is found by where the request landed, which no other client can claim (a
        request id can be sent by anyone)."""
        outcomes = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False, isolation_level="read_committed", fetch_max_wait_ms=100)
        await outcomes.start()
        try:
            tps = [TopicPartition(t, p) for t in (self.topics.filtered, self.topics.dlq) for p in await self.partitions(t)]
            outcomes.assign(tps)
            await outcomes.seek_to_end(*tps)
            for tp in tps:  # the ends as of now, before the request is sent
                await outcomes.position(tp)
            [(request_id, at)] = await self.publish_at([request])
            async with asyncio.timeout(timeout):
                while True:
                    for records in (await outcomes.getmany(timeout_ms=500)).values():
                        for r in records:
                            found = outcome_of(r, self.topics)
                            if found is not None and found[0] == at:
                                if isinstance(found[1], Rejection):
                                    raise RequestRejected(request_id, found[1].type, found[1].message)
                                return found[1]
        except TimeoutError:
            raise TimeoutError(
                f"no filtered input or dead letter for request {request_id} on {self.topics.filtered} or {self.topics.dlq} "
                f"within {timeout:g} s: is a worker running on {self.topics.requests}?"
            ) from None
        finally:
            await outcomes.stop()

    async def partitions(self, topic: str) -> list[int]:
        """The topic's partition numbers (waits for the broker's metadata)."""
        return sorted(await (await self._started()).partitions_for(topic))

    async def _started(self) -> AIOKafkaProducer:
        if self._producer is None:
            # No linger: a request is sent at once (a chat turn waits for it); records added while
            # one is in flight are batched all the same. Idempotent: a send retried after its
            # acknowledgement was lost (a broker cut from its followers, say) is written once, not
            # twice, so a request is never decided and then dead-lettered as its own `duplicate`.
            self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=True, linger_ms=0, max_request_size=4 << 20)
            await self._producer.start()
        return self._producer

    async def reply(self, event: FilteredInput, message: dict[str, Any]) -> None:
        """Save `message` (an assistant message, format 2, with its own id) as the reply to a
        filtered input: a PersistMessages event on the persist topic, keyed by the thread; the
        worker applies it, once however often it is sent. Waits until the broker has it."""
        producer = await self._started()
        await (await producer.send(self.topics.persist, reply_event(event, message), key=event.threadId.encode()))

    async def stop_reply(self, thread: str, resource: str, request_id: str = "") -> None:
        """Ask the runner making the reply in `thread` (to `request_id`, when given) to stop it:
        a StopReply on the stops topic, keyed by the thread. The reply is saved as it stands,
        finish reason `interrupted`. Waits until the broker has it."""
        producer = await self._started()
        value = msgspec.json.encode(StopReply(thread, resource, request_id))
        await (await producer.send(self.topics.stops, value, key=thread.encode()))

    async def consume(self, group: str, from_beginning: bool = True) -> AsyncIterator[Delivery]:
        """Filtered inputs as a member of consumer group `group` (read_committed: each once),
        from where the group committed (else the topic's start, or its end); commit each one
        handled (`Delivery.commit`). A record that is not a FilteredInput is passed over."""
        consumer = group_consumer(
            self.topics.filtered,
            bootstrap_servers=self.bootstrap,
            group_id=group,
            enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            isolation_level="read_committed",
        )
        await consumer.start()
        try:
            async for record in consumer:
                try:
                    event = decode_whole(record.value)
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
        async for record in self.records(self.topics.filtered, thread, from_beginning):
            yield decode_whole(record.value)

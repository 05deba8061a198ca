"""A small async client for services around the processor: publish chat requests, follow a
topic's events (optionally one thread's), typed with the `schemas` Structs.

    async with Client("127.0.0.1:9092") as client:
        await client.publish([ChatRequest(threadId="t1", resourceId="u1", messages=[...])])
        async for event in client.filtered_inputs(thread="t1"):
            ...

`memfilter publish` and `memfilter tail` are this client on the command line.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from schemas.wire import ChatRequest, FilteredInput
from streams.processor import Topics


class Client:
    def __init__(self, bootstrap: str, topics: Topics = Topics()):
        self.bootstrap = bootstrap
        self.topics = topics
        self._producer: AIOKafkaProducer | None = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        if self._producer is not None:
            await self._producer.stop()

    async def publish(self, requests: Iterable[ChatRequest | bytes], on_sent=None) -> int:
        """Publish requests to the requests topic, keyed by thread id; wait until the broker has
        them all. Bytes are sent as they are (they must be a ChatRequest). Returns the count."""
        if self._producer is None:
            self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=5, max_request_size=4 << 20)
            await self._producer.start()
        pending = []
        for request in requests:
            value = request if isinstance(request, bytes) else msgspec.json.encode(request)
            thread = msgspec.json.decode(value, type=ChatRequest).threadId if isinstance(request, bytes) else request.threadId
            pending.append(await self._producer.send(self.topics.requests, value, key=thread.encode()))
        for n, future in enumerate(pending, 1):
            await future
            if on_sent is not None:
                on_sent(n)
        return len(pending)

    async def records(
        self, topic: str, thread: str | None = None, from_beginning: bool = False, idle_ms: int | None = None
    ) -> AsyncIterator[ConsumerRecord]:
        """Follow a topic's records (of one thread if `thread`); stop after `idle_ms` without any."""
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
        try:
            while True:
                batch = await consumer.getmany(timeout_ms=idle_ms if idle_ms is not None else 1000)
                if not batch and idle_ms is not None:
                    return
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

"""The Faust app: `memfilter worker` consumes `chat-requests` and `persist-messages`.

Two agents, each taking its topic a batch at a time (`take_events`), one batch in flight, so
each partition's records are handled strictly in offset order:

- `filter_requests` hands a batch to the `Processor` (decide against Redis, save, record)
  and sends what it returns to `filtered-inputs`, `persist-messages` and the dead-letter topic,
  waiting for the broker to have them before the batch counts as done (acked);
- `apply_persisted` hands `persist-messages` written by other services to the `Persister`.
  The processor's own events (header `memfilter.origin: processor`) are already saved.

Delivery is at least once: a batch whose outputs were not all delivered is consumed again
after a crash, and the processor's record of processed requests makes that harmless. A Redis
outage stalls the batch, which is retried until Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging

import faust
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streams.history import HistoryStore, connect
from streams.persister import Persister
from streams.processor import Out, Processor, Record
from streams.settings import WorkerSettings

log = logging.getLogger("memfilter")
ORIGIN = ("memfilter.origin", b"processor")


def _record(event) -> Record:
    m = event.message
    return Record(m.topic, m.partition, m.offset, int(m.timestamp * 1000), m.key, m.value, tuple(m.headers or ()))


async def _with_redis_retry(what: str, call):
    """Run `call()` until Redis answers; a batch is never dropped for an outage."""
    delay = 0.1
    while True:
        try:
            return await call()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            log.warning("Redis unavailable while %s (%s); retrying in %.1fs", what, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def create_app(settings: WorkerSettings) -> faust.App:
    app = faust.App(
        settings.group,
        broker=f"kafka://{settings.bootstrap}",
        store="memory://",
        datadir=settings.data_dir,
        web_host="127.0.0.1",
        web_port=settings.web_port,
        web_bind="127.0.0.1",
        producer_acks=-1,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=settings.session_timeout,
        broker_heartbeat_interval=settings.session_timeout / 4,
    )
    client = connect(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
    store = HistoryStore(client, settings.redis_prefix)
    processor = Processor(store, settings.topics, settings.limits)
    persister = Persister(store, settings.topics.dlq)
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    requests = app.topic(settings.topics.requests, **raw)
    persisted = app.topic(settings.topics.persist, **raw)

    async def send(outs: list[Out]) -> None:
        pending = [
            await app.producer.send(o.topic, o.key, o.value, None, o.timestamp_ms / 1000, [*o.headers, *_origin(o, settings)])
            for o in outs
        ]
        await asyncio.gather(*pending)

    @app.agent(requests, concurrency=1)
    async def filter_requests(stream):
        async for events in stream.take_events(settings.batch_max, within=settings.batch_within):
            records = [_record(e) for e in events]
            outs = await _with_redis_retry("filtering requests", lambda: processor.process(records))
            await send(outs)

    @app.agent(persisted, concurrency=1)
    async def apply_persisted(stream):
        async for events in stream.take_events(settings.batch_max, within=settings.batch_within):
            records = [r for r in map(_record, events) if ORIGIN not in r.headers]
            if records:
                await send(await _with_redis_retry("applying persisted messages", lambda: persister.process(records)))

    @app.page("/metrics")
    async def metrics(web, request):
        lines = [
            "# TYPE memfilter_requests_total counter",
            f"memfilter_requests_total {processor.requests}",
            "# TYPE memfilter_redis_round_trips_total counter",
            f"memfilter_redis_round_trips_total {processor.round_trips}",
        ]
        return web.text("\n".join(lines) + "\n", content_type="text/plain; version=0.0.4")

    return app


def _origin(out: Out, settings: WorkerSettings) -> tuple[tuple[str, bytes], ...]:
    return (ORIGIN,) if out.topic == settings.topics.persist else ()

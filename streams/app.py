"""The Faust app: `memfilter worker` consumes `chat-requests` and `persist-messages`.

Faust hosts the worker: its lifecycle, signals, logging and web server (`/metrics`,
`/healthz`, `/readyz`). The records themselves flow through one plain aiokafka consumer and
producer (`RecordLoop`), not through Faust's per-event streams: measured on this machine,
Faust's stream path cost more per event than the whole filter decision, and on a large
backlog it stopped fetching with nothing logged. The loop, a batch at a time:

1. fetch up to `MEMFILTER_BATCH_MAX` records of the assigned partitions of both topics, in
   offset order per partition (several workers share the partitions as one consumer group);
2. hand the `chat-requests` records to the `Processor` (decide against Redis, save, record)
   and the `persist-messages` written by other services to the `Persister` (the processor's
   own events, header `memfilter.origin: processor`, are already saved);
3. send what they return to `filtered-inputs`, `persist-messages` and the dead-letter topic,
   a producer batch per partition, and commit the batch's offsets once the broker has all of
   it and the batch before it is committed; the next batch is decided and sent meanwhile
   (its Redis writes come after this batch's, its records queue behind them).

Per thread, order holds because a thread's records sit in one partition and batches are
handled one after the other. Delivery is at least once: a batch whose outputs were not all
acknowledged is consumed again after a crash, and the processor's record of processed
requests makes that harmless. A Redis outage stalls the batch, retried until Redis answers.
Anything else unexpected stops the worker (exit 1) rather than leave it up but idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import random
import time

import faust
import mode
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import ConsumerStoppedError
from aiokafka.partitioner import murmur2
from aiokafka.structs import OffsetAndMetadata
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streams.history import HistoryStore, connect
from streams.metrics import Metrics
from streams.persister import Persister
from streams.processor import ORIGIN, Out, Processor, Record
from streams.settings import WorkerSettings

log = logging.getLogger("memfilter")
# Largest record fetched or sent: a request is at most MEMFILTER_MAX_BYTES (1 MiB), and its
# filtered input adds stored rows and server fields. The stack's broker accepts this much.
MAX_RECORD_BYTES = 8 << 20
# Batches whose outputs are sent but not yet all acknowledged and committed: the next batch is
# decided and sent meanwhile (the producer keeps each partition in order).
DELIVERIES_IN_FLIGHT = 2


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


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a batch is handled. A batch keeps tens of
    thousands of container objects alive until it is done (decoded requests, rows, records),
    so collections during it traverse them again and again, for nothing: they are freed by
    reference counting when the batch ends, and the collector runs between batches on what is
    left. Measured on the benchmark: collections took 7.7% of the worker's CPU, 0.6% after."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class RecordLoop(mode.Service):
    """Fetch a batch, process it, send its outputs, commit; one batch after the other."""

    def __init__(self, settings: WorkerSettings, store: HistoryStore, metrics: Metrics, **kwargs):
        super().__init__(**kwargs)
        self.settings = settings
        self.metrics = metrics
        self.processor = Processor(store, settings.topics, settings.limits, metrics)
        self.persister = Persister(store, settings.topics.dlq)
        self._consumer: AIOKafkaConsumer | None = None
        self._turn = asyncio.Lock()  # held while a batch is handled; a rebalance waits for it
        self._epoch = 0  # partition revocations so far
        self._delivering: list[asyncio.Task] = []  # batches' sends and commits in flight, oldest first

    async def on_start(self) -> None:
        settings = self.settings  # the clients are made here, on the worker's event loop
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.bootstrap,
            group_id=settings.group,
            client_id=f"memfilter-{settings.group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=MAX_RECORD_BYTES,
            fetch_max_bytes=8 * MAX_RECORD_BYTES,
            session_timeout_ms=int(settings.session_timeout * 1000),
            heartbeat_interval_ms=int(settings.session_timeout * 250),
            metadata_max_age_ms=30_000,  # partitions added to a topic are picked up within 30 s
        )
        self._producer = AIOKafkaProducer(
            bootstrap_servers=settings.bootstrap,
            client_id=f"memfilter-{settings.group}",
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            max_batch_size=1 << 20,
            max_request_size=MAX_RECORD_BYTES,
        )
        await self._producer.start()
        await self._consumer.start()
        topics = [self.settings.topics.requests, self.settings.topics.persist]
        await self._wait_for(topics)
        self._consumer.subscribe(topics, listener=_Rebalance(self))

    async def _wait_for(self, topics: list[str]) -> None:
        """Subscribing to a topic the broker does not yet know would leave it unassigned."""
        for attempt in itertools.count():
            missing = set(topics) - await self._consumer.topics()
            if not missing:
                return
            if attempt % 20 == 0:
                log.warning("waiting for topics %s: create them (`memfilter stack up` does)", ", ".join(sorted(missing)))
            await asyncio.sleep(0.5)

    async def on_stop(self) -> None:
        async with self._turn:
            await self._drain()
        await self._consumer.stop()
        await self._producer.stop()

    @mode.Service.task
    async def _run(self) -> None:
        try:
            while not self.should_stop:
                batch = await self._consumer.getmany(
                    timeout_ms=int(self.settings.batch_within * 1000), max_records=self.settings.batch_max
                )
                # Read with no await between: the batch came from the assignment of this epoch.
                epoch = self._epoch
                async with self._turn:
                    # A rebalance between the fetch and here revoked these records' partitions;
                    # whoever holds them now (this worker too) fetches them again from the commit.
                    if batch and epoch == self._epoch:
                        with _collector_paused():
                            await self._handle(batch)
        except ConsumerStoppedError:
            pass
        except Exception:
            log.critical("memfilter worker: stopping on an unexpected error", exc_info=True)
            self._crash_process()

    def _crash_process(self) -> None:
        # A worker that stays up but handles nothing is worse than one that exits: the
        # orchestrator restarts it and the group gives its partitions to the others meanwhile.
        os._exit(1)

    async def _handle(self, batch) -> None:
        topics = self.settings.topics
        requests, persisted, offsets = [], [], {}
        for tp, records in batch.items():
            offsets[tp] = OffsetAndMetadata(records[-1].offset + 1, "")
            for r in records:
                if r.topic == topics.requests:
                    requests.append(Record.of(r))
                elif ORIGIN not in r.headers:  # the processor's own events are saved already
                    persisted.append(Record.of(r))
        self.metrics.batch_size.observe(sum(len(rs) for rs in batch.values()))
        outs: list[Out] = []
        if requests:
            outs += await _with_redis_retry("filtering requests", lambda: self.processor.process(requests))
        if persisted:
            rejected = await _with_redis_retry("applying persisted messages", lambda: self.persister.process(persisted))
            self.metrics.persisted.inc(len(persisted) - len(rejected))
            outs += rejected
        while len(self._delivering) >= DELIVERIES_IN_FLIGHT:
            await self._delivering.pop(0)
        sends = await self._send(outs)
        before = self._delivering[-1] if self._delivering else None
        self._delivering.append(asyncio.create_task(self._deliver(sends, offsets, requests, before)))
        for tp, offset in offsets.items():
            end = self._consumer.highwater(tp)
            if end is not None:
                self.metrics.lag.labels(tp.topic, str(tp.partition)).set(max(0, end - offset.offset))

    async def _send(self, outs: list[Out]) -> list[asyncio.Future]:
        """Queue the records a batch per topic partition, in their order: the producer's
        per-record `send` costs ~8 µs of Python each, appending to a batch ~1. Partitions are
        chosen as `send` chooses them (murmur2 of the key, as Java clients do); the futures
        complete when the broker has the batches."""
        producer, persist_topic = self._producer, self.settings.topics.persist
        partitions = {topic: sorted(await producer.partitions_for(topic)) for topic in {o.topic for o in outs}}
        hashes: dict[bytes, int] = {}
        by_partition: dict[tuple[str, int], list[Out]] = {}
        for out in outs:
            candidates = partitions[out.topic]
            if out.key is None:
                partition = random.choice(candidates)
            else:
                h = hashes.get(out.key)
                if h is None:
                    h = hashes[out.key] = murmur2(out.key) & 0x7FFFFFFF
                partition = candidates[h % len(candidates)]
            by_partition.setdefault((out.topic, partition), []).append(out)
            if out.topic == self.settings.topics.dlq:
                error_type = next((v for k, v in out.headers if k == "error.type"), b"")
                self.metrics.dead_letters.labels(error_type.decode()).inc()
        sends = []
        for (topic, partition), group in by_partition.items():
            batch = producer.create_batch()
            for out in group:
                headers = [*out.headers, ORIGIN] if topic == persist_topic else list(out.headers)
                while batch.append(key=out.key, value=out.value, timestamp=out.timestamp_ms, headers=headers) is None:
                    sends.append(await producer.send_batch(batch, topic, partition=partition))  # full: the next one
                    batch = producer.create_batch()
            sends.append(await producer.send_batch(batch, topic, partition=partition))
        return sends

    async def _deliver(self, sends: list[asyncio.Future], offsets: dict, requests: list[Record], before: asyncio.Task | None) -> None:
        """Commit the batch once the broker has all of its outputs and the batch before it is committed."""
        await asyncio.gather(*sends)
        if before is not None:
            await before
        await self._consumer.commit(offsets)
        now_ms = time.time() * 1000
        for r in requests:
            self.metrics.end_to_end.observe(max(0.0, now_ms - r.timestamp_ms) / 1000)

    @property
    def assigned(self) -> set[TopicPartition]:
        return self._consumer.assignment() if self._consumer is not None else set()

    async def partitions_revoked(self) -> None:
        """Partitions leave only after the batch in hand is delivered and committed."""
        async with self._turn:
            await self._drain()
            self._epoch += 1
        self.metrics.lag.clear()
        self.metrics.assigned.set(0)

    def partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        self.metrics.assigned.set(len(assigned))

    async def _drain(self) -> None:
        """Wait for the sends and commits in flight; a failure there stops the worker."""
        while self._delivering:
            await self._delivering.pop(0)


class _Rebalance(ConsumerRebalanceListener):
    """Tells the loop when partitions leave and arrive."""

    def __init__(self, loop: RecordLoop):
        self.loop = loop

    async def on_partitions_revoked(self, revoked) -> None:
        await self.loop.partitions_revoked()

    async def on_partitions_assigned(self, assigned) -> None:
        self.loop.partitions_assigned(set(assigned))


class _WebOnly(faust.App.BootStrategy):
    """Faust starts its web server and sensors; the records go through `RecordLoop`."""

    enable_kafka = False


def create_app(settings: WorkerSettings) -> faust.App:
    app = faust.App(
        settings.group,
        broker=f"kafka://{settings.bootstrap}",
        store="memory://",
        datadir=settings.data_dir,
        web_host=settings.web_bind,
        web_port=settings.web_port,
        web_bind=settings.web_bind,
    )
    app.boot_strategy = _WebOnly(app)
    client = connect(settings.redis_url)
    metrics = Metrics()
    loop = RecordLoop(settings, HistoryStore(client, settings.redis_prefix, metrics), metrics)
    app.add_dependency(loop)

    @app.page("/metrics")
    async def metrics_page(web, request):
        return web.bytes(metrics.render(), content_type="text/plain; version=0.0.4")

    @app.page("/healthz")
    async def healthz(web, request):
        return web.text("ok\n")

    @app.page("/readyz")
    async def readyz(web, request):
        problems = [] if loop.assigned else ["no partitions assigned"]
        try:
            await asyncio.wait_for(client.ping(), 1.0)
        except Exception as e:  # any failure to answer is "not ready", named in the reply
            problems.append(f"Redis not answering ({type(e).__name__})")
        if problems:
            return web.text("not ready: " + "; ".join(problems) + "\n", status=503)
        return web.text("ready\n")

    return app

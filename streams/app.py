"""The Faust app: `memfilter worker` consumes `chat-requests` and `persist-messages`.

Faust hosts the worker: its lifecycle, signals, logging and web server (`/metrics`,
`/healthz`, `/readyz`). The records themselves flow through one plain aiokafka consumer and
one transactional producer (`RecordLoop`), not through Faust's per-event streams: measured
on this machine, Faust's stream path cost more per event than the whole filter decision,
and on a large backlog it stopped fetching with nothing logged. The loop, a batch at a time:

1. fetch up to `MEMFILTER_BATCH_MAX` records of the assigned partitions of both topics, in
   offset order per partition (several workers share the partitions as one consumer group);
2. hand the `chat-requests` records to the `Processor` (decide against Redis, save, record)
   and the `persist-messages` written by other services to the `Persister` (the processor's
   own events, signed by it, are already saved: `streams/origin.py`);
3. once the batch before is committed, send what they return (to `filtered-inputs`,
   `persist-messages` and the dead-letter topic, a producer batch per partition) and the
   batch's offsets in one Kafka transaction. The next batch is decided meanwhile (its Redis
   writes come after this batch's).

Per thread, order holds because a thread's records sit in one partition and batches are
handled one after the other. Outputs are exactly once for `read_committed` consumers: a
batch's outputs and its offsets are committed together or not at all, and a crash leaves at
most an open transaction, which is aborted when its id is taken up again (below); the batch
is then consumed again. Redis is outside the transaction: the processor's record of
processed requests makes the second pass emit the same bytes without deciding again (a
`read_uncommitted` consumer may see both copies). A Redis outage stalls the batch, retried
until Redis answers. Anything else unexpected, a fenced producer among them, stops the worker
(exit 1) rather than leave it up but idle.

Transactional ids, so that a dead or stalled worker's transactions are aborted or fenced
without waiting for a timeout: every input partition has one (`transactional_id`).
A worker given partitions starts a producer with the id of each, which aborts what an earlier
owner left open and fences that owner out, and keeps the one of its first partition for its
own transactions. Whoever is given that partition next does the same to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streams import origin
from streams.history import HistoryStore, connect
from streams.metrics import Metrics
from streams.persister import Persister
from streams.processor import Out, Processor, Record
from streams.settings import WorkerSettings

log = logging.getLogger("memfilter")
# Largest record fetched or sent: a request is at most MEMFILTER_MAX_BYTES (1 MiB), and its
# filtered input adds stored rows and server fields. The stack's broker accepts this much.
MAX_RECORD_BYTES = 8 << 20


def transactional_id(group: str, tp: TopicPartition) -> str:
    """The transactional id of an input partition (see the header)."""
    return f"memfilter-{group}-{tp.topic}-{tp.partition}"


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


@functools.lru_cache(maxsize=1 << 16)
def _key_hash(key: bytes) -> int:
    """murmur2 of a record key, as Kafka's default partitioner takes it: aiokafka's is pure
    Python, ~2 µs for a thread id, and a thread's key recurs from batch to batch."""
    return murmur2(key) & 0x7FFFFFFF


class RecordLoop(mode.Service):
    """Fetch a batch, process it, send its outputs, commit; one batch after the other."""

    def __init__(self, settings: WorkerSettings, store: HistoryStore, metrics: Metrics, **kwargs):
        super().__init__(**kwargs)
        self.settings = settings
        self.metrics = metrics
        self.processor = Processor(store, settings.topics, settings.limits, metrics, settings.secret)
        self.persister = Persister(store, settings.topics.dlq, settings.secret)
        self._consumer: AIOKafkaConsumer | None = None
        self._turn = asyncio.Lock()  # held while a batch is handled; a rebalance waits for it
        self._epoch = 0  # partition revocations so far
        self._delivering: asyncio.Task | None = None  # the previous batch's transaction
        self._producer: AIOKafkaProducer | None = None  # transactional: made when partitions are assigned

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
            isolation_level="read_committed",  # persist events of an aborted transaction are not applied
        )
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
            await self._stop_producer()
        await self._consumer.stop()

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
        topics, secret = self.settings.topics, self.settings.secret
        requests, persisted, offsets = [], [], {}
        for tp, records in batch.items():
            offsets[tp] = records[-1].offset + 1
            for r in records:
                if r.topic == topics.requests:
                    requests.append(Record.of(r))
                elif not origin.is_processors(r.value, r.headers, secret):  # the processor's own are saved already
                    persisted.append(Record.of(r))
        self.metrics.batch_size.observe(sum(len(rs) for rs in batch.values()))
        outs: list[Out] = []
        if requests:
            outs += await _with_redis_retry("filtering requests", lambda: self.processor.process(requests))
        if persisted:
            rejected = await _with_redis_retry("applying persisted messages", lambda: self.persister.process(persisted))
            self.metrics.persisted.inc(len(persisted) - len(rejected))
            outs += rejected
        await self._drain()  # a producer has one transaction at a time: the previous batch's first
        self._delivering = asyncio.create_task(self._deliver(outs, offsets, requests))
        for tp, offset in offsets.items():
            end = self._consumer.highwater(tp)
            if end is not None:
                self.metrics.lag.labels(tp.topic, str(tp.partition)).set(max(0, end - offset))

    async def _send(self, outs: list[Out]) -> list[asyncio.Future]:
        """Queue the records a batch per topic partition, in their order: the producer's
        per-record `send` costs ~8 µs of Python each, appending to a batch ~1. Partitions are
        chosen as `send` chooses them (murmur2 of the key, as Java clients do); the futures
        complete when the broker has the batches."""
        producer = self._producer
        partitions = {topic: sorted(await producer.partitions_for(topic)) for topic in {o.topic for o in outs}}
        by_partition: dict[tuple[str, int], list[Out]] = {}
        for out in outs:
            candidates = partitions[out.topic]
            if out.key is None:
                partition = random.choice(candidates)
            else:
                partition = candidates[_key_hash(out.key) % len(candidates)]
            by_partition.setdefault((out.topic, partition), []).append(out)
            if out.topic == self.settings.topics.dlq:
                error_type = next((v for k, v in out.headers if k == "error.type"), b"")
                self.metrics.dead_letters.labels(error_type.decode()).inc()
        sends = []
        for (topic, partition), group in by_partition.items():
            batch = producer.create_batch()
            for out in group:
                while batch.append(key=out.key, value=out.value, timestamp=out.timestamp_ms, headers=list(out.headers)) is None:
                    sends.append(await producer.send_batch(batch, topic, partition=partition))  # full: the next one
                    batch = producer.create_batch()
            sends.append(await producer.send_batch(batch, topic, partition=partition))
        return sends

    async def _deliver(self, outs: list[Out], offsets: dict[TopicPartition, int], requests: list[Record]) -> None:
        """The batch's outputs and offsets in one transaction."""
        producer = self._producer
        await producer.begin_transaction()
        await asyncio.gather(*await self._send(outs))
        await producer.send_offsets_to_transaction(offsets, self.settings.group)
        await producer.commit_transaction()
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
            await self._stop_producer()
            self._epoch += 1
        self.metrics.lag.clear()
        self.metrics.assigned.set(0)

    async def partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Take up the transactional id of every assigned partition (see the module's header):
        starting a producer with an id aborts the transaction its last user left open and
        fences that user out. The first partition's producer is kept for this worker's own."""
        self.metrics.assigned.set(len(assigned))
        if not assigned:
            return
        first, *others = sorted(assigned)
        fencers = [self._transactional(tp) for tp in others]
        self._producer = self._transactional(first)
        await asyncio.gather(self._producer.start(), *(p.start() for p in fencers))
        await asyncio.gather(*(p.stop() for p in fencers))

    def _transactional(self, tp: TopicPartition) -> AIOKafkaProducer:
        settings = self.settings
        return AIOKafkaProducer(
            bootstrap_servers=settings.bootstrap,
            client_id=f"memfilter-{settings.group}",
            transactional_id=transactional_id(settings.group, tp),
            acks="all",
            linger_ms=0,  # batches are built whole (`_send`) and sent at once
            max_batch_size=1 << 20,
            max_request_size=MAX_RECORD_BYTES,
        )

    async def _stop_producer(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()

    async def _drain(self) -> None:
        """Wait for the previous batch's transaction; a failure there (a fenced producer, say) stops the worker."""
        if self._delivering is not None:
            delivering, self._delivering = self._delivering, None
            await delivering


class _Rebalance(ConsumerRebalanceListener):
    """Tells the loop when partitions leave and arrive. aiokafka only logs a listener's error
    and goes on, so a failure here (the batch in hand's transaction, a producer that cannot
    start: does the broker allow transactions?) stops the worker instead."""

    def __init__(self, loop: RecordLoop):
        self.loop = loop

    async def on_partitions_revoked(self, revoked) -> None:
        await self._or_stop(self.loop.partitions_revoked())

    async def on_partitions_assigned(self, assigned) -> None:
        await self._or_stop(self.loop.partitions_assigned(set(assigned)))

    async def _or_stop(self, step) -> None:
        try:
            await step
        except Exception:
            log.critical("memfilter worker: stopping on an unexpected error in a rebalance", exc_info=True)
            self.loop._crash_process()


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
    loop = RecordLoop(settings, HistoryStore(client, settings.redis_prefix, metrics, settings.processed_ttl), metrics)
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

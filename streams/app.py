"""The Faust app: `memfilter worker` consumes `chat-requests` and `persist-messages`.

Faust hosts the worker: its lifecycle, signals, logging and web server (`/metrics`,
`/healthz`, `/readyz`). The records themselves flow through one plain aiokafka consumer and
a transactional producer per task (`RecordLoop`), not through Faust's per-event streams:
measured on this machine, Faust's stream path cost more per event than the whole filter
decision, and on a large backlog it stopped fetching with nothing logged.

A thread has two writers: its requests (`chat-requests`) and other services' saves
(`persist-messages`, the agent runner's replies), both keyed by thread id. Partition p of the
two topics is one *task*, always given to one worker (the range assignor over two topics of
the same partition count, checked at assignment), so one worker applies a thread's requests
and saves in one order. The loop, a batch at a time:

1. fetch up to `MEMFILTER_BATCH_MAX` records of the assigned partitions, in offset order per
   partition, and the `persist-messages` records committed before its requests but not yet
   in hand (`_catch_up`);
2. merge each task's two partitions by record timestamp and cut the batch into phases
   (`in_order`); per phase, hand the requests to the `Processor` (decide against Redis,
   save, record) and other services' events to the `Persister` (the processor's own events,
   signed by it, are already saved: `streams/origin.py`);
3. send what they return (to `filtered-inputs`, `persist-messages` and the dead-letter topic,
   a producer batch per partition) and the batch's offsets: a transaction per task, committed
   while the next batch is fetched and before it is decided.

So a writer's save that was acknowledged before a client sent its next request (the agent's
reply, say) is applied before that request, provided both are keyed by the thread id and the
writers' clocks agree to within the time between the two.

Outputs are exactly once for `read_committed` consumers: a task's outputs and its offsets are
committed together or not at all, and a crash leaves at most an open transaction, which is
aborted when the task's transactional id is taken up again (below); the records are then
consumed again. Redis is outside the transaction: the processor's record of processed
requests makes the second pass emit the same bytes without deciding again, and a save is
applied once (`streams/persister.py`). A Redis outage stalls the batch, retried until Redis
answers. Anything else unexpected, a fenced producer among them, stops the worker (exit 1)
rather than leave it up but idle.

Fencing, so that a dead or stalled worker can neither commit nor write after its tasks were
given to another: each task has its own transactional id (`transactional_id`), as Kafka
Streams' first exactly-once design had (aiokafka's transactional offset commits carry no group
generation, so one producer per worker could not be fenced task by task). A worker given
tasks (1) starts a producer with each task's id, which aborts what the last owner left open
and fences that owner's producer; (2) takes a new owner epoch, which fences its Redis writes
(`streams/history.py`); (3) only then reads the committed offsets it starts from, which no
fenced owner can move any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import heapq
import importlib.metadata
import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import faust
import mode
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import ConsumerStoppedError, IllegalStateError
from aiokafka.partitioner import murmur2
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from streams import origin
from streams.filter import Rejection
from streams.history import TIMEOUT_S, Fenced, HistoryStore, connect
from streams.metrics import Metrics
from streams.persister import Persister
from streams.processor import MAX_RECORD_BYTES, Out, Processor, Record, Topics, dead_letter
from streams.settings import Settings

log = logging.getLogger("memfilter")

def _without_password(url: str) -> str:
    parts = urlsplit(url)
    return url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1)


def transactional_id(group: str, task: int) -> str:
    """The transactional id of a task (see the header)."""
    return f"memfilter-{group}-task-{task}"


async def _with_redis_retry(what: str, call):
    """Run `call()` until Redis answers; a batch is never dropped for an outage."""
    delay = 0.1
    while True:
        try:
            return await call()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            reason = f"no answer within {TIMEOUT_S:.0f} s" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}"
            log.warning("Redis unavailable while %s (%s); retrying in %.1fs", what, reason, delay)
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


class CoPartitioning(Exception):
    """The two input topics cannot be consumed co-partitioned."""


# How long a batch waits at most for `persist-messages` records that were committed before its
# requests were fetched but are not in hand yet, checking every CATCH_UP_POLL_MS (`_catch_up`).
# The consumer's fetches wait at most FETCH_MAX_WAIT_MS for data: a quiet partition is
# fetched again that often.
CATCH_UP_S = 1.0
CATCH_UP_POLL_MS = 10
FETCH_MAX_WAIT_MS = 100


class RecordLoop(mode.Service):
    """Fetch a batch, process it, send its outputs, commit; one batch after the other."""

    def __init__(self, settings: Settings, store: HistoryStore, metrics: Metrics, **kwargs):
        super().__init__(**kwargs)
        self.settings = settings
        self.metrics = metrics
        self.store = store
        self.processor = Processor(store, settings.topics, settings.limits, metrics, settings.secret, history=settings.history_messages, edits=settings.edits == "on")
        self.persister = Persister(store, settings.topics.dlq, settings.secret)
        self._consumer: AIOKafkaConsumer | None = None
        self._turn = asyncio.Lock()  # held while a batch is handled; a rebalance waits for it
        self._epoch = 0  # partition revocations and assignments so far
        self._delivering: asyncio.Task | None = None  # the previous batch's transactions
        self._producers: dict[int, AIOKafkaProducer] = {}  # task -> its transactional producer: made when tasks are assigned
        self._committed: dict[TopicPartition, int] = {}  # the offsets committed (or started from), by assigned partition

    async def on_start(self) -> None:
        settings = self.settings  # the clients are made here, on the worker's event loop
        log.info(
            "memfilter worker %s starting: group %s, Kafka %s, Redis %s, web http://%s:%d",
            importlib.metadata.version("memfilter"), settings.group, settings.bootstrap,
            _without_password(settings.redis_url), settings.web_bind, settings.web_port,
        )
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
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
            # Partition p of both topics to one worker (see the header): the range assignor lays
            # out each topic's partitions over the same sorted members.
            partition_assignment_strategy=(RangePartitionAssignor,),
        )
        await self._consumer.start()
        topics = [self.settings.topics.requests, self.settings.topics.persist]
        await wait_for_topics(self._consumer, topics)
        self._consumer.subscribe(topics, listener=Rebalance(self))

    async def on_stop(self) -> None:
        async with self._turn:
            await self._drain()
            await self._stop_producers()
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
                if batch:
                    # The batch before must be committed first: an open transaction of ours
                    # holds back the stable offset of `persist-messages`, and with it any save
                    # appended after it. Outside the turn: a fetch (`_catch_up`) waits for a
                    # rebalance to end, which waits for the turn.
                    await self._drain()
                    await self._catch_up(batch, epoch)
                async with self._turn:
                    # A rebalance between the fetch and here revoked these records' partitions;
                    # whoever holds them now (this worker too) fetches them again from the commit.
                    if epoch == self._epoch and self._producers:
                        with _collector_paused():
                            await self._handle(batch)
        except ConsumerStoppedError:
            pass
        except Fenced as e:
            log.critical("memfilter worker: %s", e)
            self._crash_process()
        except Exception:
            log.critical("memfilter worker: stopping on an unexpected error", exc_info=True)
            self._crash_process()

    def _crash_process(self) -> None:
        # A worker that stays up but handles nothing is worse than one that exits: the
        # orchestrator restarts it and the group gives its partitions to the others meanwhile.
        os._exit(1)

    async def _handle(self, batch) -> None:
        """Decide and apply the batch, then commit its outputs with the consumer's positions:
        past the last record, and past the transaction markers after it (a partition whose last
        records are markers, ours on `persist-messages` among them, is committed when it moves
        past them, so an idle worker's lag is 0)."""
        if batch:
            self.metrics.batch_size.observe(sum(len(rs) for rs in batch.values()))
        outs, requests = await _with_redis_retry("handling a batch", lambda: self._decide_and_apply(batch))
        positions = {tp: await self._consumer.position(tp) for tp in self._committed}
        offsets = {tp: p for tp, p in positions.items() if p > self._committed[tp]}
        for tp in offsets:
            outs.setdefault(tp.partition, [])
        if offsets or any(outs.values()):
            await self._drain()  # one transaction at a time per producer
            recorded = self.processor.take_recorded()
            self._delivering = asyncio.create_task(self._deliver(outs, offsets, requests, recorded))  # the next fetch meanwhile
        for tp, position in positions.items():
            end = self._consumer.highwater(tp)
            if end is not None:
                self.metrics.lag.labels(tp.topic, str(tp.partition)).set(max(0, end - position))

    async def _decide_and_apply(self, batch) -> tuple[dict[int, list[Out]], list[Record]]:
        """The batch's outputs by task, and its requests: requests decided and saves applied in
        the order they were appended, then every Redis write of the batch on its replicas
        (`HistoryStore.replicate`). A Redis failure anywhere has the whole batch handled again:
        what was written is found then (requests by their records, saves by their identity)."""
        outs: dict[int, list[Out]] = {tp.partition: [] for tp in batch}  # by task
        requests: list[Record] = []
        for phase_requests, phase_persisted in in_order(batch, self.settings.topics, self.settings.secret):
            if phase_requests:
                for record, record_outs in zip(phase_requests, await self.processor.outputs(phase_requests)):
                    outs[record.partition] += record_outs
            if phase_persisted:
                results = await self.persister.apply(phase_persisted)
                for record, result in zip(phase_persisted, results):
                    if isinstance(result, Rejection):
                        outs[record.partition].append(dead_letter(record, self.settings.topics.dlq, result))
                self.metrics.persisted.inc(sum(1 for r in results if not isinstance(r, Rejection)))
            requests += phase_requests
        await self.store.replicate()
        return outs, requests

    async def _catch_up(self, batch, epoch: int) -> None:
        """Bring into the batch every `persist-messages` record of its requests' tasks that was
        committed before the requests were fetched: a reply acknowledged before a request was
        sent is then decided before it, whatever the order in which the fetcher brought the two
        partitions. A task's save partition is caught up once a fetch of it answered after its
        request partition's last one (the fetcher has one fetch in flight per broker, so that
        fetch saw the log when the requests were already in it) and everything below the stable
        offset that fetch reported is consumed. Waits at most CATCH_UP_S; stops if a rebalance
        takes the partitions away (the batch is then dropped: `_run`). A rebalance can run inside
        a fetch here, which then returns records from the new assignment's positions: those are
        handed back (the partitions are sought back to them), or dropping the batch would lose
        them."""
        topics, consumer = self.settings.topics, self._consumer
        try:
            since = {}  # save partition -> the last fetch time of its request partition
            for task in {tp.partition for tp in batch if tp.topic == topics.requests}:
                tp, requests_tp = TopicPartition(topics.persist, task), TopicPartition(topics.requests, task)
                if not {tp, requests_tp} <= consumer.assignment():
                    return
                since[tp] = consumer.last_poll_timestamp(requests_tp) or 0
            deadline = time.monotonic() + CATCH_UP_S
            while since and time.monotonic() < deadline:
                since = {tp: t for tp, t in since.items() if not await self._caught_up(tp, t)}
                if since:
                    more = await consumer.getmany(*since, timeout_ms=CATCH_UP_POLL_MS, max_records=self.settings.batch_max)
                    if epoch != self._epoch:
                        for tp, records in more.items():
                            if records:
                                consumer.seek(tp, records[0].offset)
                        return
                    for tp, records in more.items():
                        batch.setdefault(tp, []).extend(records)
        except IllegalStateError:  # no longer assigned
            return

    async def _caught_up(self, tp: TopicPartition, since: int) -> bool:
        if tp not in self._consumer.assignment():  # revoked meanwhile (aiokafka asserts, below): nothing to wait for
            return True
        polled, stable = self._consumer.last_poll_timestamp(tp), self._consumer.last_stable_offset(tp)
        return polled is not None and polled >= since and stable is not None and await self._consumer.position(tp) >= stable

    async def _send(self, producer: AIOKafkaProducer, outs: list[Out]) -> list[asyncio.Future]:
        """Queue the records a batch per topic partition, in their order: the producer's
        per-record `send` costs ~8 µs of Python each, appending to a batch ~1. Partitions are
        chosen as `send` chooses them (murmur2 of the key, as Java clients do); the futures
        complete when the broker has the batches."""
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

    async def _deliver(
        self, outs: dict[int, list[Out]], offsets: dict[TopicPartition, int], requests: list[Record], recorded: list[tuple[str, bytes]]
    ) -> None:
        """The batch's outputs and offsets: one transaction per task, each on the task's
        producer; then the batch's records of processed requests are dropped from Redis, as
        no re-delivery needs them any more (`streams/history.py`)."""

        async def transaction(task: int) -> None:
            producer = self._producers[task]
            await producer.begin_transaction()
            await asyncio.gather(*await self._send(producer, outs[task]))
            if mine := {tp: o for tp, o in offsets.items() if tp.partition == task}:
                await producer.send_offsets_to_transaction(mine, self.settings.group)
            await producer.commit_transaction()

        await asyncio.gather(*(transaction(task) for task in outs))
        self._committed.update(offsets)
        try:
            await self.store.drop_records(recorded)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            log.warning("Redis unavailable while dropping %d committed records (%s); they expire after MEMFILTER_PROCESSED_TTL", len(recorded), e)
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
            await self._stop_producers()
            self._committed = {}
            self._epoch += 1
        self.metrics.lag.clear()
        self.metrics.assigned.set(0)

    async def partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Take up the assigned tasks (see the module's header): start each task's producer,
        which aborts the transaction its last owner left open and fences that owner out; then
        take a new owner epoch for Redis writes, and only then read where to start from
        (the committed offsets), which no fenced owner can move any more."""
        self.metrics.assigned.set(len(assigned))
        if not assigned:
            log.info("memfilter worker ready: no tasks for now (the group has more workers than partitions)")
            return
        tasks = self._check_co_partitioned(assigned)
        async with self._turn:
            self._producers = {task: self._transactional(task) for task in tasks}
            await asyncio.gather(*(p.start() for p in self._producers.values()))
            await _with_redis_retry("taking an owner epoch", self.store.take_epoch)
            await self._seek_to_committed(assigned)
        topics = self.settings.topics
        log.info("memfilter worker ready: %d tasks %s (partitions of %s and %s)", len(tasks), tasks, topics.requests, topics.persist)

    async def _seek_to_committed(self, assigned: set[TopicPartition]) -> None:
        self._committed = await seek_to_committed(self._consumer, assigned)
        self._epoch += 1  # a batch fetched before the seek is dropped (`_run`): it is fetched again from here

    def _check_co_partitioned(self, assigned: set[TopicPartition]) -> list[int]:
        """The tasks assigned: the partition numbers, the same for both topics."""
        topics = self.settings.topics
        counts = {t: len(self._consumer.partitions_for_topic(t) or ()) for t in (topics.requests, topics.persist)}
        if counts[topics.requests] != counts[topics.persist]:
            raise CoPartitioning(
                f"{topics.requests} has {counts[topics.requests]} partitions and {topics.persist} {counts[topics.persist]}; "
                "a thread's requests and saves must be read by one worker: give both topics the same number of partitions"
            )
        by_topic = {t: sorted(tp.partition for tp in assigned if tp.topic == t) for t in (topics.requests, topics.persist)}
        if by_topic[topics.requests] != by_topic[topics.persist]:
            raise CoPartitioning(
                f"assigned {topics.requests} partitions {by_topic[topics.requests]} but {topics.persist} partitions "
                f"{by_topic[topics.persist]}: every worker of group {self.settings.group} must use the range assignor"
            )
        return by_topic[topics.requests]

    def _transactional(self, task: int) -> AIOKafkaProducer:
        settings = self.settings
        return AIOKafkaProducer(
            bootstrap_servers=settings.bootstrap,
            client_id=f"memfilter-{settings.group}",
            transactional_id=transactional_id(settings.group, task),
            acks="all",
            linger_ms=0,  # batches are built whole (`_send`) and sent at once
            max_batch_size=1 << 20,
            max_request_size=MAX_RECORD_BYTES,
        )

    async def _stop_producers(self) -> None:
        producers, self._producers = self._producers, {}
        await asyncio.gather(*(p.stop() for p in producers.values()))

    async def _drain(self) -> None:
        """Wait for the previous batch's transactions; a failure there (a fenced producer, say) stops the worker."""
        if self._delivering is not None:
            await self._delivering  # several may wait for it (the loop, a rebalance)
            self._delivering = None


async def wait_for_topics(consumer: AIOKafkaConsumer, topics: list[str]) -> None:
    """Subscribing to a topic the broker does not yet know would leave it unassigned."""
    for attempt in itertools.count():
        missing = set(topics) - await consumer.topics()
        if not missing:
            return
        if attempt % 20 == 0:
            log.warning("waiting for topics %s: create them (`memfilter stack up` does)", ", ".join(sorted(missing)))
        await asyncio.sleep(0.5)


async def seek_to_committed(consumer: AIOKafkaConsumer, assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
    """Start every assigned partition again from its committed offset (the beginning if
    none), all at once after the last await, so that no batch fetched from a partition already
    moved back is taken for one fetched after (the caller then drops batches fetched before:
    they are fetched again from here); the offsets started from."""
    tps = sorted(assigned)
    committed = dict(zip(tps, await asyncio.gather(*(consumer.committed(tp) for tp in tps))))
    never = [tp for tp, offset in committed.items() if offset is None]
    beginnings = await consumer.beginning_offsets(never) if never else {}
    starts = {tp: beginnings[tp] if offset is None else offset for tp, offset in committed.items()}
    for tp, offset in starts.items():
        consumer.seek(tp, offset)
    return starts


def in_order(batch: dict[TopicPartition, list], topics: Topics, secret: bytes) -> list[tuple[list[Record], list[Record]]]:
    """The batch's requests and other writers' persist events, in the order to apply them: in
    each task, the two partitions merged by record timestamp (a save first on a tie), as Kafka
    Streams merges co-partitioned inputs; then cut into phases, (requests, events), such that
    each thread's records of one phase are all requests or all events. Phases are applied one
    after the other, so each thread sees its records in merged order, and a phase's requests
    go to the processor together (its round trips do not grow with the number of threads)."""
    phases: list[tuple[list[Record], list[Record]]] = []
    last: dict[bytes | None, tuple[int, bool]] = {}  # thread (record key) -> (its phase, requests?)
    for task in sorted({tp.partition for tp in batch}):
        requests = [(Record.of(r), True) for r in batch.get(TopicPartition(topics.requests, task), ())]
        persisted = [
            (Record.of(r), False)
            for r in batch.get(TopicPartition(topics.persist, task), ())
            if not origin.is_processors(r.value, r.headers, secret)  # the processor's own are saved already
        ]
        for record, is_request in heapq.merge(persisted, requests, key=lambda item: item[0].timestamp_ms):
            phase, was_request = last.get(record.key, (-1, None))
            if was_request is not is_request:
                phase += 1
                last[record.key] = (phase, is_request)
            if phase == len(phases):
                phases.append(([], []))
            phases[phase][0 if is_request else 1].append(record)
    return phases


class Rebalance(ConsumerRebalanceListener):
    """Tells a loop (the worker's, the agent runner's) when partitions leave and arrive.
    aiokafka only logs a listener's error and goes on, so a failure here (the batch in hand's
    transaction, a producer that cannot start: does the broker allow transactions?) stops the
    process instead."""

    def __init__(self, loop: RecordLoop | Any):
        self.loop = loop

    async def on_partitions_revoked(self, revoked) -> None:
        await self._or_stop(self.loop.partitions_revoked())

    async def on_partitions_assigned(self, assigned) -> None:
        await self._or_stop(self.loop.partitions_assigned(set(assigned)))

    async def _or_stop(self, step) -> None:
        try:
            await step
        except CoPartitioning as e:
            log.critical("memfilter worker: %s", e)
            self.loop._crash_process()
        except Exception:
            log.critical("memfilter: stopping on an unexpected error in a rebalance", exc_info=True)
            self.loop._crash_process()


class _WebOnly(faust.App.BootStrategy):
    """Faust starts its web server and sensors; the records go through `RecordLoop`."""

    enable_kafka = False


def serve_health(name: str, settings: Settings, datadir: str, port: int, metrics, problems: Callable[[], list[str]], redis=None) -> faust.App:
    """A Faust app that serves `/metrics`, `/healthz` and `/readyz` (ready when `problems()`
    names none and `redis`, if given, answers), for the worker and the agent runner alike."""
    app = faust.App(
        name,
        broker=f"kafka://{settings.bootstrap}",
        store="memory://",
        datadir=datadir,
        web_host=settings.web_bind,
        web_port=port,
        web_bind=settings.web_bind,
        env={},  # only the documented settings configure it, never Faust's own variables (WEB_PORT, ...)
    )
    app.boot_strategy = _WebOnly(app)

    @app.page("/metrics")
    async def metrics_page(web, request):
        return web.bytes(metrics.render(), content_type="text/plain; version=0.0.4")

    @app.page("/healthz")
    async def healthz(web, request):
        return web.text("ok\n")

    @app.page("/readyz")
    async def readyz(web, request):
        found = problems()
        if redis is not None:
            try:
                await asyncio.wait_for(redis.ping(), 1.0)
            except Exception as e:  # any failure to answer is "not ready", named in the reply
                found.append(f"Redis not answering ({type(e).__name__})")
        if found:
            return web.text("not ready: " + "; ".join(found) + "\n", status=503)
        return web.text("ready\n")

    return app


def create_app(settings: Settings) -> faust.App:
    client = connect(settings.redis_url)
    metrics = Metrics()
    store = HistoryStore(
        client, settings.redis_prefix, metrics, settings.processed_ttl, settings.retry_window, settings.redis_replicas, settings.redis_replica_timeout
    )
    loop = RecordLoop(settings, store, metrics)
    app = serve_health(settings.group, settings, settings.data_dir, settings.web_port, metrics, lambda: [] if loop.assigned else ["no partitions assigned"], client)
    app.add_dependency(loop)
    return app

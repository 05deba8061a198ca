"""The transactional task loop: fetch a batch, handle it, produce and commit in one transaction.

Both consumers of the product run on it: the worker (`chat-requests` and `persist-messages`,
`memfilter.runtime.worker`) and the agent runner (`filtered-inputs`,
`memfilter.runtime.agent`). Each gives it a `Handler` that turns a batch of records into the
records to produce, by task; the loop owns everything Kafka, the same for both:

- one plain aiokafka consumer (read_committed, no auto-commit, the range assignor) and a
  transactional producer per *task* (partition p of every input topic), so exactly-once
  holds per task: a task's outputs and its consumed offsets are committed together or not at
  all, and a crash leaves at most an open transaction;
- fencing, so that a dead or stalled process can neither commit nor write after its tasks were
  given to another: each task has its own transactional id (aiokafka's transactional offset
  commits carry no group generation, so one producer per process could not be fenced task by
  task). Given tasks, the loop (1) starts a producer with each task's id, which aborts what the
  last owner left open and fences that owner's producer; (2) lets the handler take them up
  (the worker takes a new Redis owner epoch); (3) only then reads the committed offsets it
  starts from, which no fenced owner can move any more;
- one batch at a time: a batch's transactions are committed while the next batch is fetched
  and before it is handled, and what the fetcher brought meanwhile joins that batch
  (`_top_up`); a rebalance waits for the batch in hand, and a batch fetched
  before an assignment is dropped and fetched again from the committed offsets;
- the committed position is the consumer's (past the transaction markers after the last
  record), so an idle consumer's lag is 0;
- what its committed transactions wrote to the topics it reads is noted by offset
  (`memfilter.runtime.written`), for a handler that reads its own records back (the worker);
- at start, Kafka and the topics are waited for as long as it takes (`problems` says so to
  `/readyz`, a log line every WAIT_LOG_S), so a process started before Kafka works once it answers;
  while running, Kafka is asked for its metadata every WATCH_S: a Kafka that does not answer is
  waited for the same way (aiokafka's clients retry on their own meanwhile);
- tasks lost are taken up again in-process: when a batch's transactions fail (a broker outage
  past the producer's timeout, a producer fenced because the process was paused past its
  session and its tasks went to another) or the handler finds itself fenced
  (`Handler.rejoins_on`: the worker's Redis owner epoch), the loop gives up every task (its
  producers stopped, what was not committed left uncommitted, as after a crash) and rejoins
  the group, with a back-off while it keeps failing. Whoever is given the tasks then, this
  process or another, handles the uncommitted records again from the committed offsets. Not
  ready meanwhile.

Anything else unexpected, in a batch or a rebalance, stops the process (exit 1) rather than
leave it up but idle: an orchestrator restarts it and the group gives its tasks to the others
meanwhile. A handler names the errors it expects to stop on (`Handler.stops_on`), which are
logged as one line rather than a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib.metadata
import itertools
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import mode
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import ConsumerStoppedError, KafkaConnectionError, KafkaError, ProducerFenced
from aiokafka.partitioner import murmur2

from memfilter.metrics import LoopMetrics
from memfilter.runtime.kafka_driver import group_consumer
from memfilter.runtime.records import MAX_RECORD_BYTES, Out
from memfilter.runtime.written import Written
from memfilter.settings import Kafka

log = logging.getLogger("memfilter")

# A consumer's fetches wait at most this long for data (Kafka answers one at once when data comes):
# a quiet partition is fetched again that often. Kafka's default; each empty fetch costs the broker ~1 ms.
FETCH_MAX_WAIT_MS = 500
# The same for a consumer that assigns its partitions itself and seeks only right after it does
# (the gateway's, the relay's stops): a new assignment cancels the fetch in flight, so nothing
# waits on a fetch but data, and only idle polling changes.
ASSIGNED_ONCE_FETCH_MAX_WAIT_MS = 5000
# A task's offsets with no output to commit them with wait this long for its next transaction,
# then are committed alone (`TaskLoop._handle`): what reads the workers' committed offsets (the
# sink) sees them this much later at most, and a busy task commits them with its requests.
QUIET_OFFSETS_S = 1.0
# Waiting for Kafka at start: tried again every WAIT_RETRY_S, said every WAIT_LOG_S.
WAIT_RETRY_S = 1.0
WAIT_LOG_S = 10.0
# While running, Kafka is asked every WATCH_S whether it answers, each time waiting at most that long.
WATCH_S = 5.0
# Rejoining after tasks were lost: at once the first time, then after a back-off doubling up to REJOIN_MAX_S.
REJOIN_MAX_S = 10.0

Batch = dict[TopicPartition, list[Any]]  # aiokafka's ConsumerRecords by partition, in offset order


@dataclass
class Handled:
    """What a handler made of a batch: the records to produce, by task, and what to do once
    they are committed (`done`, run after every task's transaction)."""

    outs: dict[int, list[Out]] = field(default_factory=dict)
    done: Callable[[], Awaitable[None]] | None = None


class Handler(Protocol):
    """What a consumer of the loop does with its records."""

    stops_on: tuple[type[Exception], ...]  # expected reasons to stop: logged as one line
    rejoins_on: tuple[type[Exception], ...]  # its own signs that its tasks went to another: give them up and rejoin

    def describe(self) -> str:
        """What it runs on, for the log line that says it is starting."""
        ...

    def tasks(self, consumer: AIOKafkaConsumer, assigned: set[TopicPartition]) -> list[int]:
        """The tasks (partition numbers) these partitions make; raise to refuse the assignment."""
        ...

    async def take_up(self) -> None:
        """Called once the tasks' producers have fenced their last owners, before the committed
        offsets are read."""
        ...

    async def prepare(self, loop: TaskLoop, batch: Batch, epoch: int) -> None:
        """Called on a fetched batch before it is handled, outside the loop's turn (the worker
        catches up on saves here)."""
        ...

    async def handle(self, batch: Batch) -> Handled: ...


class TaskLoop(mode.Service):
    """Fetch a batch, hand it to the handler, send its outputs, commit; one batch after the other."""

    def __init__(
        self,
        name: str,
        kafka: Kafka,
        group: str,
        topics: list[str],
        handler: Handler,
        metrics: LoopMetrics,
        transactional_id: Callable[[int], str],
        max_records: int,
        start_at_end: bool = False,
        written: Written | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.name = name  # `worker`, `agent`: how its log lines begin
        self.kafka = kafka
        self.group = group
        self.topics = topics
        self.handler = handler
        self.metrics = metrics
        self.transactional_id = transactional_id
        self.max_records = max_records
        self.start_at_end = start_at_end  # a partition with no committed offset starts at its end, not its beginning
        self.written = written  # where its committed transactions' records to its own topics are noted (the worker's)
        self.consumer: AIOKafkaConsumer | None = None
        self.waiting_for: str | None = "Kafka"  # what it waits for before it can work (`_connect`), for `/readyz`
        self.kafka_problem: str | None = None  # once started, a Kafka that does not answer (`_watch`), for `/readyz`
        self._turn = asyncio.Lock()  # held while a batch is handled; a rebalance waits for it
        self.epoch = 0  # partition revocations and assignments so far
        self._delivering: asyncio.Task | None = None  # the previous batch's transactions
        self._producers: dict[int, AIOKafkaProducer] = {}  # task -> its transactional producer: made when tasks are assigned
        self._committed: dict[TopicPartition, int] = {}  # the offsets committed (or started from), by assigned partition
        self._quiet_since: dict[int, float] = {}  # a task's offsets left to commit with no output: since when (`_handle`)
        self._lost: tuple[Exception, int] | None = None  # why the tasks of an epoch were lost, and that epoch: rejoin (`_rejoin`)
        self._failures = 0  # tasks lost since a batch was last committed: the back-off before rejoining

    async def on_start(self) -> None:
        log.info("memfilter %s %s starting: %s", self.name, importlib.metadata.version("memfilter"), self.handler.describe())

    def problems(self) -> list[str]:
        """Why the process is not ready (`/readyz`): what it waits for, or that it has no partitions."""
        if self.waiting_for or self.kafka_problem:
            return [f"waiting for {self.waiting_for or self.kafka_problem}"]
        if self._lost is not None:
            return [f"rejoining the group after losing its tasks ({_reason(self._lost[0])})"]
        return [] if self.assigned else ["no partitions assigned"]

    async def _connect(self) -> None:
        """Start the consumer and subscribe, waiting for Kafka and the topics as long as it takes
        (the process is up but not ready meanwhile), with a line every WAIT_LOG_S saying so."""
        said = -WAIT_LOG_S
        while not self.should_stop:
            consumer = self._consumer()
            try:
                await consumer.start()
                break
            except KafkaConnectionError as e:
                await consumer.stop()
                self.waiting_for = f"Kafka at {self.kafka.bootstrap} ({e})"
                if time.monotonic() - said >= WAIT_LOG_S:
                    log.warning("memfilter %s: waiting for %s", self.name, self.waiting_for)
                    said = time.monotonic()
                await asyncio.sleep(WAIT_RETRY_S)
        else:
            return
        self.consumer = consumer
        self.waiting_for = f"topics {', '.join(self.topics)}"
        await wait_for_topics(consumer, self.topics)
        self.waiting_for = None
        consumer.subscribe(self.topics, listener=Rebalance(self))

    def _consumer(self) -> AIOKafkaConsumer:
        kafka = self.kafka  # made on the process's event loop
        return group_consumer(
            bootstrap_servers=kafka.bootstrap,
            group_id=self.group,
            client_id=f"memfilter-{self.group}",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=MAX_RECORD_BYTES,
            fetch_max_bytes=8 * MAX_RECORD_BYTES,
            session_timeout_ms=int(kafka.session_timeout * 1000),
            heartbeat_interval_ms=int(kafka.session_timeout * 250),
            metadata_max_age_ms=30_000,  # partitions added to a topic are picked up within 30 s
            isolation_level="read_committed",  # records of an aborted transaction are not seen
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
            # Partition p of every input topic to one member: the range assignor lays out each
            # topic's partitions over the same sorted members.
            partition_assignment_strategy=(RangePartitionAssignor,),
        )

    async def on_stop(self) -> None:
        async with self._turn:
            await self._drain_or_give_up()
            await self._stop_producers()
        if self.consumer is not None:
            await self.consumer.stop()

    @mode.Service.task
    async def _watch(self) -> None:
        """Once started, ask Kafka for its metadata every WATCH_S: while it does not answer, say
        so (`/readyz`, a log line every WAIT_LOG_S), and when it answers again."""
        said = -WAIT_LOG_S
        while not self.should_stop:
            await asyncio.sleep(WATCH_S)
            if self.consumer is None:
                continue  # not started yet: `_connect` says what it waits for
            try:
                await asyncio.wait_for(self.consumer.topics(), WATCH_S)
            except (TimeoutError, KafkaError) as e:
                self.kafka_problem = f"Kafka at {self.kafka.bootstrap} ({_reason(e) if str(e) else f'no answer within {WATCH_S:g} s'})"
                if time.monotonic() - said >= WAIT_LOG_S:
                    log.warning("memfilter %s: waiting for %s", self.name, self.kafka_problem)
                    said = time.monotonic()
            else:
                if self.kafka_problem is not None:
                    log.info("memfilter %s: Kafka at %s answers again", self.name, self.kafka.bootstrap)
                    self.kafka_problem, said = None, -WAIT_LOG_S

    @property
    def assigned(self) -> set[TopicPartition]:
        return self.consumer.assignment() if self.consumer is not None else set()

    @mode.Service.task
    async def _run(self) -> None:
        try:
            await self._connect()
            if self.consumer is None:  # stopped while waiting
                return
            while not self.should_stop:
                if self._lost is not None:
                    await self._rejoin()
                epoch = self.epoch
                try:
                    await self._turn_once()
                except (KafkaError, *self.handler.rejoins_on) as e:
                    self.lose(e, epoch)
        except ConsumerStoppedError:
            pass
        except self.handler.stops_on as e:
            log.critical("memfilter %s: %s", self.name, e)
            self.crash_process()
        except Exception:
            log.critical("memfilter %s: stopping on an unexpected error", self.name, exc_info=True)
            self.crash_process()

    async def _turn_once(self) -> None:
        """Fetch a batch, and handle it unless a rebalance came between."""
        assert self.consumer is not None
        batch = await self.consumer.getmany(timeout_ms=int(self.kafka.batch_within * 1000), max_records=self.max_records)
        # Read with no await between: the batch came from the assignment of this epoch.
        epoch = self.epoch
        if batch:
            phase = self.metrics.batch_phase
            fetched = time.time()
            arrived = [records[0].timestamp for tp, records in batch.items() if tp.topic == self.topics[0] and records]
            if arrived:  # records of the first input topic (requests, for the worker): their age
                phase.labels("waiting").observe(max(0.0, fetched - min(arrived) / 1000))
            # The batch before must be committed first: an open transaction of ours
            # holds back the stable offset of what we wrote, and with it any record
            # appended after it. Outside the turn: a fetch in `prepare` waits for a
            # rebalance to end, which waits for the turn.
            await self._drain()
            drained = time.time()
            phase.labels("previous-commit").observe(drained - fetched)
            if (room := self.max_records - sum(map(len, batch.values()))) > 0:
                self._top_up(batch, await self.consumer.getmany(timeout_ms=0, max_records=room), epoch)
            await self.handler.prepare(self, batch, epoch)
            phase.labels("catch-up").observe(time.time() - drained)
        async with self._turn:
            # A rebalance between the fetch and here revoked these records' partitions;
            # whoever holds them now (this process too) fetches them again from the commit.
            if epoch == self.epoch and self._producers and self._lost is None:
                with _collector_paused():
                    await self._handle(batch)

    def lose(self, error: Exception, epoch: int) -> None:
        """The tasks of `epoch` are lost (see the module's header): rejoin before the next fetch."""
        if self._lost is None:
            self._lost = (error, epoch)

    async def _rejoin(self) -> None:
        """Give up every task and rejoin the group: the rebalance that follows gives tasks again
        (to this process or another), each taken up as at any assignment, its uncommitted records
        handled again from the committed offsets. Not needed if a rebalance already came after the
        tasks were lost: they were given up and taken up again then."""
        assert self.consumer is not None and self._lost is not None
        error, epoch = self._lost
        self._failures += 1
        if epoch == self.epoch:
            log.warning(
                "memfilter %s: tasks %s lost (%s); giving them up and rejoining the group: what was not committed is handled again",
                self.name,
                sorted(self._producers),
                _reason(error),
            )
            await self.partitions_revoked()  # as if a rebalance took them
            await asyncio.sleep(min(REJOIN_MAX_S, WAIT_RETRY_S * 2 ** (self._failures - 1)) if self._failures > 1 else 0)
            self.consumer.subscribe(self.topics, listener=Rebalance(self))  # a subscription made anew: aiokafka rejoins
        self._lost = None

    def crash_process(self) -> None:
        # A process that stays up but handles nothing is worse than one that exits: the
        # orchestrator restarts it and the group gives its tasks to the others meanwhile.
        os._exit(1)

    async def _handle(self, batch: Batch) -> None:
        """Handle the batch, then commit its outputs with the consumer's positions: past the
        last record, and past the transaction markers after it (a partition whose last records
        are markers is committed when it moves past them, so an idle consumer's lag is 0).

        A task with nothing to send has only offsets to commit: its records were handled
        with no output (the worker's saves, applied once to Redis whatever happens, or its own
        read back; markers), so handling them again after a crash changes nothing, and there
        is nothing to commit atomically with them. Its offsets go with its next transaction,
        or, after QUIET_OFFSETS_S without one, alone with a plain offset commit. A chat turn
        had four transactions, two of them offsets alone: each is five requests and three
        writes of the transaction log and markers to Kafka. The plain commit carries the
        group's generation, so a fenced member's is refused (and it rejoins, as when a
        transaction fails); Kafka keeps the newer of it and a transaction's offsets committed
        before it."""
        assert self.consumer is not None
        started = time.time()
        handled = await self.handler.handle(batch)
        if batch:
            self.metrics.batch_phase.labels("handling").observe(time.time() - started)
        positions = {tp: await self.consumer.position(tp) for tp in self._committed}
        offsets = {tp: p for tp, p in positions.items() if p > self._committed[tp]}
        now = time.monotonic()
        for task in {tp.partition for tp in offsets} - {task for task, outs in handled.outs.items() if outs}:
            if now - self._quiet_since.setdefault(task, now) < QUIET_OFFSETS_S:  # with the task's next transaction, or later alone
                offsets = {tp: o for tp, o in offsets.items() if tp.partition != task}
        for tp in offsets:
            handled.outs.setdefault(tp.partition, [])
            self._quiet_since.pop(tp.partition, None)
        if offsets or any(handled.outs.values()):
            await self._drain()  # one transaction at a time per producer
            self._delivering = asyncio.create_task(self._deliver(handled, offsets))  # the next fetch meanwhile
        for tp, position in positions.items():
            end = self.consumer.highwater(tp)
            if end is not None:
                self.metrics.lag.labels(tp.topic, str(tp.partition)).set(max(0, end - position))

    async def _deliver(self, handled: Handled, offsets: dict[TopicPartition, int]) -> None:
        """The batch's outputs and offsets: one transaction per task, each on the task's producer."""

        async def transaction(task: int) -> None:
            mine = {tp: o for tp, o in offsets.items() if tp.partition == task}
            if not handled.outs[task]:  # nothing to send: the offsets are all there is, if any (see `_handle`)
                assert self.consumer is not None
                if mine:
                    await self.consumer.commit(mine)
                return
            producer = self._producers[task]
            await producer.begin_transaction()
            sent = await _send(producer, handled.outs[task])
            if mine:
                await producer.send_offsets_to_transaction(mine, self.group)
            await producer.commit_transaction()
            if self.written is not None:
                for tp, first, count in sent:
                    if tp.topic in self.topics:
                        self.written.add(tp, first, count)

        started = time.time()
        await _all([transaction(task) for task in handled.outs])
        self.metrics.batch_phase.labels("committing").observe(time.time() - started)
        self._failures = 0
        self._committed.update(offsets)
        if self.written is not None:
            self.written.consumed(offsets)
        if handled.done is not None:
            await handled.done()

    async def partitions_revoked(self) -> None:
        """Partitions leave only after the batch in hand is delivered and committed (or failed:
        then it is left to the next owner)."""
        async with self._turn:
            await self._drain_or_give_up()
            await self._stop_producers()
            self._committed = {}
            self._quiet_since = {}
            if self.written is not None:
                self.written.clear()
            self.epoch += 1
        self.metrics.lag.clear()
        self.metrics.assigned.set(0)

    async def partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """Take up the assigned tasks (see the module's header)."""
        assert self.consumer is not None
        self.metrics.assigned.set(len(assigned))
        if not assigned:
            log.info("memfilter %s ready: no tasks for now (the group has more members than partitions)", self.name)
            return
        tasks = self.handler.tasks(self.consumer, assigned)
        async with self._turn:
            self._producers = {task: self._transactional(task) for task in tasks}
            await asyncio.gather(*(p.start() for p in self._producers.values()))
            await self.handler.take_up()
            self._committed = await seek_to_committed(self.consumer, assigned, self.start_at_end)
            self.epoch += 1  # a batch fetched before the seek is dropped (`_run`): it is fetched again from here
        log.info("memfilter %s ready: %d tasks %s (%d partitions of %s)", self.name, len(tasks), tasks, len(assigned), " and ".join(self.topics))

    def _transactional(self, task: int) -> AIOKafkaProducer:
        return AIOKafkaProducer(
            bootstrap_servers=self.kafka.bootstrap,
            client_id=f"memfilter-{self.group}",
            transactional_id=self.transactional_id(task),
            acks="all",
            linger_ms=0,  # batches are built whole (`_send`) and sent at once
            max_batch_size=1 << 20,
            max_request_size=MAX_RECORD_BYTES,
        )

    async def _stop_producers(self) -> None:
        """Stop the tasks' producers; one that fails to stop (its broker gone, say) is dropped
        all the same: a transaction it left open is aborted by the task's next producer."""
        producers, self._producers = self._producers, {}
        for result in await asyncio.gather(*(p.stop() for p in producers.values()), return_exceptions=True):
            if isinstance(result, Exception) and not isinstance(result, ProducerFenced):  # fenced: expected, said already
                log.warning("memfilter %s: a producer did not stop cleanly (%s)", self.name, _reason(result))

    def _top_up(self, batch: Batch, more: Batch, epoch: int) -> None:
        """Add to the batch what the fetcher brought while the previous batch was committed
        (up to the batch's limit, MEMFILTER_BATCH_MAX). aiokafka fetches a partition again only
        once its buffered records are taken, so the records of a fetch wait in its buffer for
        the next batch: without this, a request waits about two batches before it is handled
        rather than one. Before the handler's `prepare`: the worker's catch-up then waits for
        the saves committed before these requests too. Records fetched after a rebalance (the
        batch is then dropped) are handed back: the partitions are sought back to them."""
        assert self.consumer is not None
        for tp, records in more.items():
            if not records:
                continue
            if epoch != self.epoch:
                self.consumer.seek(tp, records[0].offset)
            else:
                batch.setdefault(tp, []).extend(records)

    async def _drain(self) -> None:
        """Wait for the previous batch's transactions; they raise if they failed (`_run` then rejoins)."""
        if self._delivering is not None:
            try:
                await self._delivering  # several may wait for it (the loop, a rebalance)
            finally:
                self._delivering = None

    async def _drain_or_give_up(self) -> None:
        """Wait for the previous batch's transactions as tasks leave: if they failed, what they
        did not commit is left to the tasks' next owner, as after a crash."""
        try:
            await self._drain()
        except KafkaError as e:
            log.warning(
                "memfilter %s: the last batch's commit failed as its tasks leave (%s): tasks lost, what it did not commit is left to their next owner; rejoining the group",
                self.name,
                _reason(e),
            )


def _reason(error: Exception) -> str:
    name, text = type(error).__name__, str(error)
    return text if text.startswith(name) else f"{name}: {text}" if text else name


async def _all(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Wait for all of them, then raise the first failure, or return their results: each
    failure is retrieved (a fenced producer fails every send of its transaction), none is left
    to asyncio's 'exception was never retrieved'."""
    results = await asyncio.gather(*awaitables, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


@functools.lru_cache(maxsize=1 << 16)
def key_hash(key: bytes) -> int:
    """murmur2 of a record key, as Kafka's default partitioner takes it: aiokafka's is pure
    Python, ~2 µs for a thread id, and a thread's key recurs from batch to batch."""
    return murmur2(key) & 0x7FFFFFFF


async def _send(producer: AIOKafkaProducer, outs: list[Out]) -> list[tuple[TopicPartition, int, int]]:
    """Send the records a batch per topic partition, in their order: the producer's
    per-record `send` costs ~8 µs of Python each, appending to a batch ~1. Partitions are
    chosen as `send` chooses them (murmur2 of the key, as Java clients do). Once the broker
    has every batch: where each went, as (partition, its first record's offset, its records)."""
    partitions = {topic: sorted(await producer.partitions_for(topic)) for topic in {o.topic for o in outs}}
    by_partition: dict[tuple[str, int], list[Out]] = {}
    for out in outs:
        candidates = partitions[out.topic]
        partition = random.choice(candidates) if out.key is None else candidates[key_hash(out.key) % len(candidates)]
        by_partition.setdefault((out.topic, partition), []).append(out)
    sends = []
    for (topic, partition), group in by_partition.items():
        batch = producer.create_batch()
        for out in group:
            while batch.append(key=out.key, value=out.value, timestamp=out.timestamp_ms, headers=list(out.headers)) is None:
                sends.append((await producer.send_batch(batch, topic, partition=partition), batch.record_count()))  # full: the next one
                batch = producer.create_batch()
        sends.append((await producer.send_batch(batch, topic, partition=partition), batch.record_count()))
    sent = await _all([future for future, _ in sends])
    return [(meta.topic_partition, meta.offset, count) for meta, (_, count) in zip(sent, sends)]


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
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


async def wait_for_topics(consumer: AIOKafkaConsumer, topics: Sequence[str]) -> None:
    """Subscribing to a topic the broker does not yet know would leave it unassigned."""
    for attempt in itertools.count():
        missing = set(topics) - await consumer.topics()
        if not missing:
            return
        if attempt % 20 == 0:
            log.warning("waiting for topics %s: create them (`memfilter stack up` does)", ", ".join(sorted(missing)))
        await asyncio.sleep(0.5)


async def seek_to_committed(consumer: AIOKafkaConsumer, assigned: set[TopicPartition], at_end: bool = False) -> dict[TopicPartition, int]:
    """Start every assigned partition again from its committed offset (if none, its beginning,
    or with `at_end` its end, which is then committed so that a restart starts there too), all
    at once after the last await, so that no batch fetched from a partition already moved back
    is taken for one fetched after (the caller then drops batches fetched before: they are
    fetched again from here); the offsets started from."""
    tps = sorted(assigned)
    committed = dict(zip(tps, await asyncio.gather(*(consumer.committed(tp) for tp in tps))))
    never = [tp for tp, offset in committed.items() if offset is None]
    firsts = (await consumer.end_offsets(never) if at_end else await consumer.beginning_offsets(never)) if never else {}
    if never:  # said, so that a group that had offsets and lost them (docs/delivery.md, seed 17) shows when
        log.warning(
            "no committed offset for %s: starting %s at %s %s",
            ", ".join(f"{tp.topic}-{tp.partition}" for tp in never),
            *(("them", "their") if len(never) > 1 else ("it", "its")),
            "end" if at_end else "beginning",
        )
    if at_end and firsts:
        await consumer.commit(firsts)
    starts = {tp: firsts[tp] if offset is None else offset for tp, offset in committed.items()}
    for tp, offset in starts.items():
        consumer.seek(tp, offset)
    return starts


class Rebalance(ConsumerRebalanceListener):
    """Tells the loop when partitions leave and arrive. aiokafka only logs a listener's error
    and goes on, so a failure here (the batch in hand's transaction, a producer that cannot
    start: does the broker allow transactions?) stops the process instead."""

    def __init__(self, loop: TaskLoop):
        self.loop = loop

    async def on_partitions_revoked(self, revoked) -> None:
        await self._or_stop(self.loop.partitions_revoked())

    async def on_partitions_assigned(self, assigned) -> None:
        await self._or_stop(self.loop.partitions_assigned(set(assigned)))

    async def _or_stop(self, step: Awaitable[None]) -> None:
        epoch = self.loop.epoch
        try:
            await step
        except (KafkaError, *self.loop.handler.rejoins_on) as e:  # a producer that cannot start in an outage, say
            self.loop.lose(e, epoch)
        except self.loop.handler.stops_on as e:
            log.critical("memfilter %s: %s", self.loop.name, e)
            self.loop.crash_process()
        except Exception:
            log.critical("memfilter %s: stopping on an unexpected error in a rebalance", self.loop.name, exc_info=True)
            self.loop.crash_process()

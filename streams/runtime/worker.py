"""`memfilter worker`: consumes `chat-requests` and `persist-messages`, on the task loop.

Faust hosts the worker: its lifecycle, signals, logging and web server
(`memfilter.runtime.health`). The records themselves flow through the transactional task loop
(`memfilter.runtime.loop`: one plain aiokafka consumer and a transactional producer per task),
not through Faust's per-event streams: measured, Faust's stream path cost more per event than
the whole filter decision, and on a large backlog it stopped fetching with nothing logged.
This module is the worker's `Handler` of that loop.

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
   save, record) and other services' events to the `Persister` (the processor's own events
   are already saved: this process's known by their offsets, `memfilter.runtime.written`,
   the others' by their signatures, `memfilter.core.origin`);
3. send what they return (to `filtered-inputs`, `persist-messages` and the dead-letter topic,
   a producer batch per partition) and the batch's offsets: a transaction per task, committed
   while the next batch is fetched and before it is decided.

So a writer's save that was acknowledged before a client sent its next request (the agent's
reply, say) is applied before that request, provided both are keyed by the thread id and the
writers' clocks agree to within the time between the two.

Outputs are exactly once for `read_committed` consumers: the loop commits a task's outputs
and its offsets together or not at all, and a crash leaves at most an open transaction, which
is aborted when the task's transactional id is taken up again; the records are then consumed
again. Redis is outside the transaction: the processor's record of processed
requests makes the second pass emit the same bytes without deciding again, and a save is
applied once (`memfilter.runtime.persister`). A Redis outage stalls the batch, retried until Redis
answers. A worker fenced after a pause (by Kafka, or by a newer owner epoch in Redis) gives up
its tasks and rejoins the group (`memfilter.runtime.loop`); anything unexpected stops it
(exit 1) rather than leave it up but idle.

Fencing: the loop fences the producers of a task's last owner; the worker then takes a new
Redis owner epoch (`take_up`), which fences that owner's Redis writes (`memfilter.store`),
before the loop reads the committed offsets it starts from.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time

import faust
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from memfilter.core import origin
from memfilter.core.filter import Rejection
from memfilter.metrics import Metrics
from memfilter.runtime.health import serve_health
from memfilter.runtime.loop import Batch, Handled, TaskLoop
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Out, Record, dead_letter
from memfilter.runtime.turns import SWEEP_S, Turns
from memfilter.runtime.written import Written
from memfilter.settings import Settings, Topics, without_password
from memfilter.store.cold import Warmer
from memfilter.store.history import Fenced, HistoryStore
from memfilter.store.memory import WorkingMemories
from memfilter.store.redis_driver import TIMEOUT_S, connect

log = logging.getLogger("memfilter")


def transactional_id(group: str, task: int) -> str:
    """The transactional id of a worker's task (`memfilter.runtime.loop`: fencing)."""
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


class CoPartitioning(Exception):
    """The two input topics cannot be consumed co-partitioned."""


# How long a batch waits at most for `persist-messages` records that were committed before its
# requests were fetched but are not in hand yet, checking every CATCH_UP_POLL_MS (`prepare`).
CATCH_UP_S = 1.0
CATCH_UP_POLL_MS = 10


class WorkerHandler:
    """The worker's part of the task loop: requests to the processor, saves to the persister."""

    stops_on: tuple[type[Exception], ...] = (CoPartitioning,)
    rejoins_on: tuple[type[Exception], ...] = (Fenced,)

    def __init__(self, settings: Settings, store: HistoryStore, metrics: Metrics, written: Written):
        self.settings = settings
        self.written = written  # the loop's note of what its transactions wrote: this process's own persist events
        self.topics = settings.topics
        self.metrics = metrics
        self.store = store
        memories = WorkingMemories.of(settings.working_memory, store)
        self.processor = Processor(
            store, settings.topics, settings.policy, metrics, settings.secret, filtered_format=settings.worker.filtered_format, memories=memories
        )
        self.persister = Persister(store, settings.topics.dlq, settings.secret, memories)
        self.turns = Turns(store, settings.topics, settings.secret, settings.policy.turn_wait_ms, metrics)
        self.partitions: list[int] = []  # the tasks assigned (`tasks`): the sweep's
        self.swept = 0.0  # when the sweep last ran (monotonic)

    def describe(self) -> str:
        s = self.settings
        return f"group {s.worker.group}, Kafka {s.kafka.bootstrap}, Redis {without_password(s.redis.url)}, web http://{s.worker.web_bind}:{s.worker.web_port}"

    def tasks(self, consumer: AIOKafkaConsumer, assigned: set[TopicPartition]) -> list[int]:
        """The tasks assigned: the partition numbers, the same for both topics."""
        topics, group = self.topics, self.settings.worker.group
        counts = {t: len(consumer.partitions_for_topic(t) or ()) for t in (topics.requests, topics.persist)}
        if counts[topics.requests] != counts[topics.persist]:
            raise CoPartitioning(
                f"{topics.requests} has {counts[topics.requests]} partitions and {topics.persist} {counts[topics.persist]}; "
                "a thread's requests and saves must be read by one worker: give both topics the same number of partitions"
            )
        by_topic = {t: sorted(tp.partition for tp in assigned if tp.topic == t) for t in (topics.requests, topics.persist)}
        if by_topic[topics.requests] != by_topic[topics.persist]:
            raise CoPartitioning(
                f"assigned {topics.requests} partitions {by_topic[topics.requests]} but {topics.persist} partitions "
                f"{by_topic[topics.persist]}: every worker of group {group} must use the range assignor"
            )
        self.partitions = by_topic[topics.requests]
        return self.partitions

    async def take_up(self) -> None:
        """A new owner epoch for Redis writes: fences the last owners' (`memfilter.store`)."""
        await _with_redis_retry("taking an owner epoch", self.store.take_epoch)

    async def handle(self, batch: Batch) -> Handled:
        """Decide and apply the batch; once its outputs are committed, drop the records of its
        processed requests from Redis, as no re-delivery needs them any more."""
        self.metrics.batch_size.observe(sum(len(rs) for rs in batch.values()))
        outs, requests, recorded = await _with_redis_retry("handling a batch", lambda: self._decide_and_apply(batch))
        for task_outs in outs.values():
            for out in task_outs:
                if out.topic == self.topics.dlq:
                    error_type = next((v for k, v in out.headers if k == "error.type"), b"")
                    self.metrics.dead_letters.labels(error_type.decode()).inc()

        async def done() -> None:
            try:
                await self.store.drop_records(recorded)
            except (RedisConnectionError, RedisTimeoutError, OSError) as e:
                log.warning("Redis unavailable while dropping %d committed records (%s); they expire after MEMFILTER_PROCESSED_TTL", len(recorded), e)
            now_ms = time.time() * 1000
            for r in requests:
                self.metrics.end_to_end.observe(max(0.0, now_ms - r.timestamp_ms) / 1000)

        return Handled(outs, done)

    async def _decide_and_apply(self, batch: Batch) -> tuple[dict[int, list[Out]], list[Record], list[tuple[str, bytes]]]:
        """The batch's outputs by task, its requests, and the records to drop once it is
        committed (`Decided.recorded`): requests decided and saves applied in
        the order they were appended, then every Redis write of the batch on its replicas
        (`Transport.replicate`). A Redis failure anywhere has the whole batch handled again:
        what was written is found then (requests by their records, saves by their identity).
        With them, the wakes of the threads whose waiting requests' turn came in the batch, and
        every SWEEP_S those the sweep finds due (`memfilter.runtime.turns`)."""
        outs: dict[int, list[Out]] = {tp.partition: [] for tp in batch}  # by task
        requests: list[Record] = []
        recorded: list[tuple[str, bytes]] = []
        waits: dict[str, tuple[int, int | None]] = {}
        due: dict[str, int] = {}  # thread -> partition: its first waiting request's turn may have come
        for phase_requests, phase_persisted in in_order(batch, self.topics, self.settings.secret, self.written):
            if phase_requests:
                decided = await self.processor.decide_batch(phase_requests)
                for record, record_outs in zip(phase_requests, decided.outs):
                    outs[record.partition] += record_outs
                recorded += decided.recorded
                waits |= decided.waits
            if phase_persisted:
                ended: set[str] = set()
                results = await self.persister.apply(phase_persisted, ended)
                for record, result in zip(phase_persisted, results):
                    if isinstance(result, Rejection):
                        outs[record.partition].append(dead_letter(record, self.topics.dlq, result))
                    elif (thread := (record.key or b"").decode(errors="replace")) in ended:
                        due[thread] = record.partition
                self.metrics.persisted.inc(sum(1 for r in results if not isinstance(r, Rejection)))
            requests += phase_requests
        now = time.time()
        await self.turns.index(waits)
        due |= {thread: partition for thread, (partition, at) in waits.items() if at == 0}
        woken = [await self.turns.wake(due, int(now * 1000))]
        if time.monotonic() - self.swept >= SWEEP_S:
            self.swept = time.monotonic()
            woken.append(await self.turns.sweep(self.partitions, int(now * 1000)))
        for wakes in woken:
            for task, task_outs in wakes.items():
                outs.setdefault(task, []).extend(task_outs)
        await self.store.transport.replicate()
        return outs, requests, recorded

    async def prepare(self, loop: TaskLoop, batch: Batch, epoch: int) -> None:
        """Bring into the batch every `persist-messages` record of its requests' tasks that was
        committed before the requests were fetched: a reply acknowledged before a request was
        sent is then decided before it, whatever the order in which the fetcher brought the two
        partitions. A task's save partition is caught up once a fetch of it answered after its
        request partition's last one (the fetcher has one fetch in flight per broker, so that
        fetch saw the log when the requests were already in it) and everything below the log's
        end that fetch reported is stable and consumed (`_caught_up`). Waits at most
        CATCH_UP_S: a task not caught up by then is taken out of the batch whole (both
        partitions sought back to its first records), to be fetched and decided in order with
        the next one, never decided without the saves before its requests. Stops if a rebalance
        takes the partitions away (the loop then drops the batch). A rebalance can run inside
        a fetch here, which then returns records from the new assignment's positions: those are
        handed back (the partitions are sought back to them), or dropping the batch would lose
        them."""
        topics, consumer = self.topics, loop.consumer
        assert consumer is not None
        try:
            since = {}  # save partition -> the last fetch time of its request partition
            for task in {tp.partition for tp in batch if tp.topic == topics.requests}:
                tp, requests_tp = TopicPartition(topics.persist, task), TopicPartition(topics.requests, task)
                if not {tp, requests_tp} <= consumer.assignment():
                    return
                since[tp] = consumer.last_poll_timestamp(requests_tp) or 0
            deadline = time.monotonic() + CATCH_UP_S
            ends: dict[TopicPartition, int] = {}  # save partition -> its log's end when first fetched after its requests
            while since and time.monotonic() < deadline:
                since = {tp: t for tp, t in since.items() if not await _caught_up(consumer, tp, t, ends)}
                if since:
                    more = await consumer.getmany(*since, timeout_ms=CATCH_UP_POLL_MS, max_records=self.settings.kafka.batch_max)
                    if epoch != loop.epoch:
                        for tp, records in more.items():
                            if records:
                                consumer.seek(tp, records[0].offset)
                        return
                    for tp, records in more.items():
                        batch.setdefault(tp, []).extend(records)
            for tp in since:  # not caught up in time: the task waits for the next batch rather than be decided out of order
                for task_tp in (TopicPartition(topics.requests, tp.partition), tp):
                    if records := batch.pop(task_tp, None):
                        consumer.seek(task_tp, records[0].offset)
            if since:
                log.warning(
                    "persist-messages of tasks %s not caught up within %s s: their records wait for the next batch",
                    sorted(tp.partition for tp in since),
                    CATCH_UP_S,
                )
        except IllegalStateError:  # no longer assigned
            return


async def _caught_up(consumer: AIOKafkaConsumer, tp: TopicPartition, since: int, ends: dict[TopicPartition, int]) -> bool:
    """Is the save partition `tp` consumed up to where its log ended when a fetch first
    answered at or after `since` (kept in `ends`), and is all of that stable? A transaction
    committed before a request was sent can still hold back the stable offset for a moment
    (Kafka writes its commit markers after the commit returns), with saves beyond it: consumed
    only up to the stable offset, they would be decided after the request."""
    if tp not in consumer.assignment():  # revoked meanwhile (aiokafka asserts, below): nothing to wait for
        return True
    polled, stable = consumer.last_poll_timestamp(tp), consumer.last_stable_offset(tp)
    if polled is None or polled < since or stable is None:
        return False
    end = ends.setdefault(tp, consumer.highwater(tp) or 0)
    return stable >= end and await consumer.position(tp) >= end


def in_order(batch: dict[TopicPartition, list], topics: Topics, secret: bytes, written: Written) -> list[tuple[list[Record], list[Record]]]:
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
        saves = TopicPartition(topics.persist, task)
        persisted = [
            (Record.of(r), False)
            for r in batch.get(saves, ())
            # the processor's own are saved already: this process's by their offsets, the others' by their signatures
            if not written.holds(saves, r.offset) and not origin.is_processors(r.value, r.headers, secret)
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


def create_app(settings: Settings) -> faust.App:
    client = connect(settings.redis.url)
    metrics = Metrics()
    r = settings.redis
    budget = settings.policy.budget  # with one, every row saved gets its token count beside it
    store = HistoryStore(
        client,
        r.prefix,
        metrics,
        settings.worker.processed_ttl,
        settings.worker.retry_window,
        r.replicas,
        r.replica_timeout,
        budget.counter if budget is not None else None,
        Warmer.of(settings),
    )
    topics = [settings.topics.requests, settings.topics.persist]
    group = settings.worker.group
    written = Written()
    loop = TaskLoop(
        "worker",
        settings.kafka,
        group,
        topics,
        WorkerHandler(settings, store, metrics, written),
        metrics,
        lambda task: transactional_id(group, task),
        settings.kafka.batch_max,
        written=written,
    )
    app = serve_health(group, settings, settings.worker.data_dir, settings.worker.web_port, metrics, loop.problems, client)
    app.add_dependency(loop)
    return app

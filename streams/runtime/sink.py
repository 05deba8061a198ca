"""The sink: `persist-messages` into PostgreSQL, and idle threads out of Redis.

`memfilter sink` (one or more, one consumer group: MEMFILTER_SINK_GROUP) consumes
`persist-messages`, the history's log. For a batch of events it waits until the workers have
applied them (their group's committed offsets on `persist-messages` are past the batch: the
worker applies each event, or skips its own, in the transaction that commits that offset),
then writes each thread the batch names to PostgreSQL whole, as Redis holds it now
(`memfilter.store.cold.whole`, `PostgresHistory.write`), and commits its own offsets. A thread
is written only over an older version of itself: an event consumed again (a crash before the
commit, a second sink) changes nothing, and PostgreSQL holds every thread as of the log.

Every MEMFILTER_IDLE_S / 10 seconds (a minute at most) it takes threads unused for MEMFILTER_IDLE_S out
of Redis (`memfilter.store.cold.evict`), each only at the version PostgreSQL holds.

PostgreSQL down or slow: the batch is written again until it is (its offsets are not
committed before), eviction pauses, and the workers go on deciding threads in Redis. Nothing
the sink does is on a worker's path. PostgreSQL refusing a thread's data (a row it cannot hold,
`memfilter.store.postgres.Refused`) is a data error of that thread, not an outage: it is logged
with the thread and the reason and counted, the other threads are written, and the thread stays
in Redis (eviction takes only what PostgreSQL holds).

Its web server (`serve`: MEMFILTER_WEB_BIND, MEMFILTER_SINK_WEB_PORT) answers `/healthz`,
`/readyz` (not ready while the consumer has not started or an outage holds a write, an
eviction or the reading of the workers' committed offsets back, naming it) and `/metrics` (`memfilter.metrics.SinkMetrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import CommitFailedError, KafkaError, KafkaTimeoutError

from memfilter.metrics import SinkMetrics
from memfilter.runtime.kafka_driver import group_consumer
from memfilter.settings import Settings
from memfilter.store import cold
from memfilter.store.history import HistoryStore
from memfilter.store.postgres import PostgresHistory, Unavailable
from memfilter.store.redis_driver import connect
from memfilter.store.transport import UNAVAILABLE

log = logging.getLogger("memfilter.sink")
RETRY_S = 1.0  # seconds between tries while PostgreSQL or Redis does not answer
BEHIND_S = 30.0  # seconds a batch waits for the group before it applied it, before `/readyz` says so


class Sink:
    def __init__(self, settings: Settings, batch_max: int = 1000):
        self.settings = settings
        self.store = HistoryStore(connect(settings.redis.url), settings.redis.prefix)
        self.pg = PostgresHistory(settings.postgres.url, settings.redis.prefix, settings.postgres.timeout)
        self.batch_max = batch_max
        self.metrics = SinkMetrics()
        self.problem: str | None = "starting"  # why it is not ready (`/readyz`); None when it is
        self._next_eviction = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        consumer, admin = await follow_log(s, s.postgres.sink_group, "memfilter-sink")
        self.problem = None
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=500, max_records=self.batch_max)
                if batch:
                    ends = {tp: records[-1].offset + 1 for tp, records in batch.items()}
                    written_ms: dict[str, int] = {}
                    for records in batch.values():
                        for r in records:
                            if r.key is not None:
                                thread = r.key.decode(errors="replace")
                                written_ms[thread] = max(written_ms.get(thread, 0), r.timestamp)
                    await self._applied(admin, ends, stop)
                    await self._write(written_ms, stop)
                    if stop.is_set():
                        break
                    # The group may have moved the partitions on (this sink paused or cut off past its
                    # session): whoever holds them now reads these records again, and writing a thread
                    # again changes nothing.
                    try:
                        await consumer.commit(ends)
                    except CommitFailedError as e:
                        log.warning("memfilter sink: offsets not committed, the group rebalanced: %s; their records are read again", e)
                await self._evict()
        finally:
            await consumer.stop()
            await admin.close()
            await self.pg.close()
            await self.store.redis.aclose()

    async def _applied(self, admin: AIOKafkaAdminClient, ends: dict[TopicPartition, int], stop: asyncio.Event) -> None:
        await applied(admin, self.settings.worker.group, ends, stop, self._outage, "memfilter sink")

    async def _write(self, written_ms: dict[str, int], stop: asyncio.Event) -> None:
        """The threads, as Redis holds them, into PostgreSQL; tried again until both answer."""
        while not stop.is_set():
            try:
                threads = await cold.whole(self.store, sorted(written_ms), written_ms)
                written, refused = await self.pg.write(threads)
                self.metrics.written.inc(written)
                for thread, why in refused.items():  # a data error of one thread: reported, never retried for ever
                    log.warning("memfilter sink: thread %r stays in Redis alone (not evicted): %s", thread, why)
                    self.metrics.refused.inc()
                self.problem = None
                return
            except (Unavailable, OSError, *UNAVAILABLE) as e:
                log.warning("memfilter sink: %s; writing %d threads again in %.0f s", e, len(written_ms), RETRY_S)
                self._outage(f"writing threads: {e}")
                await asyncio.sleep(RETRY_S)

    async def _evict(self) -> None:
        """Idle threads out of Redis, every tenth of MEMFILTER_IDLE_S (a minute at most); paused while PostgreSQL does not answer."""
        now = time.time()
        if now < self._next_eviction:
            return
        idle = self.settings.postgres.idle_s
        self._next_eviction = now + min(idle / 10, 60.0)
        try:
            while (left := await cold.evict(self.store, self.pg, int((now - idle) * 1000))) > 0:
                self.metrics.evicted.inc(left)
            self.problem = None
        except (Unavailable, OSError, *UNAVAILABLE) as e:
            log.warning("memfilter sink: eviction paused: %s", e)
            self._outage(f"evicting: {e}")

    def _outage(self, what: str) -> None:
        self.problem = what
        self.metrics.retries.inc()


async def follow_log(settings: Settings, group: str, client_id: str) -> tuple[AIOKafkaConsumer, AIOKafkaAdminClient]:
    """A consumer of `persist-messages` in `group`, from its beginning for a new group, of
    committed records only, committing its offsets itself; and an admin client, to ask how far
    another group has come (`applied`). Both started."""
    consumer = group_consumer(
        settings.topics.persist,
        bootstrap_servers=settings.kafka.bootstrap,
        group_id=group,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap)
    await consumer.start()
    await admin.start()
    return consumer, admin


async def applied(
    admin: AIOKafkaAdminClient, group: str, ends: dict[TopicPartition, int], stop: asyncio.Event, outage, who: str, patience: float = BEHIND_S
) -> None:
    """Until `group` has committed past `ends` on every partition of it (the workers' group
    for the sink, the sink's for the embedder). A broker that does not answer (down, moving its
    groups, cut off) is waited out, named, and `outage` told why; so is a group that has not
    come past them within `patience` seconds (not running, or under another name)."""
    since = time.monotonic()
    while not stop.is_set():
        try:
            committed = await admin.list_consumer_group_offsets(group, partitions=list(ends))
        except KafkaError as e:
            if not (e.retriable or isinstance(e, KafkaTimeoutError)):
                raise
            log.warning("%s: Kafka did not give group %s's committed offsets: %r; asking again in %.0f s", who, group, e, RETRY_S)
            outage(f"reading group {group}'s committed offsets: {e!r}")
            await asyncio.sleep(RETRY_S)
            continue
        if all(tp in committed and committed[tp].offset >= end for tp, end in ends.items()):
            return
        if time.monotonic() - since > patience:
            why = f"group {group} has not committed past this batch of {', '.join(sorted({tp.topic for tp in ends}))} for {patience:g} s: is it running, under that name?"
            log.warning("%s: %s", who, why)
            outage(why)
            since = time.monotonic()
        await asyncio.sleep(0.2)


async def serve(sink: Sink | Any, bind: str, port: int) -> web.AppRunner:
    """The web server of the sink (or of another consumer with a `problem` and `metrics`: the
    embedder), listening: `/healthz`, `/readyz`, `/metrics`. Cleaned up by the caller."""

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(request: web.Request) -> web.Response:
        if sink.problem is not None:
            return web.Response(text=f"not ready: {sink.problem}\n", status=503)
        return web.Response(text="ready\n")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=sink.metrics.render(), content_type="text/plain")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, bind, port).start()
    return runner

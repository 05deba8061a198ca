"""The embedder: saved messages into recall's vectors, off the request path.

`memfilter embedder` (one or more, one consumer group: MEMFILTER_EMBEDDER_GROUP) consumes
`persist-messages`, as the sink does. For a batch of events it waits until the sink's group has
committed past it (the sink waits for the workers: PostgreSQL then holds the threads as those
events left them), then:

1. reads from PostgreSQL the messages the events name that are in their thread's conversation
   (`MessageVectors.saved`): what the workers refused (another resource's thread, an erased
   one) is not there, and a message is kept under its thread's owner, whatever an event says;
2. embeds their text (`memfilter.core.recall.embedded_text`, as Mastra's) at the embeddings
   endpoint, and keeps each vector (`MessageVectors.put`: again, it replaces);
3. takes out the vectors of the named threads' messages that left the conversation
   (`MessageVectors.prune`: an erasure, a regenerate or an edit);

and commits its offsets. An event consumed again (a crash before the commit) changes nothing.
Imported threads are embedded like any: their import is events on `persist-messages`.

An outage (Kafka, PostgreSQL, the endpoint) holds the batch, which is tried again until it
goes through; recall meanwhile finds what was embedded before. A text the endpoint refuses is
a data error of that message alone: logged, counted (`memfilter_embedder_refused_total`),
not recalled; the rest go on.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiokafka.errors import CommitFailedError

from memfilter.core.recall import embedded_text
from memfilter.metrics import EmbedderMetrics
from memfilter.runtime.embeddings import Embeddings
from memfilter.runtime.sink import RETRY_S, applied, follow_log
from memfilter.schemas.wire import Id
from memfilter.settings import Settings
from memfilter.store.postgres import Refused, Unavailable
from memfilter.store.vectors import MessageVectors, Vector

log = logging.getLogger("memfilter.embedder")


class _Id(msgspec.Struct):
    id: Id | None = None


class _Named(msgspec.Struct):
    """What the embedder reads of an event: its thread and the ids of its rows, ids as the
    workers take them (an event with another is refused there: PostgreSQL holds nothing of it)."""

    threadId: Id
    messages: list[_Id] = []


_NAMED = msgspec.json.Decoder(_Named)


def named(values: list[bytes | None]) -> tuple[list[tuple[str, str]], list[str]]:
    """The (thread, message id) pairs the events name, and their threads; a value that is not
    an event names nothing (the workers dead-letter it; PostgreSQL holds nothing of it)."""
    pairs: dict[tuple[str, str], None] = {}
    threads: dict[str, None] = {}
    for value in values:
        try:
            event = _NAMED.decode(value or b"")
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue
        threads[event.threadId] = None
        pairs.update(((event.threadId, m.id), None) for m in event.messages if m.id)
    return list(pairs), list(threads)


class Embedder:
    def __init__(self, settings: Settings, batch_max: int = 500):
        self.settings = settings
        self.vectors = MessageVectors(settings.postgres.url, settings.redis.prefix, settings.postgres.timeout)
        self.embeddings = Embeddings(settings.recall, settings.agent.openai_api_key)
        self.batch_max = batch_max
        self.metrics = EmbedderMetrics()
        self.outage: str | None = "starting"

    @property
    def problem(self) -> str | None:
        """Why it is not ready (`/readyz`); None when it is."""
        return self.outage or self.embeddings.problem

    async def run(self, stop: asyncio.Event) -> None:
        s = self.settings
        consumer, admin = await follow_log(s, s.recall.group, "memfilter-embedder")
        self.outage = None
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=500, max_records=self.batch_max)
                if not batch:
                    continue
                ends = {tp: records[-1].offset + 1 for tp, records in batch.items()}
                await applied(admin, s.postgres.sink_group, ends, stop, self._outage, "memfilter embedder")
                await self._embed(*named([r.value for records in batch.values() for r in records]), stop)
                if stop.is_set():
                    break
                try:
                    await consumer.commit(ends)
                except CommitFailedError as e:
                    log.warning("memfilter embedder: offsets not committed, the group rebalanced: %s; their records are read again", e)
        finally:
            await consumer.stop()
            await admin.close()
            await self.vectors.close()
            await self.embeddings.close()

    async def _embed(self, pairs: list[tuple[str, str]], threads: list[str], stop: asyncio.Event) -> None:
        """The named messages' vectors kept, the threads' stale ones taken out; tried again
        until PostgreSQL answers."""
        model = self.settings.recall.model
        while not stop.is_set():
            try:
                saved = [(owner, thread, mid, text) for owner, thread, mid, row in await self.vectors.saved(pairs) if (text := embedded_text(row))]
                made = await self.embeddings.embed([text for *_, text in saved])
                kept = await self._put([Vector(model, owner, thread, mid, v) for (owner, thread, mid, _), v in zip(saved, made) if v is not None])
                await self.vectors.prune(threads)
                self.metrics.embedded.inc(kept)
                self.metrics.refused.inc(len(made) - kept)
                self.outage = None
                return
            except (Unavailable, OSError) as e:
                log.warning("memfilter embedder: %s; embedding %d messages again in %.0f s", e, len(pairs), RETRY_S)
                self._outage(f"keeping vectors: {e}")
                await asyncio.sleep(RETRY_S)

    async def _put(self, vectors: list[Vector]) -> int:
        """Keep the vectors; those PostgreSQL refuses for their data (a vector of NaNs, say),
        each alone, are logged and left out. How many were kept."""
        try:
            await self.vectors.put(vectors)
            return len(vectors)
        except Refused:
            kept = 0
            for v in vectors:
                try:
                    await self.vectors.put([v])
                    kept += 1
                except Refused as e:
                    log.warning("memfilter embedder: message %r of thread %r not kept for recall: %s", v.message_id, v.thread_id, e)
            return kept

    def _outage(self, what: str) -> None:
        self.outage = what
        self.metrics.retries.inc()

"""Turns: waking the requests that wait for theirs while a reply is being made.

Under MEMFILTER_CONCURRENT_TURNS `enqueue` or `interrupt` (or a request that asks for one), a
request that arrives while its thread's reply is being made, or behind others waiting, waits:
the processor keeps it, as it was consumed, at the end of the thread's `waiting` list
(`memfilter.store.layout`) and emits nothing yet. It is decided once it is *woken*: a record
on `chat-requests`, keyed by its thread, that carries the thread's first waiting request and
the worker's signature (`memfilter.core.origin.wake_headers`). The processor decides a wake
exactly once whatever the number of wakes: only a wake of the thread's first waiting request
whose turn has come (no reply being made, or the one being made lapsed after
MEMFILTER_TURN_WAIT_S) decides it, and that wake consumed again emits the same outputs
(`memfilter.runtime.processor`). So this module sends wakes at least once, wherever a turn may
have come, and never has to be exact:

- after a batch, for the threads whose saves ended the reply they waited on (APPLY answers
  `due`) and those whose decisions left the first waiting request's turn come
  (`Decided.waits` at 0);
- every SWEEP_S, for the threads of the worker's partitions whose time in the partition's
  index (`mf:waits:<P>`, thread -> when to look again) has come: a reply that lapsed, an
  `interrupt` whose stop is sent again, a wake lost with its transaction (a thread woken is
  looked at again WAKE_AGAIN_MS later, until nothing of it waits). The index is written after
  the thread (not atomically: a Redis Cluster puts them in different slots), so it may name a
  thread with nothing waiting, which is then dropped from it, and a batch whose index write
  was lost is handled again, which writes it again.

Wakes and stops are outputs of the worker's task transaction like any other, so a wake
handled is committed with the save or sweep that sent it, or sent again.
"""

from __future__ import annotations

import msgspec

from memfilter.core import origin
from memfilter.core.filter import reply_pending
from memfilter.metrics import Metrics
from memfilter.runtime.processor import STOP_AGAIN_MS
from memfilter.runtime.records import Out
from memfilter.schemas.wire import StopReply
from memfilter.settings import Topics
from memfilter.store.history import HistoryStore
from memfilter.store.layout import WAITING

# How often the sweep looks at the index of each of the worker's partitions.
SWEEP_S = 1.0
# A thread woken is looked at again this much later, in case its wake was lost.
WAKE_AGAIN_MS = 10_000


class Turns:
    """Wakes of a worker's threads with requests waiting for their turn."""

    def __init__(self, store: HistoryStore, topics: Topics, secret: bytes, wait_ms: int, metrics: Metrics):
        self.store = store
        self.metrics = metrics
        self.topics = topics
        self.secret = secret
        self.wait_ms = wait_ms  # MEMFILTER_TURN_WAIT_S: how long a reply counts as being made

    async def index(self, waits: dict[str, tuple[int, int | None]]) -> None:
        """Write the threads' times to look again (`Decided.waits`): None takes a thread out."""
        commands = [
            ("ZREM", self.store.waits_key(partition), thread) if at is None else ("ZADD", self.store.waits_key(partition), at, thread)
            for thread, (partition, at) in waits.items()
        ]
        if commands:
            await self.store.transport.pipeline(commands)

    async def wake(self, threads: dict[str, int], now_ms: int) -> dict[int, list[Out]]:
        """The wakes (and an `interrupt`'s stops) of these threads (-> partition) whose first
        waiting request's turn has come (or whose reply it stops goes on), by partition; each
        thread's time in the index moved on. Two round trips, none without threads."""
        if not threads:
            return {}
        reads = []
        for thread in threads:
            k = self.store.keys(thread)
            reads += [("HMGET", k.meta, "waiting", "replying", "replying_ms", "owner"), ("LINDEX", k.waiting, 0)]
        replies = iter(await self.store.transport.pipeline(reads))
        outs: dict[int, list[Out]] = {}
        index: dict[str, tuple[int, int | None]] = {}
        for thread, partition in threads.items():
            (waiting, replying, replying_ms, owner), head = next(replies), next(replies)
            if not waiting or head is None:
                index[thread] = (partition, None)
                continue
            key = thread.encode()
            since = int(replying_ms or 0) if replying is not None else None
            lapses = (since or 0) + self.wait_ms
            if not reply_pending(since, now_ms, self.wait_ms):
                outs.setdefault(partition, []).append(Out(self.topics.requests, key, head, None, origin.wake_headers(key, head, self.secret)))
                index[thread] = (partition, now_ms + WAKE_AGAIN_MS)
                continue
            stop = WAITING.decode(head).stop
            if stop and stop == replying.decode() and owner is not None:  # the reply it interrupts goes on: stopped again
                stopping = msgspec.json.encode(StopReply(thread, owner.decode(), stop))
                outs.setdefault(partition, []).append(Out(self.topics.stops, key, stopping, None))
                index[thread] = (partition, min(lapses, now_ms + STOP_AGAIN_MS))
            else:
                index[thread] = (partition, lapses)
        await self.index(index)
        return outs

    async def sweep(self, partitions: list[int], now_ms: int) -> dict[int, list[Out]]:
        """`wake` for the threads of these partitions whose time in the index has come."""
        if not partitions:
            return {}
        commands = [(command, self.store.waits_key(p), *args) for p in partitions for command, *args in (("ZRANGEBYSCORE", "-inf", now_ms), ("ZCARD",))]
        found = await self.store.transport.pipeline(commands)
        self.metrics.turns_waiting.set(sum(found[1::2]))
        return await self.wake({thread.decode(): p for p, threads in zip(partitions, found[::2]) for thread in threads}, now_ms)

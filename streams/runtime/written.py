"""Where a task loop notes the records its own committed transactions wrote to a topic it reads.

The worker reads `persist-messages` and writes to it: every request it decides puts its save
there, and that event comes back to it in a later batch, to be passed over (its rows were saved
with the request's decision). An event is the processor's if its signature verifies
(`memfilter.core.origin`), an HMAC over the whole value: ~3.5 µs a request, timed inside the
worker. The loop knows its own events better, by their offsets: the broker gives each
transaction's batches their offsets, and the producer hands them back when it has them. So the
loop notes them here as each transaction commits, and the worker passes over a record found here
without verifying it.

What it promises: an offset noted here holds a record of this process's own committed
transaction; no writer can choose its offset, so no one else's record is taken for the
processor's. Not every one of the processor's records is here: those written before a restart
or a rebalance, or by another process of the group, are told by their signatures, as any record
not found here is. A partition's offsets are let go once the loop has committed its consumer's
position past them, and all of them when its partitions are revoked.
"""

from __future__ import annotations

from collections import deque

from aiokafka import TopicPartition


class Written:
    def __init__(self) -> None:
        self._spans: dict[TopicPartition, deque[tuple[int, int]]] = {}  # [first, end) by partition, in order

    def add(self, tp: TopicPartition, first: int, count: int) -> None:
        """A committed transaction's batch of `count` records at offsets `first` on."""
        self._spans.setdefault(tp, deque()).append((first, first + count))

    def holds(self, tp: TopicPartition, offset: int) -> bool:
        """Is the record at this offset one of those noted?"""
        for first, end in self._spans.get(tp, ()):
            if offset < end:
                return offset >= first
        return False

    def consumed(self, positions: dict[TopicPartition, int]) -> None:
        """The loop's consumer has committed these positions: the offsets below are let go."""
        for tp, position in positions.items():
            spans = self._spans.get(tp)
            while spans and spans[0][1] <= position:
                spans.popleft()

    def clear(self) -> None:
        self._spans.clear()

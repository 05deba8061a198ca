"""The processor: a batch of `chat-requests` records in, the records to emit out.

This is the imperative shell around the filter (`memfilter.core.filter`), without Kafka: the record
loop in `memfilter.runtime.worker` (and the audit replay) hands it batches of records and sends what it returns. For a batch:

1. decode every record (a record that does not decode, or is keyed by another thread, is
   rejected here and goes to the dead-letter topic);
2. read, in one pipelined round trip, every thread (of the lane, below): its meta, the rows of
   every message id its requests name, its retry window and the ids of its last
   MEMFILTER_HISTORY_MESSAGES rows (the context's window); then, in a second, which threads own
   the ids not stored in their own thread; in a third, only if some thread needs it, the
   window's rows the requests did not name (a client that does not echo them) and, for a
   window that reaches back to an older stored row a request keeps, the order from there;
3. decide each thread's requests in offset order, each seeing what the earlier ones of the
   batch saved (an overlay on what was read), so per-thread order and read-your-writes hold
   within a batch as across batches;
4. claim the new message ids (one round trip), then commit every request's rows and record
   (one round trip, `HistoryStore.commit`);
5. return the filtered input, the rows to persist, or the dead letter for each record.

Steps 1-4 run in concurrent lanes, each with a share of the batch's threads (all of a
thread's records in one lane) and round trips of its own, so that Redis works on one lane's
commands while the worker decodes or decides another's.

A request processed before (by the same resource: see `record_field`) is not decided again:
- re-delivered from the same position before its batch's outputs were committed (a crash),
  it emits again, byte for byte, what was recorded (`pending`), so re-delivery changes
  nothing. The worker drops those records once the outputs are committed (`Decided.recorded`);
  re-delivered from the same position after that (Kafka gave the next owner an offset from
  before the last owner's transaction; `memfilter.runtime.kafka_driver` reads stable offsets
  only, so only a Kafka that lost a committed write does), its window entry names this
  position and it has no record: it emits nothing;
- published again (a client's retry) while in its thread's retry window, it is a `duplicate`
  dead letter naming where it was processed: no second, different filtered input. Later
  than that it is decided again (`memfilter.store` says how long the window is).
A rejection is not recorded and writes nothing. A thread whose stored version moved under
the batch (another writer) or whose new id was claimed meanwhile by another thread is read
and decided again from that request on.

No record stops the worker: what a record holds is checked once, at decoding (the filter's
`decode_json`), and any other error while one record is decoded, decided or made into outputs
dead-letters that record alone (`error.type` `internal`, logged with its position). Only what
is not about one record (Redis or Kafka failing) goes up to the record loop.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from time import perf_counter
from typing import Protocol

import msgspec
from msgspec import UNSET

from memfilter.core import origin
from memfilter.core.filter import (
    Policy,
    Rejected,
    Rejection,
    Request,
    StoredView,
    check_key,
    decide,
    decode_request,
    lookup_ids,
    parse_ms,
    reply_pending,
    window_reach,
)
from memfilter.core.filtered import FORMAT, compact
from memfilter.core.replies import wants_reply
from memfilter.core.thread import Recorded, ThreadState, Write, after_commit
from memfilter.core.window import WindowRow, report
from memfilter.core.working_memory import system_message
from memfilter.metrics import Metrics
from memfilter.runtime.records import MAX_OUTPUT_BYTES, Out, Record, dead_letter, internal_error
from memfilter.schemas.wire import FilteredInput, PersistMessagesOf, Source, StopReply, Waited
from memfilter.settings import Topics
from memfilter.store.history import HistoryStore
from memfilter.store.layout import WAITING, WINDOW_ENTRY, Waiting, encode_waiting, in_window, record_field, thread_tag, window_key
from memfilter.store.memory import WorkingMemories

log = logging.getLogger("memfilter")

# A batch's threads are split into lanes that go through steps 1-4 concurrently, each on its
# own Redis connection: while some lanes wait for Redis, another decodes or decides. Threads
# are independent, so lanes need no ordering between them. A lane per LANE_RECORDS records,
# at most MAX_LANES: measured on the benchmark, the worker was busy 82% of the time with
# 500-record batches in 2 lanes, 82-92% with 1,500 in 6 (a small batch, at a low rate, is
# one lane: its round trips stay few).
LANE_RECORDS = 100
MAX_LANES = 6
# A request that interrupts a reply (MEMFILTER_CONCURRENT_TURNS `interrupt`) stops it as it
# starts waiting, and again every STOP_AGAIN_MS while that reply goes on (a stop is a relay,
# outside the exactly-once history: one can be lost with its transaction).
STOP_AGAIN_MS = 5_000


# Headers of a dead letter that say what a rejection decided against stored history saw, so
# that an audit decides it again on the same: the thread's version, and the ids of the request
# stored in other threads, with those threads (JSON object).
VERSION_HEADER = "memfilter.history-version"
ELSEWHERE_HEADER = "memfilter.ids-elsewhere"
# The header of a `duplicate` dead letter naming where the request was processed (topic-partition-offset).
ORIGINAL_HEADER = "memfilter.duplicate-of"
# The header of a `busy-thread` dead letter naming the request whose reply was being made and
# its record time (JSON [request id, epoch ms]): a replay whose range begins after that
# request was decided finds it there.
REPLYING_HEADER = "memfilter.replying"
# The header of a dead letter of a request refused once it had waited for its turn: how it
# waited (`Waited`, JSON), which a replay gives its decision again, as a filtered input's `waited`.
WAITED_HEADER = "memfilter.waited"
# The header of a `context-budget` dead letter, with working memory on: the document the
# decision weighed (JSON: a string, or null), which a replay weighs again.
MEMORY_HEADER = "memfilter.working-memory"


@dataclass
class Decided:
    """A batch's decisions (`Processor.decide_batch`)."""

    outs: list[list[Out]]  # the records to emit for each record of the batch, in its order
    # The (thread, `window_key`) of every request committed or emitted again from its record:
    # drop them (`HistoryStore.drop_records`) once the outputs are committed to Kafka.
    recorded: list[tuple[str, bytes]] = field(default_factory=list)
    # With `windows` and a budget: each decision's window, row by row, by the request's
    # position (partition, offset), for an audit's report (`memfilter replay --why`).
    windows: dict[tuple[int, int], list[WindowRow]] = field(default_factory=dict)
    # Threads whose requests waiting for their turn changed: -> (partition, when to look at them
    # again, epoch ms: at once if 0; None once none waits), for the sweep's index (`memfilter.runtime.turns`).
    waits: dict[str, tuple[int, int | None]] = field(default_factory=dict)


@dataclass
class _Pending:
    index: int  # position in its lane
    record: Record
    key: bytes  # what names the request in its thread's records (`window_key`)
    # The decoded request: freed once decided (`Processor._round`), decoded again if it is decided again.
    request: Request | None
    outcome: str = ""  # the filter's outcome, "rejected", "duplicate" or "redelivered" (a metric's label)
    left_out: bool = False  # its context holds no stored history: not even the newest whole turn fit the budget
    seen: tuple[tuple[str, bytes], ...] = ()  # what a rejection saw (`dead_letter`)
    window: list[WindowRow] | None = None  # its context's window, row by row, for an audit (`Decided.windows`)
    # A request that waited for its turn, decided now: the wake's (offset, record time), live
    # (`record` is the waiting request, as consumed); how it waited, as recorded (an audit's replay).
    wake: tuple[int, int] | None = None
    waited: Waited | None = None
    was: Waited | None = None  # how it waited, as its decision says (`_waited`)
    stop: Out | None = None  # `interrupt`: the stop of the reply being made, sent as it starts waiting
    memory: str | None = None  # with working memory: the document its decision sees (`_read_memories`)


@dataclass
class _Thread:
    """A thread's requests of the batch, and how far they got."""

    requests: list[_Pending]
    next: int = 0  # first request not yet committed
    planned: list[tuple[_Pending, Write | None, Recorded]] = field(default_factory=list)
    last: ThreadState | None = None  # the thread as the planned writes leave it
    waits: bool = False  # a request of it began or ended waiting for its turn (`Decided.waits`)


class Seen(Protocol):
    """What a decision saw that no topic holds as it was then, as an audit replay finds it in
    what was recorded (its batches are one record each)."""

    def elsewhere(self, record: Record) -> dict[str, str]:
        """The request's ids that other threads stored (which thread claimed an id when is on
        no topic): id -> the other thread."""

    def window(self, record: Record) -> bytes:
        """The thread's retry window before the request (`memfilter.store`)."""

    def replying(self, record: Record) -> tuple[str, int] | None:
        """The request whose reply was being made when this one was refused `busy-thread`, and
        its record time: what a replay cannot find in its store when that request came before
        the replayed range."""

    def waited(self, record: Record) -> Waited | None:
        """How the request waited for its turn before it was decided, if it did: a replay
        decides it as woken, as it was, whatever its store says of the replies then."""

    def working_memory(self, record: Record) -> str | None:
        """The working memory's document the decision saw (its filtered input's): a resource's
        document is updated from its threads on other partitions, in an order no replay of
        one thread knows."""


class _Source(msgspec.Struct):
    source: Source


_SOURCE = msgspec.json.Decoder(_Source)


def _position(rec: Recorded) -> tuple[str, int, int]:
    """Where the request whose outputs these are was consumed."""
    s = _SOURCE.decode(rec.filtered).source
    return s.topic, s.partition, s.offset


def _reach(request: Request, view: StoredView) -> list[str]:
    """`window_reach` of the request, or nothing if it fails (its decision will too, and
    dead-letter it)."""
    try:
        return window_reach(request, view)
    except Exception:
        return []


def _answered(context: list) -> bool:
    """Whether the agent runner answers this context (`wants_reply`): its last message, decoded
    if it goes on as stored bytes, decides."""
    for message in reversed(context):
        if isinstance(message, msgspec.Raw):
            message = msgspec.json.decode(message)
        if message.get("role") != "system":
            return wants_reply([message])
    return False


def _consumed_before(window: bytes, record: Record) -> bool:
    """Whether the thread's newest window entry is at or past this record's position."""
    if not window:
        return False
    _, partition, offset, _ = WINDOW_ENTRY.unpack_from(window, len(window) - WINDOW_ENTRY.size)
    return partition == record.partition and offset >= record.offset


class Processor:
    def __init__(
        self,
        store: HistoryStore,
        topics: Topics = Topics(),
        policy: Policy = Policy(),
        metrics: Metrics | None = None,
        secret: bytes = b"",
        seen: Seen | None = None,
        filtered_format: int = FORMAT,
        windows: bool = False,
        memories: WorkingMemories | None = None,
    ):
        self.store = store
        self.topics = topics
        self.policy = policy  # how requests are decided (MEMFILTER_MAX_*, _HISTORY_MESSAGES, _EDITS)
        self.limits = policy.limits
        self.metrics = metrics or store.metrics
        self.secret = secret  # MEMFILTER_SECRET: server-assigned message ids, and the signature of persist events
        # What a decision sees beside the thread: Redis's message-id index and retry window as
        # they are now (None, live), or as an audit replay recorded them.
        self.seen = seen
        self.history = policy.history  # the rows of the conversation in each context
        self.budget = policy.budget  # the context's tokens (MEMFILTER_CONTEXT_TOKENS), if any
        if self.budget is not None and store.counter != self.budget.counter:  # the store keeps and reads the counts the window weighs
            raise ValueError(f"a budget counted by {self.budget.counter.name} needs a HistoryStore made with that counter, not {store.counter}")
        self.edits = policy.edits  # regenerate and edit supersede rows
        self.filtered_format = filtered_format  # of the filtered inputs (MEMFILTER_FILTERED_FORMAT, `memfilter.core.filtered`)
        self.windows = windows and self.budget is not None  # each decision's window kept, for an audit (`Decided.windows`)
        self.memories = memories  # MEMFILTER_WORKING_MEMORY: each context carries its document (`memfilter.store.memory`)

    async def process(self, records: list[Record]) -> list[Out]:
        """The records to emit for a batch, in the batch's order (for a caller that keeps no
        records to drop: a test, a tool)."""
        return [out for per_record in (await self.decide_batch(records)).outs for out in per_record]

    async def decide_batch(self, records: list[Record]) -> Decided:
        """Decide a batch: what to emit for each record, and what to drop once it is committed."""
        # A record goes to the lane of its key, the thread id (a record without one is
        # rejected), so a thread's records share one lane, in order.
        n = min(MAX_LANES, max(1, len(records) // LANE_RECORDS))
        by_lane: list[list[int]] = [[] for _ in range(n)]
        for i, record in enumerate(records):
            by_lane[zlib.crc32(record.key or b"") % n].append(i)
        lanes = [lane for lane in by_lane if lane]
        tasks = [asyncio.ensure_future(self._lane([records[i] for i in lane])) for lane in lanes]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            # A lane failed (Redis gone, say): the others are stopped too before the error goes
            # up, so that no lane of this attempt still runs beside the batch's retry.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        if len(results) == 1:
            return results[0]
        decided = Decided([[] for _ in records])
        for lane, result in zip(lanes, results):
            for i, outs in zip(lane, result.outs):
                decided.outs[i] = outs
            decided.recorded += result.recorded
            decided.windows |= result.windows
            decided.waits |= result.waits
        return decided

    def _decode(self, i: int, record: Record, outs: list[list[Out]]) -> Request | None:
        """The record's request, or None after putting its dead letter in `outs`."""
        try:
            request = self._request(record)
            check_key(request.shape.threadId, record.key)
        except Rejected as e:
            error = Rejection(e.type, e.message)
        except Exception as e:
            error = internal_error(record, e)
        else:
            return request
        outs[i].append(dead_letter(record, self.topics.dlq, error))
        self.metrics.requests.labels("rejected").inc()
        return None

    def _request(self, record: Record) -> Request:
        return decode_request(record.value, f"{record.topic}-{record.partition}-{record.offset}", self.limits, self.secret)

    async def _lane(self, records: list[Record]) -> Decided:
        """Decode a lane's records, then rounds until every request is decided and committed:
        the lane's decisions, in its records' order."""
        decided = Decided([[] for _ in records])
        threads: dict[str, _Thread] = {}
        for i, record in enumerate(records):
            wake = None
            if (woken := origin.is_wake(record.key, record.value, record.headers, self.secret)) is not None:
                if not woken:
                    message = f"record {record.topic}-{record.partition}-{record.offset} claims to be the worker's wake ({origin.WAKE_HEADER}) but its signature does not verify"
                    decided.outs[i].append(dead_letter(record, self.topics.dlq, Rejection("origin", message)))
                    self.metrics.requests.labels("rejected").inc()
                    continue
                waiting = WAITING.decode(record.value or b"")  # the waiting request, as it was consumed
                wake = (record.offset, record.timestamp_ms)
                record = Record(record.topic, waiting.partition, waiting.offset, waiting.timestamp_ms, record.key, waiting.value)
            if (request := self._decode(i, record, decided.outs)) is None:
                continue
            key = window_key(record_field(request.shape.resourceId, request.request_id))
            p = _Pending(i, record, key, request, wake=wake, waited=self.seen.waited(record) if self.seen is not None else None)
            threads.setdefault(request.shape.threadId, _Thread([])).requests.append(p)
        while threads:
            threads = await self._round(threads, decided)
        return decided

    async def _round(self, threads: dict[str, _Thread], decided: Decided) -> dict[str, _Thread]:
        """Read, decide, claim and commit what is left of each thread; the threads to redo."""
        wanted = {}
        for thread, t in threads.items():
            for p in t.requests[t.next :]:
                if p.request is None:  # decided in an earlier round, and cut there or found stale
                    p.request = self._request(p.record)
            wanted[thread] = list(dict.fromkeys(chain.from_iterable(lookup_ids(p.request) for p in t.requests[t.next :] if p.request)))
        heads = frozenset(thread for thread, t in threads.items() if any(p.wake for p in t.requests[t.next :]))
        states = await self.store.read(wanted, self.history, heads=heads)
        unknown = {mid for thread, ids in wanted.items() for mid in ids if mid not in states[thread].rows}
        owners: dict[str, bytes] = {}
        if self.seen is not None:
            for thread, t in threads.items():
                states[thread].elsewhere = {mid: o for p in t.requests[t.next :] for mid, o in self.seen.elsewhere(p.record).items()}
                states[thread].window = self.seen.window(t.requests[t.next].record)
                if states[thread].replying is None and (replying := self.seen.replying(t.requests[t.next].record)) is not None:
                    states[thread].replying, states[thread].replying_ms = replying
        elif unknown:
            owners, _, _ = await self.store.owners(sorted(unknown))
        if owners:
            for thread, ids in wanted.items():
                tag = thread_tag(thread)
                states[thread].elsewhere = {mid: owners[mid].hex() for mid in ids if owners.get(mid, tag) != tag}
        await self._read_tails(threads, states)
        if self.memories is not None:
            await self._read_memories(threads)
        # A request can have a record only if it was consumed before: at or before the
        # position of its thread's newest window entry (a thread's requests go in offset order).
        again = [(thread, p) for thread, t in threads.items() for p in t.requests[t.next :] if _consumed_before(states[thread].window, p.record)]
        if again:
            for (thread, p), rec in zip(again, await self.store.read_pending([(thread, p.key) for thread, p in again])):
                if rec is not None:
                    states[thread].pending[p.key] = rec
        # What a thread's decisions read (its state, its decoded requests) is freed once they are
        # made, while it is fresh in the CPU's caches: 6-8 µs a request here, against 15-17 at
        # the end of the round, after the claim's and commit's round trips (timed inside
        # `benchmarks.processor_cpu`).
        for thread, t in threads.items():
            t.planned, t.last = self._decide_thread(thread, t, states.pop(thread))
            for p, _, _ in t.planned:
                p.request = None

        # New ids are claimed first; a thread whose id another thread holds by now is cut
        # there (its earlier requests go on) and decided again on a fresh read.
        redo: set[str] = set()
        claims = [(mid, thread) for thread, t in threads.items() for _, w, _ in t.planned if w for mid in w.new_ids]
        if claims:
            held = await self.store.claim(claims)
            taken = {(thread, mid) for (mid, thread), elsewhere in zip(claims, held) if elsewhere}
            for thread, t in threads.items():
                cut = next((k for k, (_, w, _) in enumerate(t.planned) if w and any((thread, m) in taken for m in w.new_ids)), None)
                if cut is not None:
                    del t.planned[cut:]
                    redo.add(thread)

        writes = [w for t in threads.values() for _, w, _ in t.planned if w is not None]
        results = iter(await self.store.commit(writes) if writes else [])
        outcomes: Counter[str] = Counter()
        left_out = 0
        for thread, t in threads.items():
            failed = False
            for p, w, rec in t.planned:
                status, _ = next(results) if w is not None else ("decided", 0)
                if failed or status == "stale":
                    failed = True  # this and what the thread decided after it: again
                    continue
                decided.outs[p.index] = self._emit(p, rec)
                outcomes[p.outcome] += 1
                left_out += p.left_out
                if p.window is not None:
                    decided.windows[p.record.partition, p.record.offset] = p.window
                if (w is not None and not w.wait) or p.outcome == "redelivered":
                    decided.recorded.append((thread, p.key))
                if w is not None and (w.wait or w.woken) or p.outcome == "rejected":
                    self._count_turn(p, w, rec)
                t.waits |= w is not None and (bool(w.wait) or w.woken)
                t.next += 1
            if failed:
                redo.add(thread)
            elif t.waits and t.last is not None:
                decided.waits[thread] = (t.requests[0].record.partition, self._look_again(t.last, t.planned))
        for outcome, n in outcomes.items():  # one increment per outcome: a labelled one costs ~1 µs
            self.metrics.requests.labels(outcome).inc(n)
        if left_out:
            self.metrics.history_left_out.inc(left_out)
        return {thread: threads[thread] for thread in redo if threads[thread].next < len(threads[thread].requests)}

    async def _read_memories(self, threads: dict[str, _Thread]) -> None:
        """The working memory each request's decision sees: its resource's (or thread's)
        document, read in one round trip (a request naming another resource than its thread's
        owner reads that resource's, and is refused `ownership`: its document goes nowhere);
        in a replay, the one its filtered input recorded."""
        assert self.memories is not None
        pending = [(thread, p) for thread, t in threads.items() for p in t.requests[t.next :] if p.request is not None]
        if self.seen is not None:
            for _, p in pending:
                p.memory = self.seen.working_memory(p.record)
            return
        owned = list(dict.fromkeys((thread, p.request.shape.resourceId) for thread, p in pending if p.request is not None))
        documents = dict(zip(owned, await self.memories.documents(owned)))
        for thread, p in pending:
            if p.request is not None:
                p.memory = documents[thread, p.request.shape.resourceId]

    async def _read_tails(self, threads: dict[str, _Thread], states: dict[str, ThreadState]) -> None:
        """Complete what each thread's contexts need of its last rows: the rows not read yet,
        and the order from the first stored row a request keeps (or regenerates or edits
        after), where that lies before."""
        reach = {}
        for thread, t in threads.items():
            state = states[thread]
            view = StoredView(state.rows, state.elsewhere, state.owner, state.size, superseded=state.superseded)
            tail = set(state.tail)
            far = [
                mid
                for p in t.requests[t.next :]
                if p.request is not None and (self.history or p.request.shape.trigger is not UNSET)  # the window, or what a regenerate or edit supersedes
                for mid in _reach(p.request, view)
                if mid not in tail
            ]
            if far:
                reach[thread] = list(dict.fromkeys(far))
        await self.store.read_tails(states, reach)

    def _decide_thread(self, thread: str, t: _Thread, state: ThreadState) -> tuple[list[tuple[_Pending, Write | None, Recorded]], ThreadState]:
        """Decide a thread's remaining requests in order, each on what the earlier ones saved;
        and the thread as they leave it."""
        planned = []
        after = b""
        for p in t.requests[t.next :]:
            request = p.request
            assert request is not None  # decoded for this round (`_round`)
            if state.unavailable and p.wake is not None:  # cold, and PostgreSQL did not give it back: it waits on, for a later wake
                p.outcome = "not-due"
                planned.append((p, None, Recorded()))
                continue
            if state.unavailable:  # cold, and PostgreSQL did not give it back: refused, to publish again
                p.outcome = "rejected"
                planned.append(
                    (p, None, Recorded(error=Rejection("unavailable", f"request {request.request_id} not decided: {state.unavailable}; publish it again")))
                )
                continue
            rec = state.pending.get(p.key)
            if p.wake is not None:
                if rec is not None and rec.woken == p.wake[0]:  # this wake decided it already: its outputs again
                    p.outcome = "redelivered"
                    planned.append((p, None, rec))
                    continue
                if state.head != (p.record.partition, p.record.offset) or not self._due(state, p.wake[1]):
                    p.outcome = "not-due"  # decided already on another wake, or its turn has not come: nothing
                    planned.append((p, None, Recorded()))
                    continue
            else:
                if rec is not None and rec.filtered is not UNSET and _position(rec) == (p.record.topic, p.record.partition, p.record.offset):
                    p.outcome = "redelivered"
                    planned.append((p, None, rec))
                    continue
                original = in_window(state.window, p.key)
                if original is not None and original[:2] == (p.record.partition, p.record.offset):
                    # processed at this very position (or waiting for its turn since), and its record
                    # already dropped: that happens only once its outputs are committed, so the offsets
                    # this worker started from were older than its transaction: emit nothing again
                    p.outcome = "redelivered"
                    planned.append((p, None, Recorded()))
                    continue
                if (duplicate := self._duplicate(p, request, original)) is not None:
                    planned.append((p, None, duplicate))
                    continue
            p.was = self._waited(p, state)
            try:
                write, rec = self._decide(p, request, state, after)
            except Exception as e:
                write, rec = None, Recorded(error=internal_error(p.record, e))
            if write is None:  # a rejection: nothing written, nothing recorded
                p.outcome = "rejected"
                elsewhere = {mid: state.elsewhere[mid] for mid in lookup_ids(request) if mid in state.elsewhere}
                p.seen = ((VERSION_HEADER, str(state.version).encode()), (ELSEWHERE_HEADER, msgspec.json.encode(elsewhere)))
                if rec.error is not UNSET and rec.error.type == "busy-thread":
                    p.seen += ((REPLYING_HEADER, msgspec.json.encode([state.replying, state.replying_ms])),)
                if p.was is not None:
                    p.seen += ((WAITED_HEADER, msgspec.json.encode(p.was)),)
                if self.memories is not None and rec.error is not UNSET and rec.error.type == "context-budget":
                    p.seen += ((MEMORY_HEADER, msgspec.json.encode(p.memory)),)
                if p.wake is None:
                    planned.append((p, None, rec))
                    continue
                # refused once woken: it leaves the waiting requests all the same, and a wake again emits this
                rec = Recorded(error=rec.error, woken=p.wake[0], seen={k: v.decode() for k, v in p.seen})
                entry = WINDOW_ENTRY.pack(p.key, p.record.partition, p.record.offset, p.record.timestamp_ms)
                write = Write(thread, state.version, after, request.shape.resourceId, -1, [], rec, [], entry, [], request.request_id, woken=True)
            planned.append((p, write, rec))
            state = after_commit(state, write, self.store.window_bytes)  # what the thread's next request sees
            if not write.wait:  # a request that waits has no record for the next to follow
                after = p.key
        return planned, state

    def _count_turn(self, p: _Pending, w: Write | None, rec: Recorded) -> None:
        """The metrics of a request that came while a reply was being made (`memfilter_turns_*`)."""
        if w is not None and w.wait:
            self.metrics.turns.labels("interrupted" if p.stop is not None else "waited").inc()
        elif w is not None and w.woken and p.was is not None:
            self.metrics.turn_waited.observe(p.was.ms / 1000)
            if p.was.lapsed:
                self.metrics.turns.labels("lapsed").inc()
        elif rec.error is not UNSET and rec.error.type == "busy-thread":
            self.metrics.turns.labels("rejected").inc()

    def _due(self, state: ThreadState, now_ms: int) -> bool:
        """Has the turn of the thread's first waiting request come: no reply being made, or the
        one being made not saved within MEMFILTER_TURN_WAIT_S?"""
        return not reply_pending(state.replying_ms if state.replying is not None else None, now_ms, self.policy.turn_wait_ms)

    def _waited(self, p: _Pending, state: ThreadState) -> Waited | None:
        """How a request decided on its wake waited: from its record time to the wake's, and
        whether the reply it waited for lapsed (still being made: `_due` by time alone)."""
        if p.waited is not None:
            return p.waited
        if p.wake is None:
            return None
        return Waited(max(0, p.wake[1] - p.record.timestamp_ms), state.replying is not None)

    def _look_again(self, state: ThreadState, planned: list[tuple[_Pending, Write | None, Recorded]]) -> int | None:
        """When the sweep looks at a thread with requests waiting again: once its reply lapses (at
        once if none is being made); for an `interrupt` of it, sooner, to stop it again. None
        once nothing waits."""
        if not state.waiting:
            return None
        if state.replying is None:
            return 0
        at = state.replying_ms + self.policy.turn_wait_ms
        if any(p.stop is not None for p, _, _ in planned):
            at = min(at, max(p.record.timestamp_ms for p, _, _ in planned) + STOP_AGAIN_MS)
        return at

    def _duplicate(self, p: _Pending, request: Request, original: tuple[int, int, int] | None) -> Recorded | None:
        """The dead letter of a request found in its thread's retry window, if it is inside
        the window's time too."""
        if original is None or p.record.timestamp_ms - original[2] > self.store.processed_ttl * 1000:
            return None
        where = f"{self.topics.requests}-{original[0]}-{original[1]}"
        p.outcome = "duplicate"
        p.seen = ((ORIGINAL_HEADER, where.encode()),)
        message = (
            f"request {request.request_id} was processed already, at {where}; a retry is not decided again: "
            f"its filtered input is the one of {where} (a new request needs a new requestId)"
        )
        return Recorded(error=Rejection("duplicate", message))

    def _decide(self, p: _Pending, request: Request, state: ThreadState, after: bytes) -> tuple[Write | None, Recorded]:
        """One request's decision on `state`: its write (None for a rejection) and what it emits."""
        view = StoredView(
            state.rows,
            state.elsewhere,
            state.owner,
            state.size,
            state.newest_ms,
            state.tail,
            state.superseded,
            counts=state.counts,
            erased=state.erased,
            replying=state.replying,
            replying_ms=state.replying_ms,
            waiting=state.waiting,
        )
        started = perf_counter()
        policy = self.policy
        woken = p.wake is not None or p.waited is not None
        memory = system_message(self.memories.template, p.memory) if self.memories is not None else None
        decision = decide(
            request,
            view,
            p.record.timestamp_ms,
            self.history,
            self.edits,
            self.budget,
            policy.reopen_erased,
            policy.turns,
            policy.turn_wait_ms,
            woken,
            memory,
        )
        self.metrics.decision.observe(perf_counter() - started)
        p.outcome = decision.outcome
        entry = WINDOW_ENTRY.pack(p.key, p.record.partition, p.record.offset, p.record.timestamp_ms)
        shape = request.shape
        if decision.wait is not None:  # it waits for its turn: kept as consumed, nothing emitted yet
            stop = (state.replying or "") if decision.wait == "interrupt" else ""
            if stop:
                value = msgspec.json.encode(StopReply(shape.threadId, shape.resourceId, stop))
                p.stop = Out(self.topics.stops, p.record.key, value, p.record.timestamp_ms)
            waiting = encode_waiting(Waiting(p.record.partition, p.record.offset, p.record.timestamp_ms, p.record.value or b"", stop))
            return Write(
                shape.threadId, state.version, after, shape.resourceId, -1, [], Recorded(), [], entry, [], request.request_id, wait=waiting
            ), Recorded()
        p.left_out = decision.fit is not None and decision.fit.left_out
        if self.windows and self.budget is not None and decision.fit is not None:
            p.window = report(decision.fit, state.tail, decision.superseded, state.rows, self.budget)
        if decision.error is not None:
            return None, Recorded(error=decision.error)
        rec, rows = self._record(p, request, decision, state.version, p.was)
        if (too_large := self._too_large(p, request, rec, len(decision.context))) is not None:
            return None, Recorded(error=too_large)
        if p.wake is not None:
            rec.woken = p.wake[0]
        newest = max((parse_ms(r.get("createdAt")) or -1 for r in decision.persist), default=-1)
        write = Write(
            shape.threadId,
            state.version,
            after,
            shape.resourceId,
            newest,
            rows,
            rec,
            [mid for mid, _ in rows if mid not in state.rows],
            entry,
            decision.superseded,
            request.request_id,
            decision.counts(self.budget.counter) if self.budget is not None else [],
            p.record.timestamp_ms if _answered(decision.context) else -1,
            woken=p.wake is not None,
        )
        return write, rec

    def _record(self, p: _Pending, request: Request, decision, version: int, waited: Waited | None) -> tuple[Recorded, list[tuple[str, bytes]]]:
        shape = request.shape
        source = Source(p.record.topic, p.record.partition, p.record.offset)
        compacted = self.filtered_format == FORMAT
        filtered = FilteredInput(
            request.request_id,
            shape.threadId,
            shape.resourceId,
            decision.outcome,
            compact(decision.messages, decision.context) if compacted else decision.messages,
            decision.context,
            decision.dropped,
            source,
            version,
            decision.superseded,
            FORMAT if compacted else UNSET,
            decision.fit.tokens if decision.fit is not None and decision.fit.tokens is not None else UNSET,
            True if decision.fit is not None and decision.fit.left_out else UNSET,
            waited if waited is not None else UNSET,
            p.memory if self.memories is not None else UNSET,
        )
        rows = [(row["id"], msgspec.json.encode(row)) for row in decision.persist]
        persist = None
        if rows or decision.superseded:
            persist = msgspec.json.encode(
                # the generic class itself: calling the alias PersistMessages costs ten times as much
                PersistMessagesOf(request.request_id, shape.threadId, shape.resourceId, [msgspec.Raw(r) for _, r in rows], version, decision.superseded)
            )
        recorded = Recorded(filtered=msgspec.Raw(msgspec.json.encode(filtered)))
        if persist is not None:
            recorded.persist = msgspec.Raw(persist)
        return recorded, rows

    def _too_large(self, p: _Pending, request: Request, rec: Recorded, context_rows: int) -> Rejection | None:
        """Why the request's outputs cannot be sent, if one would be larger than a record may be."""
        key = len(p.record.key or b"")
        size = max(len(rec.filtered), len(rec.persist) if rec.persist is not msgspec.UNSET else 0) + key
        if size <= MAX_OUTPUT_BYTES:
            return None
        return Rejection(
            "too-large",
            f"request {request.request_id}'s outputs would be {size} bytes with a context of {context_rows} messages; "
            f"a record may have {MAX_OUTPUT_BYTES}: lower MEMFILTER_HISTORY_MESSAGES, or send smaller messages",
        )

    def _emit(self, p: _Pending, rec: Recorded) -> list[Out]:
        key, ts = p.record.key, p.record.timestamp_ms
        if rec.error is not msgspec.UNSET:
            seen = p.seen or tuple((k, v.encode()) for k, v in rec.seen.items())  # consumed again: as recorded
            return [dead_letter(p.record, self.topics.dlq, rec.error, seen)]
        if rec.filtered is msgspec.UNSET:  # committed before (`_decide_thread`), or waiting for its turn
            return [p.stop] if p.stop is not None else []
        outs = [Out(self.topics.filtered, key, bytes(rec.filtered), ts)]
        if rec.persist is not msgspec.UNSET:
            persist = bytes(rec.persist)
            outs.append(Out(self.topics.persist, key, persist, ts, origin.headers(persist, self.secret)))
        return outs

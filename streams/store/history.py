"""The history store: threads' stored messages in Redis, read and written a batch at a time.

Stored history is the truth the filter decides against, so this module keeps it exact and
safe to write from several workers and from replays:

The keys and what they hold are in `memfilter.store.layout`, the Lua scripts in `scripts/`
(`memfilter.store.scripts`); Redis is spoken to through `memfilter.store.transport`, one
pipelined round trip a call for all the threads it is given (one per node of a Redis Cluster,
all at once), which also waits for the batch's writes to reach Redis's replicas (`replicate`).

A thread is read with plain commands, meta first, in one pipeline for its batch (a Lua
script cost Redis six times as much; consistency comes from the write); with it, the ids of
its last rows (the model's context: `memfilter.core.filter`). The rows of those the requests did
not name, and the order from an older row a request keeps (`TAIL`, the one read script, run
only for such a thread), come in one more round trip, only when some thread needs them
(`read_tails`). A request's rows, its
owner claim, the version bump and its processed record are written by one Lua script
(`COMMIT`), atomically: it refuses a decision made on a version that has since moved
(`stale`: the persister saved a reply meanwhile, or the batch's earlier request of the thread
did not commit), and the caller decides again. The message-id index lives in other slots;
ids are claimed before the thread write, so a crash in between leaves claims the re-delivered
request finds as its own.

Every write is fenced (`FENCE`): a worker that lost its partitions (stalled past its session
timeout, say) and wakes up cannot write a thread that their new owner has written since.

Processed requests, kept under the resource that sent them and their request id (a request
of another resource with the same id never finds them). Rejections are not recorded: a
rejection writes nothing, and a re-delivered one is decided again, with the same result.
- Re-delivery after a crash: a request committed here whose batch's Kafka transaction did not
  commit comes again from the same position and must emit the same bytes. Its whole output
  is kept (`pending`) until the transaction commits; then the worker drops it
  (`drop_records`, one round trip per batch while the next one is fetched). A request is
  looked for there only when its thread's newest window entry is at or past its position:
  only a request consumed again can be.
- Client retries: the same request id published again (at another position). The thread's
  last `retry_window` processed requests are kept in `recent` (8 bytes of digest, the
  position and the record time each); a retry of one of them, published within
  `processed_ttl` of it by record time, is a `duplicate` dead letter naming the original's
  position, never a second filtered input. Later than that it is decided again like any
  request (its messages are stored by then). The window is by count and record time, so an
  audit replay, given the same window from the log, decides the same; `recent` (and a record
  left over) also expires `processed_ttl` after the thread's last request.

Saves are applied once: the identity of every other service's save is kept in `saved` (the
processor's own events are skipped live, being saved already, and told apart in a rebuild
by their version: `memfilter.audit.recorded`).

Threads that left Redis for PostgreSQL are loaded back by the store's cold tier
(`memfilter.store.cold`, a `ColdTier` here) before they are read or written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import msgspec
from redis.crc import key_slot

from memfilter.core.thread import Recorded, ThreadState, Write
from memfilter.core.tokens import Counter, read_counts, stored_count
from memfilter.metrics import Metrics
from memfilter.settings import PROCESSED_TTL_S, RETRY_WINDOW
from memfilter.store import scripts
from memfilter.store.layout import NO_COUNTS, RECORDED, STATE_RANKS_PACKED, WAITING, WINDOW_ENTRY, Keys, encode_recorded, pack, pack_rows, thread_tag
from memfilter.store.postgres import PostgresHistory
from memfilter.store.transport import Transport

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import RedisCluster


class ColdTier(Protocol):
    """What loads threads that left Redis back (`memfilter.store.cold.Warmer`)."""

    pg: PostgresHistory

    async def warm(self, store: HistoryStore, threads: list[str]) -> dict[str, str]:
        """Load these cold threads back; those that could not be, with the reason."""
        ...


class Fenced(Exception):
    """A write refused because another worker, given this worker's partitions, wrote the thread since."""

    def __init__(self, thread: str, epoch: int, theirs: int):
        super().__init__(
            f"thread {thread} was written by a worker with owner epoch {theirs}, newer than this worker's {epoch}: "
            "its partitions were given to another worker; this one gives them up and rejoins the group"
        )


class Save(msgspec.Struct, frozen=True, gc=False):
    """One `persist-messages` event's rows for its thread (see APPLY)."""

    thread: str
    owner: str  # the event's resource
    newest_ms: int
    rows: list[tuple[str, bytes]]
    roles: list[str]  # each row's role
    identity: bytes  # `save_identity`, or b"" for the processor's own event
    writer: str = "service"  # "processor" (its own, signed), "import" (an operator's import, signed) or "service": see APPLY
    superseded: list[str] = []  # ids it takes out of the conversation
    request_id: str = ""  # the event's, which marks what it supersedes


class HistoryStore(Keys):
    """Threads' history in one Redis (or Redis Cluster) under one key prefix."""

    def __init__(
        self,
        client: aioredis.Redis | RedisCluster,
        prefix: str = "mf",
        metrics: Metrics | None = None,
        processed_ttl: int = PROCESSED_TTL_S,
        retry_window: int = RETRY_WINDOW,
        replicas: int = 0,
        replica_timeout: float = 1.0,
        counter: Counter | None = None,
        warmer: ColdTier | None = None,
    ):
        super().__init__(prefix)
        # With a PostgreSQL tier (POSTGRES_URL), what loads threads that left Redis back
        # before they are read or written (`memfilter.store.cold`).
        self.warmer = warmer
        # With a context budget (MEMFILTER_CONTEXT_TOKENS), how tokens are counted: every row
        # saved gets its count beside it (`tokens`), and reads return the counts of the rows read.
        self.counter = counter
        self.redis = client
        self.processed_ttl = processed_ttl  # seconds: the retry window's time bound (see the header)
        self.retry_window = retry_window  # requests: the retry window's size
        self.window_bytes = retry_window * WINDOW_ENTRY.size
        self.epoch = 0  # this writer's owner epoch (`take_epoch`); 0 for a store no worker uses (a replay's)
        self.metrics = metrics or Metrics()  # counts the round trips
        self.transport = Transport(client, prefix, self.metrics, replicas, replica_timeout)

    async def read(self, wanted: dict[str, list[str]], tail: int = 0, loading: bool = True, heads: frozenset[str] = frozenset()) -> dict[str, ThreadState]:
        """For each thread, the message ids of interest, and the ids of its last `tail` rows:
        one round trip. With a counter, the stored counts of the last `tail + 2` ids of
        interest too (a useChat echo's window; a row weighed without one is counted from its
        bytes). `elsewhere` is left empty: `owners` fills it for the ids not stored in the
        thread; so is `pending` (`read_pending`); the tail's rows are those of `wanted`
        (`read_tails` reads the others). A thread found cold (it left Redis for PostgreSQL) is
        loaded back and read again (`warm`: a PostgreSQL query and two round trips more, only
        then); one that cannot be is returned `unavailable`, with the reason. For the threads of
        `heads` (woken), the position of the first request waiting for its turn too (`head`)."""
        commands: list[tuple] = []
        counting = self.counter is not None
        for thread, ids in wanted.items():
            k = self.keys(thread)
            commands.append(
                ("HMGET", k.meta, "owner", "version", "newest", "erased", "cold", "replying", "replying_ms", "waiting")
            )  # first: a write after it is caught as stale
            if thread in heads:
                commands.append(("LINDEX", k.waiting, 0))
            commands.append(("HLEN", k.rows))
            if ids:
                commands.append(("HMGET", k.rows, *ids))
                if counting:  # those the window may weigh: a useChat echo's last ids are its window's
                    commands.append(("HMGET", k.tokens, *ids[-(tail + 2) :]))
            commands.append(("HKEYS", k.superseded))  # empty but after a regenerate or an edit
            commands.append(("GET", k.recent))
            if tail:
                commands.append(("LRANGE", k.order, -tail, -1))
        replies = iter(await self.transport.pipeline(commands))
        states = {}
        cold = []
        for thread, ids in wanted.items():
            owner, version, newest, erased, is_cold, replying, replying_ms, waiting = next(replies)
            head = next(replies) if thread in heads else None
            size = next(replies)
            if is_cold is not None:
                cold.append(thread)
            rows = next(replies) if ids else ()
            counts = self._counts(ids[-(tail + 2) :], next(replies)) if ids and counting else {}
            gone = next(replies)
            states[thread] = ThreadState(
                owner=owner.decode() if owner else None,
                version=int(version or 0),
                newest_ms=int(newest) if newest else None,
                size=size,
                rows={mid: row for mid, row in zip(ids, rows) if row is not None},
                elsewhere={},
                window=next(replies) or b"",
                superseded=frozenset(mid.decode() for mid in gone) if gone else frozenset(),
                tail=[mid.decode() for mid in next(replies)] if tail else [],
                counts=counts,
                erased=erased is not None,
                replying=replying.decode() if replying is not None else None,
                replying_ms=int(replying_ms or 0),
                waiting=int(waiting or 0),
                head=_position(head),
            )
        if cold:
            failed = await self.warm(cold) if loading else dict.fromkeys(cold, "evicted again while it was being loaded back")
            states |= await self.read({t: wanted[t] for t in cold if t not in failed}, tail, loading=False, heads=heads)
            for thread, why in failed.items():
                states[thread].unavailable = why
        return states

    async def warm(self, threads: list[str]) -> dict[str, str]:
        """Load these cold threads (`meta` marked `cold`: evicted) back into Redis from
        PostgreSQL (`memfilter.store.cold`); those that could not be, with the reason."""
        if self.warmer is None:
            return dict.fromkeys(threads, "it left Redis for PostgreSQL, and this command has no POSTGRES_URL to load it back from: set it")
        return await self.warmer.warm(self, threads)

    def _counts(self, ids: Sequence[str], stored: list[bytes | None]) -> dict[str, float]:
        """The stored counts of these ids that are the counter's."""
        assert self.counter is not None
        return read_counts(self.counter, ids, stored)

    async def read_tails(self, states: dict[str, ThreadState], reach: dict[str, list[str]]) -> None:
        """Complete the threads' tails (`read`) in one round trip, if any needs it: the rows of
        the tail not read yet, and for a thread in `reach`, the tail extended back to the first
        of those ids stored in it (`TAIL`)."""
        calls: list[tuple] = []
        commands: list[tuple] = []
        reaching, missing = [], []
        counting = self.counter is not None
        for thread, state in states.items():
            k = self.keys(thread)
            if thread in reach:
                reaching.append(state)
                calls.append(scripts.TAIL.command(*reach[thread], rows_key=k.rows, order_key=k.order, tokens_key=k.tokens))
            if ids := [mid for mid in state.tail if mid not in state.rows]:  # a reach that finds none of its ids needs them too
                missing.append((state, ids))
                commands.append(("HMGET", k.rows, *ids))
                if counting:
                    commands.append(("HMGET", k.tokens, *ids))
        if not calls and not commands:
            return
        replies = await self.transport.pipeline([*calls, *commands])
        for state, (ids, rows, counts) in zip(reaching, replies):
            if ids:
                state.tail = [mid.decode() for mid in ids]
                state.rows.update((mid, row) for mid, row in zip(state.tail, rows) if row is not None)
                if counting:
                    state.counts.update(self._counts(state.tail, counts))
        found = iter(replies[len(calls) :])
        for state, ids in missing:
            state.rows.update((mid, row) for mid, row in zip(ids, next(found)) if row is not None)
            if counting:
                state.counts.update(self._counts(ids, next(found)))

    async def read_pending(self, records: list[tuple[str, bytes]]) -> list[Recorded | None]:
        """The records of these (thread, `window_key`) still waiting for a Kafka commit: one
        round trip."""
        found = await self.transport.pipeline([("GET", self.pending_key(thread, key)) for thread, key in records])
        return [RECORDED.decode(r) if r is not None else None for r in found]

    async def owners(self, ids: list[str], threads: Sequence[str] = ()) -> tuple[dict[str, bytes], dict[str, str], set[str]]:
        """The `thread_tag` of the thread owning each of these message ids that has one, the
        owning resource of each of these threads that has one, and those of them erased and not
        started again: one round trip."""
        buckets: dict[str, tuple[list[str], list[bytes]]] = {}
        for mid in ids:
            bucket, field_ = self.id_key(mid)
            in_bucket = buckets.setdefault(bucket, ([], []))
            in_bucket[0].append(mid)
            in_bucket[1].append(field_)
        commands = [("HMGET", bucket, *fields) for bucket, (_, fields) in buckets.items()]
        commands += [("HMGET", self.keys(thread).meta, "owner", "erased") for thread in threads]
        replies = await self.transport.pipeline(commands)
        by_id = {}
        for (mids, _), held in zip(buckets.values(), replies):
            by_id.update((mid, h) for mid, h in zip(mids, held) if h is not None)
        metas = list(zip(threads, replies[len(buckets) :]))
        by_thread = {thread: owner.decode() for thread, (owner, _) in metas if owner is not None}
        return by_id, by_thread, {thread for thread, (owner, erased) in metas if owner is None and erased is not None}

    async def claim(self, claims: list[tuple[str, str]]) -> list[bool]:
        """Claim message ids (id, thread) for threads; for each, whether another thread holds
        it. One round trip, and a second for ids held already (this thread's own, claimed
        before a crash, or another's). Plain commands: a script per bucket cost the worker and
        Redis more (measured on `benchmarks.redis_memory`)."""
        if not claims:
            return []
        keys = [(*self.id_key(mid), thread_tag(thread)) for mid, thread in claims]
        claimed = await self.transport.pipeline([("HSETNX", bucket, field_, tag) for bucket, field_, tag in keys])
        held = [i for i, new in enumerate(claimed) if not new]
        holders = await self.transport.pipeline([("HGET", keys[i][0], keys[i][1]) for i in held]) if held else []
        taken = [False] * len(claims)
        for i, holder in zip(held, holders):
            taken[i] = holder != keys[i][2]
        return taken

    async def take_epoch(self) -> int:
        """A new owner epoch, newer than every one handed out before: taken by a worker each
        time it is given partitions, before it reads or writes any of their threads (and on
        MEMFILTER_REDIS_REPLICAS replicas, or a failover could hand it out again)."""
        (self.epoch,) = await self.transport.pipeline([("INCR", f"{self.prefix}:epoch")])
        await self.transport.replicate()
        return self.epoch

    async def commit(self, writes: list[Write]) -> list[tuple[str, int]]:
        """Run COMMIT for each write, in order: ('ok' or 'stale', the thread's version). Raise
        Fenced if another worker has written one of the threads since this one's partitions
        were given to it."""
        ttl, size = self.processed_ttl, self.window_bytes
        calls = []
        for w in writes:
            k = self.keys(w.thread)
            pending = self.pending_key(w.thread, w.entry[:8])
            after = self.pending_key(w.thread, w.after) if w.after else pending
            calls.append(
                scripts.COMMIT.command(
                    rows_key=k.rows,
                    order_key=k.order,
                    meta_key=k.meta,
                    recent_key=k.recent,
                    pending_key=pending,
                    after_key=after,
                    superseded_key=k.superseded,
                    tokens_key=k.tokens,
                    waiting_key=k.waiting,
                    epoch=self.epoch,
                    record=encode_recorded(w.recorded),
                    seen_version=w.version,
                    resource=w.owner,
                    newest_ms=w.newest_ms,
                    packed_rows=pack_rows(w.rows),
                    ttl=ttl,
                    entry=w.entry,
                    window_bytes=size,
                    packed_superseded=pack(w.superseded),
                    request_id=w.request_id,
                    packed_counts=pack([stored_count(self.counter, c) for c in w.counts]) if w.counts and self.counter is not None else NO_COUNTS,
                    replying_ms=w.replying_ms,
                    wait=w.wait,
                    woken="1" if w.woken else "",
                )
            )
        out = []
        for w, (status, value) in zip(writes, await self.transport.pipeline(calls)):
            if status == b"fenced":
                raise Fenced(w.thread, self.epoch, int(value))
            out.append((status.decode(), int(value)))
        return out

    async def drop_records(self, records: list[tuple[str, bytes]]) -> None:
        """Drop the records of these (thread, `window_key`): their outputs are committed to
        Kafka, so no re-delivery needs them. One round trip."""
        keys = list(dict.fromkeys(self.pending_key(thread, key) for thread, key in records))
        if self.transport.cluster:  # one command's keys must share a slot: a thread's do
            by_slot: dict[int, list[str]] = {}
            for k in keys:
                by_slot.setdefault(key_slot(k.encode()), []).append(k)
            groups = list(by_slot.values())
        else:
            groups = [keys[i : i + 1000] for i in range(0, len(keys), 1000)]
        if groups:
            await self.transport.pipeline([("UNLINK", *group) for group in groups])

    async def apply(self, saves: list[Save], loading: bool = True, due: set[str] | None = None) -> list[int | tuple[str, str]]:
        """Save rows from `persist-messages`, in order and in one round trip; for each, the
        thread's version after it, or why it was refused: ('ownership', the thread's owner),
        ('unowned', ''), ('role', the id of the row whose role it would change), ('erased',
        when), ('clash', the id of an imported row that disagrees with the stored thread).
        Raise Fenced as `commit` does. Into `due`, the threads saved whose waiting requests'
        turn has come (APPLY's `due`: no reply being made any more)."""
        if not saves:
            return []
        calls = []
        for s in saves:
            k = self.keys(s.thread)
            counts = [stored_count(self.counter, self.counter.row(row)) for _, row in s.rows] if self.counter is not None else []
            calls.append(
                scripts.APPLY.command(
                    rows_key=k.rows,
                    order_key=k.order,
                    meta_key=k.meta,
                    saved_key=k.saved,
                    superseded_key=k.superseded,
                    tokens_key=k.tokens,
                    epoch=self.epoch,
                    resource=s.owner,
                    newest_ms=s.newest_ms,
                    packed_rows=pack_rows(s.rows),
                    packed_roles=pack(s.roles),
                    writer=s.writer,
                    identity=s.identity,
                    packed_ranks=STATE_RANKS_PACKED,
                    packed_superseded=pack(s.superseded),
                    request_id=s.request_id,
                    packed_counts=pack(counts),
                )
            )
        out: list[int | tuple[str, str]] = []
        cold: list[int] = []
        for i, (s, (status, value, *flags)) in enumerate(zip(saves, await self.transport.pipeline(calls))):
            if status == b"fenced":
                raise Fenced(s.thread, self.epoch, int(value))
            if flags and flags[0] and due is not None:
                due.add(s.thread)
            if status == b"cold":  # loaded back, then saved (in order: a thread's saves are all cold or none)
                cold.append(i)
            out.append(int(value) if status == b"ok" else (status.decode(), value.decode()))
        if cold:
            failed = (
                await self.warm(list(dict.fromkeys(saves[i].thread for i in cold)))
                if loading
                else {saves[i].thread: "evicted again while it was being loaded back" for i in cold}
            )
            again = [i for i in cold if saves[i].thread not in failed]
            for i, result in zip(again, await self.apply([saves[i] for i in again], loading=False, due=due)):
                out[i] = result
            for i in cold:
                if saves[i].thread in failed:
                    out[i] = ("unavailable", failed[saves[i].thread])
        return out

    async def erase(self, thread: str, version: int, identity: bytes, erased_ms: int) -> int | tuple[str, str]:
        """Erase a thread (an operator's erasure event, `memfilter forget`): its rows, order,
        saves, retry window, records, superseded rows, token counts and its ids in the
        message-id index; what is left is a tombstone (`meta`: `version`, `epoch`, `erased`,
        `erasures`: the last erasure's identity) that names no resource and holds no content. `version` is the one the
        erasure was asked at: if the thread has moved since, nothing is erased and the result
        is ('stale', its version); an erasure applied before (`identity` in `erasures`) changes
        nothing. A thread with no meta at all is erased at `version` as asked: a rebuild starts
        an erased thread there (`memfilter.audit.recorded`, `ThreadLog`). The thread's version
        after it. Two round trips, three with ids to unindex; ('unavailable', why) for a thread
        that left Redis and cannot be loaded back (its ids are taken out of the index from its rows)."""
        (cold,) = await self.transport.pipeline([("HEXISTS", self.keys(thread).meta, "cold")])
        if cold and (failed := await self.warm([thread])):
            return ("unavailable", f"thread {thread}: {failed[thread]}")
        k = self.keys(thread)
        (stored, erasures), ids, window = await self.transport.pipeline([("HMGET", k.meta, "version", "erasures"), ("HKEYS", k.rows), ("GET", k.recent)])
        if holds(erasures or b"", identity):
            return int(stored or 0)
        if stored is not None and int(stored) != version:  # no meta at all: a rebuild starting the thread at its erasure
            return ("stale", stored.decode())
        window = window or b""
        records = [self.pending_key(thread, window[i : i + 8]) for i in range(0, len(window), WINDOW_ENTRY.size)]
        buckets: dict[str, list[bytes]] = {}
        for mid in ids:  # every id of the thread's rows is indexed to it (claimed before it was written)
            bucket, field_ = self.id_key(mid.decode())
            buckets.setdefault(bucket, []).append(field_)
        commands = [("HDEL", bucket, *fields) for bucket, fields in buckets.items()]
        if records:
            commands.append(("UNLINK", *records))
        if commands:
            await self.transport.pipeline(commands)
        erase = scripts.ERASE.command(
            rows_key=k.rows,
            order_key=k.order,
            meta_key=k.meta,
            saved_key=k.saved,
            recent_key=k.recent,
            superseded_key=k.superseded,
            tokens_key=k.tokens,
            waiting_key=k.waiting,
            epoch=self.epoch,
            seen_version=version,
            identity=identity,
            erased_ms=erased_ms,
        )
        ((status, value),) = await self.transport.pipeline([erase])
        if status == b"fenced":
            raise Fenced(thread, self.epoch, int(value))
        if status == b"cold":  # evicted since it was read: loaded back, and erased then
            return await self.erase(thread, version, identity, erased_ms)
        return int(value) if status == b"ok" else (status.decode(), value.decode())


def _position(waiting: bytes | None) -> tuple[int, int] | None:
    """Where a waiting request (`Waiting`) was consumed: (partition, offset)."""
    if waiting is None:
        return None
    w = WAITING.decode(waiting)
    return w.partition, w.offset


def holds(packed: bytes, identity: bytes) -> bool:
    """Is `identity` one of the 8-byte identities packed one after another in `packed`?"""
    return any(packed[i : i + 8] == identity for i in range(0, len(packed), 8))

"""The history store: threads' stored messages in Redis, read and written a batch at a time.

Stored history is the truth the filter decides against, so this module keeps it exact and
safe to write from several workers and from replays:

The keys and what they hold are in `memfilter.store.layout`, the Lua scripts in `scripts/`
(`memfilter.store.scripts`); Redis is spoken to through `memfilter.store.redis_driver`.

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

Every call here is one pipelined round trip for all the threads it is given: on a Redis
Cluster (`redis+cluster://` in REDIS_URL), one per node that serves some of them, all at once,
each thread's commands on its own node in order (every script touches one thread's keys, or
one bucket's: one slot). A node that answers MOVED, ASK, TRYAGAIN or CLUSTERDOWN (slots moving,
a failover) or does not answer has the caller handle its batch again on the cluster's new map,
as after an outage: nothing is followed half-way.

Redis replicates asynchronously: a master can acknowledge a write and fail over before its
replica has it. So, with MEMFILTER_REDIS_REPLICAS > 0, the worker commits a batch to Kafka
only once `replicate` has seen every Redis write the batch relied on reach that many replicas
(WAIT); on a timeout the batch is handled again, never committed half-safe.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, NoScriptError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

from memfilter.core.thread import Recorded, ThreadState, Write
from memfilter.core.tokens import Counter, read_counts, stored_count
from memfilter.metrics import Metrics
from memfilter.settings import PROCESSED_TTL_S, RETRY_WINDOW
from memfilter.store import redis_driver, scripts
from memfilter.store.layout import NO_COUNTS, RECORDED, STATE_RANKS_PACKED, WINDOW_ENTRY, Keys, encode_recorded, pack, pack_rows, thread_tag
from memfilter.store.postgres import Thread, Unavailable

if TYPE_CHECKING:
    from memfilter.store.cold import Warmer


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


class Meta(msgspec.Struct, frozen=True):
    """A thread's meta (`HistoryStore.meta`)."""

    owner: str | None
    version: int
    erased: bool  # erased (`memfilter forget`) and not started again
    erasures: bytes  # the identities of the erasures applied to it (`holds`)
    size: int  # rows stored


class NotReplicated(RedisConnectionError):
    """Writes not yet on MEMFILTER_REDIS_REPLICAS replicas: the batch is not committed to Kafka
    but handled again (`HistoryStore.replicate`)."""


class Resharded(RedisConnectionError):
    """A Redis Cluster node answered that a slot is elsewhere (MOVED, ASK), moving (TRYAGAIN) or
    not served (CLUSTERDOWN): the cluster's map is read again and the batch handled again."""


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
        warmer: Warmer | None = None,
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
        self.replicas = replicas  # MEMFILTER_REDIS_REPLICAS: writes are on this many replicas before Kafka commits (`replicate`)
        self.replica_timeout_ms = int(replica_timeout * 1000)
        self._cluster = isinstance(client, RedisCluster)
        self._nodes: dict[str, aioredis.Redis] = {}  # a cluster's node name -> a client of that node alone
        self._stale_map = False  # a cluster node failed or redirected: read the cluster's map before the next call
        self._touched: dict[str, tuple[Any, int]] = {}  # node name -> (the node, a slot of it), read or written since the last `replicate`
        self._markers: dict[str, str] = {}  # node name -> the key of its `replicate` marker

    async def _pipeline(self, commands: list[tuple]) -> list[Any]:
        """Send the commands and read their replies: one round trip per Redis node (one
        Redis, or each cluster node that holds some of their keys, all at once). An error
        reply is raised once every reply is read. A cluster node that answers MOVED, ASK,
        TRYAGAIN or CLUSTERDOWN, or does not answer, makes the next call read the cluster's map
        again: the error (`Resharded`, a ConnectionError) has the caller handle its batch again,
        as it does after an outage (a redirected command was not run, and what ran is found on
        the second pass: the module's header)."""
        if not self._cluster:
            self._touched[""] = (None, 0)
            replies = await self._node(self.redis, commands)
        else:
            replies = await self._routed(commands)
        self._raise_first(replies)
        return replies

    def _raise_first(self, replies: list[Any]) -> None:
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            if isinstance(error, (AskError, TryAgainError, ClusterDownError)):  # MovedError is an AskError
                self._stale_map = True
                raise Resharded(f"{type(error).__name__}: {error}; reading the cluster's map again") from error
            raise error

    async def _routed(self, commands: list[tuple]) -> list[Any]:
        """`_pipeline` on a Redis Cluster: the commands grouped by the node that serves their
        key's slot (redis-py's map of the cluster), each group in order on that node."""
        assert isinstance(self.redis, RedisCluster)
        cluster = await self.redis.initialize()  # the map, read on first use
        if self._stale_map:
            await redis_driver.read_map(cluster)
            self._stale_map = False
            self._markers.clear()  # a marker's slot may have moved
        groups: dict[str, tuple[Any, int, list[int]]] = {}
        try:
            for i, command in enumerate(commands):
                key = command[3] if command[0] == "EVALSHA" else command[1]
                node = cluster.get_node_from_key(key)
                group = groups.get(node.name)
                if group is None:  # a slot of the node, for `replicate`: worked out once a node
                    group = groups[node.name] = (node, cluster.keyslot(key), [])
                group[2].append(i)
        except SlotNotCoveredError as e:
            self._stale_map = True
            raise Resharded(str(e)) from e
        replies: list[Any] = [None] * len(commands)

        async def on(node, indices: list[int]) -> None:
            for i, reply in zip(indices, await self._node(self._node_client(node), [commands[i] for i in indices])):
                replies[i] = reply

        done = await asyncio.gather(*(on(node, indices) for node, _, indices in groups.values()), return_exceptions=True)
        for name, (node, slot, _) in groups.items():
            self._touched.setdefault(name, (node, slot))
        failed = next((e for e in done if e is not None), None)
        if failed is not None:
            if isinstance(failed, (RedisConnectionError, OSError, TimeoutError)):
                self._stale_map = True  # a node down: its replica may be taking over
            raise failed
        return replies

    def _node_client(self, node) -> aioredis.Redis:
        """A client of one cluster node alone, made with the cluster client's connection settings."""
        client = self._nodes.get(node.name)
        if client is None:
            client = self._nodes[node.name] = redis_driver.node_client(node)
        return client

    async def _node(self, client: aioredis.Redis, commands: list[tuple]) -> list[Any]:
        """`redis_driver.send` on one node; scripts it lacks (first use, a restart, a replica just promoted)
        are loaded there and the commands that named them sent again."""
        replies = await redis_driver.send(client, commands)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            for script in scripts.ALL:
                await client.script_load(script.source)
            for i, reply in zip(missing, await redis_driver.send(client, [commands[i] for i in missing])):
                replies[i] = reply
        self.metrics.round_trips.inc()  # the round trips that did the work: not a refused try
        return replies

    async def read(self, wanted: dict[str, list[str]], tail: int = 0, loading: bool = True) -> dict[str, ThreadState]:
        """For each thread, the message ids of interest, and the ids of its last `tail` rows:
        one round trip. With a counter, the stored counts of the last `tail + 2` ids of
        interest too (a useChat echo's window; a row weighed without one is counted from its
        bytes). `elsewhere` is left empty: `owners` fills it for the ids not stored in the
        thread; so is `pending` (`read_pending`); the tail's rows are those of `wanted`
        (`read_tails` reads the others). A thread found cold (it left Redis for PostgreSQL) is
        loaded back and read again (`warm`: a PostgreSQL query and two round trips more, only
        then); one that cannot be is returned `unavailable`, with the reason."""
        commands: list[tuple] = []
        counting = self.counter is not None
        for thread, ids in wanted.items():
            rows, order, meta, _, recent, superseded, tokens = self.keys(thread)
            commands.append(("HMGET", meta, "owner", "version", "newest", "erased", "cold"))  # first: a write after it is caught as stale
            commands.append(("HLEN", rows))
            if ids:
                commands.append(("HMGET", rows, *ids))
                if counting:  # those the window may weigh: a useChat echo's last ids are its window's
                    commands.append(("HMGET", tokens, *ids[-(tail + 2) :]))
            commands.append(("HKEYS", superseded))  # empty but after a regenerate or an edit
            commands.append(("GET", recent))
            if tail:
                commands.append(("LRANGE", order, -tail, -1))
        replies = iter(await self._pipeline(commands))
        states = {}
        cold = []
        for thread, ids in wanted.items():
            (owner, version, newest, erased, is_cold), size = next(replies), next(replies)
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
            )
        if cold:
            failed = await self.warm(cold) if loading else dict.fromkeys(cold, "evicted again while it was being loaded back")
            states |= await self.read({t: wanted[t] for t in cold if t not in failed}, tail, loading=False)
            for thread, why in failed.items():
                states[thread].unavailable = why
        return states

    async def warm(self, threads: list[str]) -> dict[str, str]:
        """Load these cold threads (`meta` marked `cold`: evicted) back into Redis from
        PostgreSQL (`memfilter.store.cold`); those that could not be, with the reason."""
        if self.warmer is None:
            return dict.fromkeys(threads, "it left Redis for PostgreSQL, and this command has no POSTGRES_URL to load it back from: set it")
        return await self.warmer.warm(self, threads)

    async def _cold_copy(self, thread: str) -> Thread | None:
        """The thread as PostgreSQL holds it, if it left Redis (for the commands that read one
        thread: read there, not loaded back, which only its worker does between its own reads
        and writes); None if it is in Redis. Raise Unavailable naming the reason if it cannot be read."""
        if not await self.redis.hexists(self.keys(thread)[2], "cold"):
            return None
        return await self._postgresql_copy(thread)

    async def _postgresql_copy(self, thread: str) -> Thread:
        """The thread as PostgreSQL holds it (it left Redis); Unavailable naming the reason if it cannot be read."""
        if self.warmer is None:
            raise Unavailable(f"thread {thread} left Redis for PostgreSQL, and this command has no POSTGRES_URL to read it from: set it")
        held = (await self.warmer.pg.load([thread], into_redis=False)).get(thread)
        if held is None:
            raise Unavailable(
                f"thread {thread} left Redis but PostgreSQL holds no copy of it (schema {self.warmer.pg.schema}); rebuild it (memfilter history rebuild)"
            )
        return held

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
            rows, order, *_, tokens = self.keys(thread)
            if thread in reach:
                reaching.append(state)
                calls.append(scripts.TAIL.command(*reach[thread], rows_key=rows, order_key=order, tokens_key=tokens))
            if ids := [mid for mid in state.tail if mid not in state.rows]:  # a reach that finds none of its ids needs them too
                missing.append((state, ids))
                commands.append(("HMGET", rows, *ids))
                if counting:
                    commands.append(("HMGET", tokens, *ids))
        if not calls and not commands:
            return
        replies = await self._pipeline([*calls, *commands])
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
        found = await self._pipeline([("GET", self.pending_key(thread, key)) for thread, key in records])
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
        commands += [("HMGET", self.keys(thread)[2], "owner", "erased") for thread in threads]
        replies = await self._pipeline(commands)
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
        claimed = await self._pipeline([("HSETNX", bucket, field_, tag) for bucket, field_, tag in keys])
        held = [i for i, new in enumerate(claimed) if not new]
        holders = await self._pipeline([("HGET", keys[i][0], keys[i][1]) for i in held]) if held else []
        taken = [False] * len(claims)
        for i, holder in zip(held, holders):
            taken[i] = holder != keys[i][2]
        return taken

    async def take_epoch(self) -> int:
        """A new owner epoch, newer than every one handed out before: taken by a worker each
        time it is given partitions, before it reads or writes any of their threads (and on
        MEMFILTER_REDIS_REPLICAS replicas, or a failover could hand it out again)."""
        (self.epoch,) = await self._pipeline([("INCR", f"{self.prefix}:epoch")])
        await self.replicate()
        return self.epoch

    async def replicate(self) -> None:
        """Return once every write made so far on the nodes this store has read or written
        since the last call is on MEMFILTER_REDIS_REPLICAS replicas; raise NotReplicated if it
        is not within MEMFILTER_REDIS_REPLICA_TIMEOUT. Called before a batch's Kafka
        transaction commits: Redis replicates asynchronously, so a master that fails over
        after acknowledging a write can lose it, while Kafka would hold outputs that rely on
        it. WAIT counts the replicas that have the connection's last write, and a master's
        replication stream is one sequence: so a marker write, then WAIT, on one connection
        per node, covers every earlier write there, by any connection. A node only read (a
        batch handled again after a timeout here finds its requests recorded and writes
        nothing) is waited on too: what it was read from may not be on a replica yet. One
        round trip per node, all at once."""
        touched, self._touched = self._touched, {}
        if not self.replicas or not touched:
            return

        async def on(name: str, node, slot: int) -> int:
            client = self.redis if node is None else self._node_client(node)
            marker = self._markers.get(name) or self._markers.setdefault(name, self._marker(slot))
            replies = await self._node(client, [("SET", marker, self.epoch, "PX", 60_000), ("WAIT", self.replicas, self.replica_timeout_ms)])
            self._raise_first(replies)
            return replies[1]

        # On failure the caller handles the batch again, which reads (touches) its nodes again.
        short = min(await asyncio.gather(*(on(name, node, slot) for name, (node, slot) in touched.items())))
        if short < self.replicas:
            raise NotReplicated(
                f"writes on {short} of the {self.replicas} replicas MEMFILTER_REDIS_REPLICAS asks for within "
                f"{self.replica_timeout_ms} ms; the batch is handled again, not committed"
            )

    def _marker(self, slot: int) -> str:
        """A key in `slot` (of a cluster; any key for one Redis) for `replicate`'s marker write:
        one per node, kept until the cluster's map is read again (`_markers`)."""
        if not self._cluster:
            return f"{self.prefix}:sync"
        tag = next(str(n) for n in itertools.count() if key_slot(str(n).encode()) == slot)  # ~16,000 tries, ~5 ms
        return f"{self.prefix}:sync:{{{tag}}}"

    async def commit(self, writes: list[Write]) -> list[tuple[str, int]]:
        """Run COMMIT for each write, in order: ('ok' or 'stale', the thread's version). Raise
        Fenced if another worker has written one of the threads since this one's partitions
        were given to it."""
        ttl, size = self.processed_ttl, self.window_bytes
        calls = []
        for w in writes:
            rows, order, meta, _, recent, superseded, tokens = self.keys(w.thread)
            pending = self.pending_key(w.thread, w.entry[:8])
            after = self.pending_key(w.thread, w.after) if w.after else pending
            calls.append(
                scripts.COMMIT.command(
                    rows_key=rows,
                    order_key=order,
                    meta_key=meta,
                    recent_key=recent,
                    pending_key=pending,
                    after_key=after,
                    superseded_key=superseded,
                    tokens_key=tokens,
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
                )
            )
        out = []
        for w, (status, value) in zip(writes, await self._pipeline(calls)):
            if status == b"fenced":
                raise Fenced(w.thread, self.epoch, int(value))
            out.append((status.decode(), int(value)))
        return out

    async def drop_records(self, records: list[tuple[str, bytes]]) -> None:
        """Drop the records of these (thread, `window_key`): their outputs are committed to
        Kafka, so no re-delivery needs them. One round trip."""
        keys = list(dict.fromkeys(self.pending_key(thread, key) for thread, key in records))
        if self._cluster:  # one command's keys must share a slot: a thread's do
            by_slot: dict[int, list[str]] = {}
            for k in keys:
                by_slot.setdefault(key_slot(k.encode()), []).append(k)
            groups = list(by_slot.values())
        else:
            groups = [keys[i : i + 1000] for i in range(0, len(keys), 1000)]
        if groups:
            await self._pipeline([("UNLINK", *group) for group in groups])

    async def apply(self, saves: list[Save], loading: bool = True) -> list[int | tuple[str, str]]:
        """Save rows from `persist-messages`, in order and in one round trip; for each, the
        thread's version after it, or why it was refused: ('ownership', the thread's owner),
        ('unowned', ''), ('role', the id of the row whose role it would change), ('erased',
        when), ('clash', the id of an imported row that disagrees with the stored thread).
        Raise Fenced as `commit` does."""
        if not saves:
            return []
        calls = []
        for s in saves:
            rows, order, meta, saved, _, superseded, tokens = self.keys(s.thread)
            counts = [stored_count(self.counter, self.counter.row(row)) for _, row in s.rows] if self.counter is not None else []
            calls.append(
                scripts.APPLY.command(
                    rows_key=rows,
                    order_key=order,
                    meta_key=meta,
                    saved_key=saved,
                    superseded_key=superseded,
                    tokens_key=tokens,
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
        for i, (s, (status, value)) in enumerate(zip(saves, await self._pipeline(calls))):
            if status == b"fenced":
                raise Fenced(s.thread, self.epoch, int(value))
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
            for i, result in zip(again, await self.apply([saves[i] for i in again], loading=False)):
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
        if await self.redis.hexists(self.keys(thread)[2], "cold") and (failed := await self.warm([thread])):
            return ("unavailable", f"thread {thread}: {failed[thread]}")
        rows, order, meta, saved, recent, superseded, tokens = self.keys(thread)
        (stored, erasures), ids, window = await self._pipeline([("HMGET", meta, "version", "erasures"), ("HKEYS", rows), ("GET", recent)])
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
            await self._pipeline(commands)
        erase = scripts.ERASE.command(
            rows_key=rows,
            order_key=order,
            meta_key=meta,
            saved_key=saved,
            recent_key=recent,
            superseded_key=superseded,
            tokens_key=tokens,
            epoch=self.epoch,
            seen_version=version,
            identity=identity,
            erased_ms=erased_ms,
        )
        ((status, value),) = await self._pipeline([erase])
        if status == b"fenced":
            raise Fenced(thread, self.epoch, int(value))
        if status == b"cold":  # evicted since it was read: loaded back, and erased then
            return await self.erase(thread, version, identity, erased_ms)
        return int(value) if status == b"ok" else (status.decode(), value.decode())

    async def meta(self, thread: str) -> Meta:
        """A thread's meta and how many rows it holds (in PostgreSQL if it left Redis)."""
        rows, _, meta, *_ = self.keys(thread)
        (owner, version, erased, erasures, cold), size = await self._pipeline(
            [("HMGET", meta, "owner", "version", "erased", "erasures", "cold"), ("HLEN", rows)]
        )
        if cold is not None:
            size = len((await self._postgresql_copy(thread)).rows)
        return Meta(owner.decode() if owner is not None else None, int(version or 0), erased is not None, erasures or b"", size)

    async def threads_of(self, resource: str) -> list[str]:
        """The threads `resource` owns: a scan of every thread's meta key (an operator's
        command: as long as Redis takes to walk its keys)."""
        found: list[str] = []
        async for threads in self.thread_batches():
            owners = await self._pipeline([("HGET", self.keys(t)[2], "owner") for t in threads])
            found += [t for t, owner in zip(threads, owners) if owner is not None and owner.decode() == resource]
        return sorted(found)

    async def thread_batches(self, size: int = 1000):
        """Every thread under this store's prefix (cold ones too), `size` at a time: a scan of their meta keys."""
        async for keys in _batches(self.redis.scan_iter(match=f"{_glob_escape(self.prefix)}:t:*:meta", count=1000), size):
            yield [self.thread_of_meta(key.decode()) for key in keys]

    async def thread_rows(self, thread: str) -> list[bytes]:
        """A thread's conversation: its rows in save order, without the superseded ones."""
        if (held := await self._cold_copy(thread)) is not None:
            return [held.rows[mid] for mid in held.order]
        rows, order, *_ = self.keys(thread)
        ids = await self.redis.lrange(order, 0, -1)
        return await self.redis.hmget(rows, ids) if ids else []

    async def row(self, thread: str, message_id: str) -> bytes | None:
        """One stored row of a thread (superseded or not), by message id."""
        if (held := await self._cold_copy(thread)) is not None:
            return held.rows.get(message_id)
        rows, *_ = self.keys(thread)
        return await self.redis.hget(rows, message_id)

    async def superseded_rows(self, thread: str) -> list[tuple[str, bytes]]:
        """A thread's superseded rows, each with the id of the request that superseded it."""
        if (held := await self._cold_copy(thread)) is not None:
            return [(request, held.rows[mid]) for mid, request in held.superseded.items() if mid in held.rows]
        rows, *_, superseded, _ = self.keys(thread)
        by = await self.redis.hgetall(superseded)
        found = await self.redis.hmget(rows, list(by)) if by else []
        return [(request.decode(), row) for request, row in zip(by.values(), found) if row is not None]

    async def drop(self) -> int:
        """Delete every key under this store's prefix; how many there were."""
        dropped = 0
        async for keys in _batches(self.redis.scan_iter(match=f"{_glob_escape(self.prefix)}:*", count=1000), 1000):
            dropped += await self.redis.unlink(*keys)
        return dropped


def holds(packed: bytes, identity: bytes) -> bool:
    """Is `identity` one of the 8-byte identities packed one after another in `packed`?"""
    return any(packed[i : i + 8] == identity for i in range(0, len(packed), 8))


_KEY_PREFIX = re.compile(rb"^(.*?):(?:t:\{|idx:\{|sync:\{|sync$|epoch$)")


async def prefixes(client: aioredis.Redis) -> dict[str, int]:
    """The history stores in a Redis: prefix -> how many keys it has (replays and rebuilds
    into new prefixes leave some behind)."""
    found: dict[str, int] = {}
    async for key in client.scan_iter(count=1000):
        if m := _KEY_PREFIX.match(key):
            name = m.group(1).decode(errors="replace")
            found[name] = found.get(name, 0) + 1
    return found


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


async def _batches(items, size: int):
    batch = []
    async for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch

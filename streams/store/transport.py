"""The history store's transport: one round trip of many commands to one Redis or a Redis Cluster.

This is the one place of the store that knows redis-py (through `memfilter.store.redis_driver`,
which alone reads its internals): the modules over it (`memfilter.store.history`,
`memfilter.store.reads`, `memfilter.store.cold`) hand it commands and read replies, and never
see a connection, a node or a slot.

Every call is one pipelined round trip for all the commands it is given: on a Redis Cluster
(`redis+cluster://` in REDIS_URL), one per node that serves some of them, all at once, each
node's commands in order (every script touches one thread's keys, or one bucket's: one slot).
A node that answers MOVED, ASK, TRYAGAIN or CLUSTERDOWN (slots moving, a failover) or does not
answer has the caller handle its batch again on the cluster's new map, as after an outage:
nothing is followed half-way. A Redis that refuses writes for a reason of its own (a full disk,
its memory, a failover: `Refusing`) is an outage too. Scripts a node lacks (first use, a restart, a replica just
promoted) are loaded there and the commands that named them sent again.

Redis replicates asynchronously: a master can acknowledge a write and fail over before its
replica has it. So, with MEMFILTER_REDIS_REPLICAS > 0, the worker commits a batch to Kafka only
once `replicate` has seen every Redis write the batch relied on reach that many replicas
(WAIT); on a timeout the batch is handled again, never committed half-safe.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, NoScriptError, OutOfMemoryError, ReadOnlyError, ResponseError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from memfilter.metrics import Metrics
from memfilter.store import redis_driver, scripts


class NotReplicated(RedisConnectionError):
    """Writes not yet on MEMFILTER_REDIS_REPLICAS replicas: the batch is not committed to Kafka
    but handled again (`Transport.replicate`)."""


class Refusing(RedisConnectionError):
    """A Redis that takes no writes now, for a reason of its own: its disk (MISCONF: the
    append-only file or a snapshot cannot be written), its memory (OOM, at maxmemory), or a
    failover (READONLY: a master demoted; MASTERDOWN, NOREPLICAS; UNBLOCKED: a WAIT cut short
    by its master's demotion). An outage to wait out, as a connection lost is (a
    ConnectionError), never an error of the batch's data; a cluster's map is read again after it."""


# Those answers: redis-py's classes of the codes it knows (MASTERDOWN is a ClusterDownError,
# `Resharded`), and the codes it does not, of which only the code that begins the reply counts,
# never a word in its text (which may quote a key, and so a client's thread id).
REFUSING_CLASSES = (ReadOnlyError, OutOfMemoryError)
REFUSING_CODES = ("MISCONF", "NOREPLICAS", "UNBLOCKED")


# A Redis that did not answer (in time: `redis_driver.send` raises TimeoutError, or redis-py's
# own when its deadline comes mid-write, as on a slow link), or answered that it cannot now
# (`Refusing`, `Resharded`, `NotReplicated` are ConnectionErrors): an outage to wait out or
# report as one, never an error of what was asked of it.
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, TimeoutError)


class Resharded(RedisConnectionError):
    """A Redis Cluster node answered that a slot is elsewhere (MOVED, ASK), moving (TRYAGAIN) or
    not served (CLUSTERDOWN): the cluster's map is read again and the batch handled again."""


class Transport:
    """Round trips to one Redis (or Redis Cluster), the scripts loaded where they are missing."""

    def __init__(self, client: aioredis.Redis | RedisCluster, prefix: str, metrics: Metrics, replicas: int = 0, replica_timeout: float = 1.0):
        self.redis = client
        self.prefix = prefix  # the store's: `replicate`'s marker keys go under it
        self.metrics = metrics  # counts the round trips
        self.replicas = replicas  # MEMFILTER_REDIS_REPLICAS: writes are on this many replicas before Kafka commits (`replicate`)
        self.replica_timeout_ms = int(replica_timeout * 1000)
        self.cluster = isinstance(client, RedisCluster)
        self._nodes: dict[str, aioredis.Redis] = {}  # a cluster's node name -> a client of that node alone
        self._stale_map = False  # a cluster node failed or redirected: read the cluster's map before the next call
        self._touched: dict[str, tuple[Any, int]] = {}  # node name -> (the node, a slot of it), read or written since the last `replicate`
        self._markers: dict[str, str] = {}  # node name -> the key of its `replicate` marker

    async def pipeline(self, commands: list[tuple]) -> list[Any]:
        """Send the commands and read their replies: one round trip per Redis node (one
        Redis, or each cluster node that holds some of their keys, all at once). An error
        reply is raised once every reply is read. A cluster node that answers MOVED, ASK,
        TRYAGAIN or CLUSTERDOWN, or does not answer, makes the next call read the cluster's map
        again: the error (`Resharded`, a ConnectionError) has the caller handle its batch again,
        as it does after an outage (a redirected command was not run, and what ran is found on
        the second pass: the module's header)."""
        if isinstance(self.redis, RedisCluster):
            replies = await self._routed(commands)
        else:
            self._touched[""] = (None, 0)
            replies = await self._node(self.redis, commands)
        self._raise_first(replies)
        return replies

    def _raise_first(self, replies: list[Any]) -> None:
        error = next((r for r in replies if isinstance(r, Exception)), None)
        if error is not None:
            if isinstance(error, (AskError, TryAgainError, ClusterDownError)):  # MovedError is an AskError
                self._stale_map = True
                raise Resharded(f"{type(error).__name__}: {error}; reading the cluster's map again") from error
            if isinstance(error, REFUSING_CLASSES) or (isinstance(error, ResponseError) and str(error).split(" ", 1)[0] in REFUSING_CODES):
                self._stale_map = True  # a failover's, perhaps: the masters have moved
                raise Refusing(f"Redis refuses writes: {error}") from error
            raise error

    async def _routed(self, commands: list[tuple]) -> list[Any]:
        """`pipeline` on a Redis Cluster: the commands grouped by the node that serves their
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
                if node is None:
                    raise SlotNotCoveredError(f"no node of the cluster's map serves the slot of {key!r}")
                group = groups.get(node.name)
                if group is None:  # a slot of the node, for `replicate`: worked out once a node
                    group = groups[node.name] = (node, cluster.keyslot(key), [])
                group[2].append(i)
        except SlotNotCoveredError as e:
            self._stale_map = True
            raise Resharded(str(e)) from e
        replies: list[Any] = [None] * len(commands)

        async def on(node, indices: list[int]) -> None:
            for i, reply in zip(indices, await self._node(self.node_client(node), [commands[i] for i in indices])):
                replies[i] = reply

        done = await asyncio.gather(*(on(node, indices) for node, _, indices in groups.values()), return_exceptions=True)
        for name, (node, slot, _) in groups.items():
            self._touched.setdefault(name, (node, slot))
        failed = next((e for e in done if e is not None), None)
        if failed is not None:
            if isinstance(failed, (OSError, *UNAVAILABLE)):
                self._stale_map = True  # a node down: its replica may be taking over
            raise failed
        return replies

    def node_client(self, node) -> aioredis.Redis:
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
            client = self.node_client(node) if node is not None else self.redis
            assert not isinstance(client, RedisCluster)  # a node of None: the one Redis of a store without a cluster
            marker = self._markers.get(name) or self._markers.setdefault(name, self._marker(slot))
            replies = await self._node(client, [("SET", marker, 1, "PX", 60_000), ("WAIT", self.replicas, self.replica_timeout_ms)])
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
        if not self.cluster:
            return f"{self.prefix}:sync"
        tag = next(str(n) for n in itertools.count() if key_slot(str(n).encode()) == slot)  # ~16,000 tries, ~5 ms
        return f"{self.prefix}:sync:{{{tag}}}"

    def scan(self, match: str) -> AsyncIterator[bytes]:
        """Every key that matches the glob `match`, on every node (a walk of the keyspace: for an
        operator's command, not a request's path)."""
        return self.redis.scan_iter(match=match, count=1000)

    async def unlink(self, keys: list[bytes]) -> int:
        """Delete these keys; how many there were."""
        return await self.redis.unlink(*keys)

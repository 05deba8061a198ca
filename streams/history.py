"""The history store: threads' stored messages in Redis, read and written a batch at a time.

Stored history is the truth the filter decides against, so this module keeps it exact and
safe to write from several workers and from replays:

Layout (prefix `MEMFILTER_REDIS_PREFIX`, default `mf`; every key of a thread shares the hash
tag `{<thread id>}`, so a thread's keys sit in one slot of a Redis Cluster; in the tag, `%`,
`{` and `}` of the thread id are written `%25`, `%7B`, `%7D`, so that every thread id, one
with braces too, is one whole tag and no two thread ids share keys):

| key | type | holds |
|---|---|---|
| `mf:t:{T}:rows` | hash | message id -> the stored row (JSON), as saved |
| `mf:t:{T}:order` | list | message ids in save order: the thread's order |
| `mf:t:{T}:meta` | hash | `owner` (resourceId), `version` (writes so far), `newest` (newest createdAt, epoch ms), `epoch` (of the last worker that wrote it) |
| `mf:t:{T}:saved` | string | the identity (`save_identity`, 8 bytes) of every other service's save applied |
| `mf:t:{T}:superseded` | hash | message id -> the request id that superseded it: rows a regenerate or an edit took out of the conversation (out of `order`, still in `rows`) |
| `mf:t:{T}:recent` | string | the retry window: the thread's last `retry_window` processed requests, a `WINDOW_ENTRY` each |
| `mf:t:{T}:pending:<K>` | string | what was emitted for processed request K (`window_key`, hex), as `Recorded` JSON, until its batch's Kafka transaction commits |
| `mf:idx:{B}` | hash | message id digest -> digest of the thread that owns it (`id_key`, `thread_tag`), in 4,096 buckets |
| `mf:epoch` | string | owner epochs handed out so far (`take_epoch`) |
| `mf:sync:{S}` | string | a marker `replicate` writes before WAIT, one per cluster node (`mf:sync` on one Redis); expires after a minute |

Only rows and order lists grow with the conversation (and `superseded`, with regenerates and
edits); everything else is a few bytes per message or save, or per thread (README, "Capacity").

A thread is read with plain commands, meta first, in one pipeline for its batch (a Lua
script cost Redis six times as much; consistency comes from the write); with it, the ids of
its last rows (the model's context: `streams/filter.py`). The rows of those the requests did
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
by their version: `streams/recorded.py`).

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
import hashlib
import itertools
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import hiredis
import msgspec
import redis.asyncio as aioredis
from msgspec import UNSET, UnsetType
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, NoScriptError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError

from streams.filter import STATE_RANKS, Rejection
from streams.metrics import Metrics

# Scripts take lists as one msgpack argument: a batch of a few hundred requests names
# thousands of ids. Rows go in as msgpack strings (Redis's cmsgpack reads no `bin` values);
# they are UTF-8 JSON anyway.

# The owner epoch (ARGV[1] of the fencing prelude, below): a worker takes one from `{prefix}:epoch`
# each time it is given partitions, and every script that writes a thread stamps the thread's
# meta with it. A write carrying an epoch older than the thread's is refused (`fenced`): it comes
# from a worker whose partitions were given to another that has written this thread since.
FENCE = """
local stored = tonumber(redis.call('HGET', KEYS[3], 'epoch') or '0')
local mine = tonumber(ARGV[1])
if mine < stored then return {'fenced', tostring(stored)} end
"""
STAMP = "if mine > stored then redis.call('HSET', KEYS[3], 'epoch', ARGV[1]) end\n"

# KEYS: rows, order, meta, recent, the request's `pending` key, the `pending` key of the request
# of the thread committed just before in the same batch (or the request's own, when none),
# superseded.
# ARGV: epoch, record, version seen, owner, newest createdAt, rows as [id, row, id, row, ...],
# seconds to keep the records, the request's window entry (`WINDOW_ENTRY`), the window's size
# in bytes, the ids it supersedes as [id, ...], its request id.
COMMIT = FENCE + """
local version = tonumber(redis.call('HGET', KEYS[3], 'version') or '0')
if version ~= tonumber(ARGV[3]) then return {'stale', tostring(version)} end
if KEYS[6] ~= KEYS[5] and redis.call('EXISTS', KEYS[6]) == 0 then return {'stale', tostring(version)} end
""" + STAMP + """
local rows = cmsgpack.unpack(ARGV[6])
local gone = cmsgpack.unpack(ARGV[10])
if #rows > 0 or #gone > 0 then
  redis.call('HSETNX', KEYS[3], 'owner', ARGV[4])
  for i = 1, #rows, 2 do
    if redis.call('HSETNX', KEYS[1], rows[i], rows[i + 1]) == 1 then
      redis.call('RPUSH', KEYS[2], rows[i])
    else
      redis.call('HSET', KEYS[1], rows[i], rows[i + 1])
    end
  end
  for _, id in ipairs(gone) do
    if redis.call('LREM', KEYS[2], 1, id) > 0 then redis.call('HSET', KEYS[7], id, ARGV[11]) end
  end
  local newest = tonumber(redis.call('HGET', KEYS[3], 'newest') or '-1')
  if tonumber(ARGV[5]) > newest then redis.call('HSET', KEYS[3], 'newest', ARGV[5]) end
  version = version + 1
  redis.call('HSET', KEYS[3], 'version', version)
end
redis.call('SET', KEYS[5], ARGV[2], 'EX', ARGV[7])
local window = (redis.call('GET', KEYS[4]) or '') .. ARGV[8]
local size = tonumber(ARGV[9])
if #window > size then window = string.sub(window, #window - size + 1) end
redis.call('SET', KEYS[4], window, 'EX', ARGV[7])
return {'ok', tostring(version)}
"""

# The context's window reaching back (`streams/filter.py`, `_context`): the thread's order from
# the first of these message ids (ARGV) stored in it to its end, and those rows.
# KEYS: rows, order. Returns {ids, rows}.
# One pass over the order, whatever the number of ids (an LPOS per id would be a pass each).
TAIL = """
local wanted = {}
for i = 1, #ARGV do wanted[ARGV[i]] = true end
local order = redis.call('LRANGE', KEYS[2], 0, -1)
local first
for i, id in ipairs(order) do
  if wanted[id] then first = i break end
end
if first == nil then return {{}, {}} end
local ids = {}
for i = first, #order do ids[#ids + 1] = order[i] end
local rows = {}
for i = 1, #ids, 1000 do
  for _, row in ipairs(redis.call('HMGET', KEYS[1], unpack(ids, i, math.min(i + 999, #ids)))) do
    rows[#rows + 1] = row
  end
end
return {ids, rows}
"""

# Rows from `persist-messages` (other services' saves; the processor's own in a rebuild or
# replay), under the same rules as the filter's base layer where they touch a stored row:
# - another service's save is applied once: its identity (`save_identity`, 8 bytes) is
#   appended to the thread's `saved`, and a save found there is a re-delivery or a repeat and
#   changes nothing (the processor's own events have none: see the module's header);
# - a row equal to the stored one changes nothing;
# - a row that would move any stored tool invocation back (to a lower state rank, or away from
#   a terminal state, or drop it) is not saved: the stored row stays, as it does against an
#   echo. So a late or repeated copy of a pending call never undoes the client's result;
# - no row changes the role of a stored row (`role`, refused before any write);
# - only the processor's own events (`may_own`) save in a thread that has no owner yet;
# - a superseded id of the event that is a row of this thread, still in its conversation,
#   leaves the conversation (its row stays, marked with the event's request id); a later save
#   of a superseded row updates the row and leaves it out.
# KEYS: rows, order, meta, saved, superseded.
# ARGV: epoch, owner, newest createdAt, rows as [id, row, ...], roles as [role, ...], '1' if it
# may own, the save's identity (or ''), tool states as {state: rank}, ids it supersedes as
# [id, ...], its request id. Returns ('ok', the version after).
APPLY = FENCE + """
local owner = redis.call('HGET', KEYS[3], 'owner')
if owner and owner ~= ARGV[2] then return {'ownership', owner} end
if not owner and ARGV[6] ~= '1' then return {'unowned', ''} end
local version = redis.call('HGET', KEYS[3], 'version') or '0'
local saved = ARGV[7] ~= '' and (redis.call('GET', KEYS[4]) or '')
if saved then
  local at = string.find(saved, ARGV[7], 1, true)
  while at do
    if at % 8 == 1 then return {'ok', version} end
    at = string.find(saved, ARGV[7], at + 1, true)
  end
end
local rows = cmsgpack.unpack(ARGV[4])
local roles = cmsgpack.unpack(ARGV[5])
local ranks = cmsgpack.unpack(ARGV[8])
local terminal = ranks['result']
local function tools(message)
  local out = {}
  local content = type(message) == 'table' and message['content']
  local parts = type(content) == 'table' and content['parts']
  if type(parts) ~= 'table' then return out end
  for _, part in ipairs(parts) do
    local inv = type(part) == 'table' and part['type'] == 'tool-invocation' and part['toolInvocation']
    if type(inv) == 'table' and type(inv['toolCallId']) == 'string' then
      out[inv['toolCallId']] = {ranks[inv['state']] or -1, inv['state']}
    end
  end
  return out
end
local function moves_back(old, new)
  local before, after = tools(old), tools(new)
  for id, was in pairs(before) do
    local now = after[id]
    if now == nil or now[1] < was[1] or (was[1] == terminal and now[2] ~= was[2]) then return true end
  end
  return false
end
local keep = {}
for i = 1, #rows, 2 do
  local old = redis.call('HGET', KEYS[1], rows[i])
  if old and old ~= rows[i + 1] then
    local ok, stored = pcall(cjson.decode, old)
    if not ok or stored['role'] ~= roles[(i + 1) / 2] then return {'role', rows[i]} end
    local fine, incoming = pcall(cjson.decode, rows[i + 1])
    keep[i] = not fine or moves_back(stored, incoming)
  end
end
""" + STAMP + """
if saved then redis.call('SET', KEYS[4], saved .. ARGV[7]) end
local changed = false
for i = 1, #rows, 2 do
  local old = redis.call('HGET', KEYS[1], rows[i])
  if not old then
    redis.call('HSET', KEYS[1], rows[i], rows[i + 1])
    redis.call('RPUSH', KEYS[2], rows[i])
    changed = true
  elseif old ~= rows[i + 1] and not keep[i] then
    redis.call('HSET', KEYS[1], rows[i], rows[i + 1])
    changed = true
  end
end
for _, id in ipairs(cmsgpack.unpack(ARGV[9])) do
  if redis.call('HEXISTS', KEYS[1], id) == 1 and redis.call('HEXISTS', KEYS[5], id) == 0 then
    redis.call('LREM', KEYS[2], 1, id)
    redis.call('HSET', KEYS[5], id, ARGV[10])
    changed = true
  end
end
if changed then
  redis.call('HSETNX', KEYS[3], 'owner', ARGV[2])
  local newest = tonumber(redis.call('HGET', KEYS[3], 'newest') or '-1')
  if tonumber(ARGV[3]) > newest then redis.call('HSET', KEYS[3], 'newest', ARGV[3]) end
  version = redis.call('HINCRBY', KEYS[3], 'version', 1)
end
return {'ok', tostring(version)}
"""


# The message-id index's buckets: at Redis's default of 128 fields a compact hash, compact up
# to ~500,000 ids (README, "Capacity").
ID_BUCKETS = 4096
PROCESSED_TTL_S = 7 * 24 * 3600
RETRY_WINDOW = 8
# A request in its thread's retry window: digest of its `record_field`, its position
# (partition, offset) and its record time (epoch ms).
WINDOW_ENTRY = struct.Struct(">8sIqq")
_pack = msgspec.msgpack.encode
_STATE_RANKS = _pack(STATE_RANKS)


def _digest(text: str, size: int) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=size).digest()


def pack_rows(rows: list[tuple[str, bytes]]) -> bytes:
    """Rows as a script's argument (see the scripts' comment)."""
    return _pack([x for mid, row in rows for x in (mid, row.decode())])


def record_field(resource: str, request_id: str) -> str:
    """What names a processed request in its thread (digested: `window_key`)."""
    return msgspec.json.encode([resource, request_id]).decode()  # '["r1","req-1"]': unambiguous


def window_key(field: str) -> bytes:
    """A request's digest in the retry window (8 bytes: two requests of a thread's window
    collide with odds of 2**-64)."""
    return _digest(field, 8)


def in_window(window: bytes, key: bytes) -> tuple[int, int, int] | None:
    """The newest entry of the request `key` in a thread's window: (partition, offset, record
    time), or None."""
    at = window.rfind(key)
    while at >= 0:
        if at % WINDOW_ENTRY.size == 0:
            return WINDOW_ENTRY.unpack_from(window, at)[1:]
        at = window.rfind(key, 0, at + len(key) - 1)
    return None


def thread_tag(thread: str) -> bytes:
    """What the message-id index holds for the thread that owns an id: 8 bytes of digest (it
    only has to tell this thread from the others, and names no thread to anyone)."""
    return _digest(thread, 8)


def save_identity(resource: str, request_id: str) -> bytes:
    """What names another service's save in its thread's `saved`: 8 bytes of digest of the
    resource and the event's `requestId`. A save of the same identity again (a re-delivery,
    or the same event published twice) changes nothing."""
    return _digest(msgspec.json.encode(["service", resource, request_id]).decode(), 8)


class Fenced(Exception):
    """A write refused because another worker, given this worker's partitions, wrote the thread since."""

    def __init__(self, thread: str, epoch: int, theirs: int):
        super().__init__(
            f"thread {thread} was written by a worker with owner epoch {theirs}, newer than this worker's {epoch}: "
            "its partitions were given to another worker; exiting so that it rejoins the group"
        )


class Recorded(msgspec.Struct, omit_defaults=True):
    """What was emitted for a processed request, to emit again byte for byte on re-delivery
    (kept in `pending` until its batch's Kafka transaction commits)."""

    filtered: msgspec.Raw | UnsetType = UNSET  # the FilteredInput value, as sent
    persist: msgspec.Raw | UnsetType = UNSET  # the PersistMessages value, as sent
    error: Rejection | UnsetType = UNSET


_RECORDED = msgspec.json.Decoder(Recorded)


def encode_recorded(r: Recorded) -> bytes:
    return msgspec.json.encode(r)


@dataclass
class ThreadState:
    """One thread as a batch saw it: meta, and the rows and records its requests name."""

    owner: str | None
    version: int
    newest_ms: int | None
    size: int
    rows: dict[str, bytes]  # stored rows of the ids asked for
    elsewhere: dict[str, str]  # asked-for id not stored here -> the `thread_tag` (hex) of the other thread that owns it
    pending: dict[bytes, Recorded] = field(default_factory=dict)  # `window_key` -> record, of requests whose outputs may not be committed yet
    window: bytes = b""  # the retry window (`recent`)
    superseded: frozenset[str] = frozenset()  # ids of its rows out of the conversation (`superseded`)
    tail: list[str] = field(default_factory=list)  # the ids of the thread's last rows, in order (`read`, `read_tails`)


class Write(msgspec.Struct, frozen=True, gc=False):
    """One request's effect on its thread (see COMMIT)."""

    thread: str
    version: int  # the version the decision saw
    after: bytes  # the `window_key` of the request of this thread committed just before in the same batch, or empty
    owner: str
    newest_ms: int
    rows: bytes  # `pack_rows` of the rows to save
    recorded: bytes
    new_ids: list[str]  # ids of the rows not stored in the thread before: to claim first
    entry: bytes  # the request's `WINDOW_ENTRY` (its `window_key` first)
    superseded: list[str]  # ids it takes out of the conversation
    request_id: str


class Save(msgspec.Struct, frozen=True, gc=False):
    """One `persist-messages` event's rows for its thread (see APPLY)."""

    thread: str
    owner: str  # the event's resource
    newest_ms: int
    rows: list[tuple[str, bytes]]
    roles: list[str]  # each row's role
    identity: bytes  # `save_identity`, or b"" for the processor's own event
    may_own: bool = False  # the processor's own event: it may set the owner of a thread that has none
    superseded: list[str] = []  # ids it takes out of the conversation
    request_id: str = ""  # the event's, which marks what it supersedes


# A whole batch's commands must be answered within this; redis-py's own socket timeout would
# arm a timer for every reply, a fifth of the cost of a batch's reads.
TIMEOUT_S = 10.0


CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")


def connect(url: str, **options) -> aioredis.Redis | RedisCluster:
    """A Redis client for the history store (`url` as in REDIS_URL): redis-py's cluster client
    for a `redis+cluster://HOST:PORT[,HOST:PORT...]` URL (nodes of the cluster: it finds the
    others from whichever answers, so name several, or a node that is down stops a start)."""
    # No socket timeout: it would put every command's send in a task of its own (`wait_for`),
    # which waits for the event loop's next turn: a fifth of the worker's throughput. The
    # worker bounds its calls itself (`_pipeline`: TIMEOUT_S).
    options = {"socket_timeout": None, "socket_connect_timeout": 5, **options}
    if url.startswith(CLUSTER_SCHEMES):
        scheme, _, rest = url.replace("+cluster", "", 1).partition("://")
        credentials, at, hosts = rest.rpartition("@")
        first, *others = hosts.split("/")[0].split(",")
        nodes = [ClusterNode(host, int(port)) for host, port in (node.rsplit(":", 1) for node in others)]
        return RedisCluster.from_url(f"{scheme}://{credentials}{at}{first}", startup_nodes=nodes, **options)
    return aioredis.from_url(url, **options)


class NotReplicated(RedisConnectionError):
    """Writes not yet on MEMFILTER_REDIS_REPLICAS replicas: the batch is not committed to Kafka
    but handled again (`HistoryStore.replicate`)."""


class Resharded(RedisConnectionError):
    """A Redis Cluster node answered that a slot is elsewhere (MOVED, ASK), moving (TRYAGAIN) or
    not served (CLUSTERDOWN): the cluster's map is read again and the batch handled again."""


class HistoryStore:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "mf",
        metrics: Metrics | None = None,
        processed_ttl: int = PROCESSED_TTL_S,
        retry_window: int = RETRY_WINDOW,
        replicas: int = 0,
        replica_timeout: float = 1.0,
    ):
        self.redis = client
        self.prefix = prefix
        self.processed_ttl = processed_ttl  # seconds: the retry window's time bound (see the header)
        self.retry_window = retry_window  # requests: the retry window's size
        self.window_bytes = retry_window * WINDOW_ENTRY.size
        self.epoch = 0  # this writer's owner epoch (`take_epoch`); 0 for a store no worker uses (a replay's)
        self.metrics = metrics or Metrics()  # counts the round trips
        self._sha = {script: hashlib.sha1(script.encode()).hexdigest() for script in (COMMIT, APPLY, TAIL)}
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
        cluster = await self.redis.initialize()  # the map, read on first use
        if self._stale_map:
            await cluster.nodes_manager.initialize()
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
            pool = aioredis.ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
            client = self._nodes[node.name] = aioredis.Redis(connection_pool=pool)
        return client

    async def _node(self, client: aioredis.Redis, commands: list[tuple]) -> list[Any]:
        """`_send` on one node; scripts it lacks (first use, a restart, a replica just promoted)
        are loaded there and the commands that named them sent again."""
        replies = await self._send(client, commands)
        missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
        if missing:
            for script in self._sha:
                await client.script_load(script)
            for i, reply in zip(missing, await self._send(client, [commands[i] for i in missing])):
                replies[i] = reply
        self.metrics.round_trips.inc()  # the round trips that did the work: not a refused try
        return replies

    async def _send(self, client: aioredis.Redis, commands: list[tuple]) -> list[Any]:
        """Send the commands in one write and read their replies, error replies among them: one
        round trip. Replies are taken straight from the connection's hiredis reader: redis-py's
        per-reply path costs ~3 µs of Python each (a batch has a few thousand), the reader's
        `gets` a tenth of that.
        (`_parser._reader` and `read_from_socket` are redis-py 8.1's hiredis parser, pinned in
        pyproject.) The reader turns each error reply into redis-py's exception for its prefix,
        and not all of those are ResponseErrors: a Redis still loading its data after a restart
        answers LOADING, a BusyLoadingError, which is a ConnectionError and so retried like an
        outage. A Redis that does not answer within TIMEOUT_S raises TimeoutError."""
        pool = client.connection_pool
        try:
            async with asyncio.timeout(TIMEOUT_S):  # a new connection's handshake waits for Redis too
                conn = await pool.get_connection()
        except TimeoutError:
            await pool.disconnect(inuse_connections=False)  # not one left half through its handshake
            raise
        try:
            async with asyncio.timeout(TIMEOUT_S):
                await conn.send_packed_command([hiredis.pack_command(c) for c in commands], check_health=False)
                parser = conn._parser
                gets = parser._reader.gets
                replies = []
                while len(replies) < len(commands):
                    reply = gets()
                    if reply is NOT_ENOUGH_DATA:
                        await parser.read_from_socket()
                    else:
                        replies.append(reply)
        except BaseException as e:
            await conn.disconnect()  # mid-reply: its stream is no longer in step
            if isinstance(e, RedisConnectionError):
                # Redis dropped it (a restart, say) and so every idle one too, which the pool
                # cannot tell until each is used: closed now, they reconnect on next use.
                await pool.disconnect(inuse_connections=False)
            raise
        finally:
            await pool.release(conn)
        return replies

    async def _run(self, calls: list[tuple[str, list[str], list[Any]]], then: tuple | list = ()) -> list[Any]:
        """Run (script, keys, args) calls by sha, then the plain commands `then`, in one round
        trip. redis-py's own script objects ask SCRIPT EXISTS before every pipeline, a second
        round trip; here the scripts are loaded only when Redis says it lacks them (first use,
        or after a restart)."""
        commands = [("EVALSHA", self._sha[script], len(keys), *keys, *args) for script, keys, args in calls]
        return await self._pipeline([*commands, *then])

    def _tag(self, thread: str) -> str:
        if "{" in thread or "}" in thread or "%" in thread:  # one whole hash tag (see the layout)
            thread = thread.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
        return f"{self.prefix}:t:{{{thread}}}"

    def keys(self, thread: str) -> list[str]:
        """The thread's keys: rows, order, meta, saved, recent, superseded."""
        base = self._tag(thread)
        return [f"{base}:rows", f"{base}:order", f"{base}:meta", f"{base}:saved", f"{base}:recent", f"{base}:superseded"]

    def pending_key(self, thread: str, key: bytes) -> str:
        """Where the record of a processed request (`window_key`) waits for its batch's Kafka commit."""
        return f"{self._tag(thread)}:pending:{key.hex()}"

    def id_key(self, mid: str) -> tuple[str, bytes]:
        """Where the message-id index keeps an id: its bucket, and its field there (8 bytes of
        digest beside the bucket's 12 bits: ids collide with odds of 2**-76 a pair)."""
        digest = _digest(mid, 10)
        return f"{self.prefix}:idx:{{{int.from_bytes(digest[:2], 'big') % ID_BUCKETS}}}", digest[2:]

    async def read(self, wanted: dict[str, list[str]], tail: int = 0) -> dict[str, ThreadState]:
        """For each thread, the message ids of interest, and the ids of its last `tail` rows:
        one round trip. `elsewhere` is left empty: `owners` fills it for the ids not stored in
        the thread; so is `pending` (`read_pending`); the tail's rows are those of `wanted`
        (`read_tails` reads the others)."""
        commands: list[tuple] = []
        for thread, ids in wanted.items():
            rows, order, meta, _, recent, superseded = self.keys(thread)
            commands.append(("HMGET", meta, "owner", "version", "newest"))  # first: a write after it is caught as stale
            commands.append(("HLEN", rows))
            if ids:
                commands.append(("HMGET", rows, *ids))
            commands.append(("HKEYS", superseded))  # empty but after a regenerate or an edit
            commands.append(("GET", recent))
            if tail:
                commands.append(("LRANGE", order, -tail, -1))
        replies = iter(await self._pipeline(commands))
        states = {}
        for thread, ids in wanted.items():
            (owner, version, newest), size = next(replies), next(replies)
            rows = next(replies) if ids else ()
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
            )
        return states

    async def read_tails(self, states: dict[str, ThreadState], reach: dict[str, list[str]]) -> None:
        """Complete the threads' tails (`read`) in one round trip, if any needs it: the rows of
        the tail not read yet, and for a thread in `reach`, the tail extended back to the first
        of those ids stored in it (`TAIL`)."""
        calls: list[tuple[str, list[str], list[Any]]] = []
        commands: list[tuple] = []
        reaching, missing = [], []
        for thread, state in states.items():
            rows, order, *_ = self.keys(thread)
            if thread in reach:
                reaching.append(state)
                calls.append((TAIL, [rows, order], reach[thread]))
            if ids := [mid for mid in state.tail if mid not in state.rows]:  # a reach that finds none of its ids needs them too
                missing.append((state, ids))
                commands.append(("HMGET", rows, *ids))
        if not calls and not commands:
            return
        replies = await self._run(calls, commands)
        for state, (ids, rows) in zip(reaching, replies):
            if ids:
                state.tail = [mid.decode() for mid in ids]
                state.rows.update((mid, row) for mid, row in zip(state.tail, rows) if row is not None)
        for (state, ids), rows in zip(missing, replies[len(calls) :]):
            state.rows.update((mid, row) for mid, row in zip(ids, rows) if row is not None)

    async def read_pending(self, records: list[tuple[str, bytes]]) -> list[Recorded | None]:
        """The records of these (thread, `window_key`) still waiting for a Kafka commit: one
        round trip."""
        found = await self._pipeline([("GET", self.pending_key(thread, key)) for thread, key in records])
        return [_RECORDED.decode(r) if r is not None else None for r in found]

    async def owners(self, ids: list[str], threads: list[str] = ()) -> tuple[dict[str, bytes], dict[str, str]]:
        """The `thread_tag` of the thread owning each of these message ids that has one, and
        the owning resource of each of these threads that has one: one round trip."""
        buckets: dict[str, tuple[list[str], list[bytes]]] = {}
        for mid in ids:
            bucket, field_ = self.id_key(mid)
            in_bucket = buckets.setdefault(bucket, ([], []))
            in_bucket[0].append(mid)
            in_bucket[1].append(field_)
        commands = [("HMGET", bucket, *fields) for bucket, (_, fields) in buckets.items()]
        commands += [("HGET", self.keys(thread)[2], "owner") for thread in threads]
        replies = await self._pipeline(commands)
        by_id = {}
        for (mids, _), held in zip(buckets.values(), replies):
            by_id.update((mid, h) for mid, h in zip(mids, held) if h is not None)
        by_thread = {thread: owner.decode() for thread, owner in zip(threads, replies[len(buckets) :]) if owner is not None}
        return by_id, by_thread

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
            rows, order, meta, _, recent, superseded = self.keys(w.thread)
            pending = self.pending_key(w.thread, w.entry[:8])
            after = self.pending_key(w.thread, w.after) if w.after else pending
            args = [self.epoch, w.recorded, w.version, w.owner, w.newest_ms, w.rows, ttl, w.entry, size, _pack(w.superseded), w.request_id]
            calls.append((COMMIT, [rows, order, meta, recent, pending, after, superseded], args))
        out = []
        for w, (status, value) in zip(writes, await self._run(calls)):
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

    async def apply(self, saves: list[Save]) -> list[int | tuple[str, str]]:
        """Save rows from `persist-messages`, in order and in one round trip; for each, the
        thread's version after it, or why it was refused: ('ownership', the thread's owner),
        ('unowned', ''), ('role', the id of the row whose role it would change). Raise Fenced
        as `commit` does."""
        if not saves:
            return []
        calls = [
            (
                APPLY,
                [*self.keys(s.thread)[:4], self.keys(s.thread)[5]],
                [
                    self.epoch, s.owner, s.newest_ms, pack_rows(s.rows), _pack(s.roles), "1" if s.may_own else "0", s.identity, _STATE_RANKS,
                    _pack(s.superseded), s.request_id,
                ],
            )
            for s in saves
        ]
        out: list[int | tuple[str, str]] = []
        for s, (status, value) in zip(saves, await self._run(calls)):
            if status == b"fenced":
                raise Fenced(s.thread, self.epoch, int(value))
            out.append(int(value) if status == b"ok" else (status.decode(), value.decode()))
        return out

    async def thread_rows(self, thread: str) -> list[bytes]:
        """A thread's conversation: its rows in save order, without the superseded ones."""
        rows, order, *_ = self.keys(thread)
        ids = await self.redis.lrange(order, 0, -1)
        return await self.redis.hmget(rows, ids) if ids else []

    async def superseded_rows(self, thread: str) -> list[tuple[str, bytes]]:
        """A thread's superseded rows, each with the id of the request that superseded it."""
        rows, *_, superseded = self.keys(thread)
        by = await self.redis.hgetall(superseded)
        found = await self.redis.hmget(rows, list(by)) if by else []
        return [(request.decode(), row) for request, row in zip(by.values(), found) if row is not None]

    async def drop(self) -> int:
        """Delete every key under this store's prefix; how many there were."""
        dropped = 0
        async for keys in _batches(self.redis.scan_iter(match=f"{_glob_escape(self.prefix)}:*", count=1000), 1000):
            dropped += await self.redis.unlink(*keys)
        return dropped


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

"""The history store's layout in Redis: its keys and the bytes it keeps.

Layout (prefix `MEMFILTER_REDIS_PREFIX`, default `mf`; every key of a thread shares the hash
tag `{<thread id>}`, so a thread's keys sit in one slot of a Redis Cluster; in the tag, `%`,
`{` and `}` of the thread id are written `%25`, `%7B`, `%7D`, so that every thread id, one
with braces too, is one whole tag and no two thread ids share keys):

| key | type | holds |
|---|---|---|
| `mf:t:{T}:rows` | hash | message id -> the stored row (JSON), as saved |
| `mf:t:{T}:order` | list | message ids in save order: the thread's order |
| `mf:t:{T}:meta` | hash | `owner` (resourceId), `version` (writes so far), `newest` (newest createdAt, epoch ms), `epoch` (of the last worker that wrote it); once erased (`memfilter forget`), only `version`, `epoch`, `erased` (when, epoch ms; gone when its resource starts it again) and `erasures` (8 bytes of digest of the last erasure applied): the tombstone |
| `mf:t:{T}:saved` | string | the identity (`save_identity`, 8 bytes) of every other service's save applied |
| `mf:t:{T}:tokens` | hash | message id -> the row's token count, written with the row when a budget is set (`memfilter.core.tokens.stored_count`: the counter's tag, then the count) |
| `mf:t:{T}:superseded` | hash | message id -> the request id that superseded it: rows a regenerate or an edit took out of the conversation (out of `order`, still in `rows`) |
| `mf:t:{T}:recent` | string | the retry window: the thread's last `retry_window` processed requests, a `WINDOW_ENTRY` each |
| `mf:t:{T}:waiting` | list | the requests that wait for their turn while a reply is being made (MEMFILTER_CONCURRENT_TURNS `enqueue`, `interrupt`), oldest first, a `Waiting` each (msgpack); meta `waiting` counts them, meta `replying` / `replying_ms` name the request whose reply is being made |
| `mf:t:{T}:pending:<K>` | string | what was emitted for processed request K (`window_key`, hex), as `Recorded` JSON, until its batch's Kafka transaction commits |
| `mf:idx:{B}` | hash | message id digest -> digest of the thread that owns it (`id_key`, `thread_tag`), in 4,096 buckets |
| `mf:waits:<P>` | sorted set | thread id -> when to look at it again (epoch ms), for the threads of partition P with requests waiting: the worker's sweep (`memfilter.runtime.turns`) wakes them once due |
| `mf:gateways:{F}` | set | the addresses of the gateways sharing the partitions of topic F (`filtered-inputs`) among themselves (MEMFILTER_GATEWAY_ADDRESS, `memfilter.gateway.shards`) |
| `mf:gateways:{F}:<address>` | string | that gateway's lease: gone LEASE_S after its last heartbeat, by Redis's clock |
| `mf:wm:r:{R}:updates` (`mf:wm:t:{T}:updates` with MEMFILTER_WORKING_MEMORY=thread) | sorted set | the working memory's updates applied (`memfilter.store.memory`): `["<thread>","<requestId>"]` each, scored by its record time (ms) |
| `mf:wm:r:{R}:calls` | hash | each update's calls of `updateWorkingMemory` (their arguments, a JSON list), by its member |
| `mf:wm:r:{R}:document` | string | the document its updates make, folded in their order (`memfilter.core.working_memory.fold`) |
| `mf:wm:r:{R}:folded` | string | how many updates the document folds |
| `mf:epoch` | string | owner epochs handed out so far (`take_epoch`) |
| `mf:sync:{S}` | string | a marker `replicate` writes before WAIT, one per cluster node (`mf:sync` on one Redis); expires after a minute |

Only rows and order lists grow with the conversation (and `superseded`, with regenerates and
edits, and `tokens`, a few bytes a row, with a budget); everything else is a few bytes per message or save, or per thread (docs/operations.md, "Capacity").

Everything here is pure: key names, digests and encodings, shared by the store
(`memfilter.store.history`), the processor and the audit's recorded log. No I/O.
"""

from __future__ import annotations

import hashlib
import struct

import msgspec

from memfilter.core.filter import STATE_RANKS
from memfilter.core.thread import Recorded

# The message-id index's buckets: at Redis's default of 128 fields a compact hash, compact up
# to ~500,000 ids (docs/operations.md, "Capacity").
ID_BUCKETS = 4096
# A request in its thread's retry window: digest of its `record_field`, its position
# (partition, offset) and its record time (epoch ms).
WINDOW_ENTRY = struct.Struct(">8sIqq")
pack = msgspec.msgpack.encode
STATE_RANKS_PACKED = pack(STATE_RANKS)
NO_COUNTS = pack([])  # a write's token counts without a budget


def _digest(text: str, size: int) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=size).digest()


def pack_rows(rows: list[tuple[str, bytes]]) -> bytes:
    """Rows as a script's argument (see the scripts' comment)."""
    return pack([x for mid, row in rows for x in (mid, row.decode())])


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


RECORDED = msgspec.json.Decoder(Recorded)


def encode_recorded(r: Recorded) -> bytes:
    return msgspec.json.encode(r)


class ThreadKeys(msgspec.Struct, frozen=True, gc=False):
    """One thread's keys (the layout's table)."""

    rows: str
    order: str
    meta: str
    saved: str
    recent: str
    superseded: str
    tokens: str
    waiting: str


class Waiting(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request waiting for its turn, as its thread's `waiting` list keeps it: its record, so
    that a wake decides it as it was consumed."""

    partition: int
    offset: int
    timestamp_ms: int
    value: bytes
    stop: str = ""  # `interrupt`: the request whose reply it stops (again, while it waits)


encode_waiting = msgspec.msgpack.Encoder().encode
WAITING = msgspec.msgpack.Decoder(Waiting)


def hash_tag(name: str) -> str:
    """`{name}`, one whole hash tag whatever the id (see the layout)."""
    if "{" in name or "}" in name or "%" in name:
        name = name.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return f"{{{name}}}"


class Keys:
    """A store's key names, under its prefix."""

    # Key names kept (`keys`): a batch names each of its threads several times. Bounded in
    # threads and in a thread id's length (ids are the client's: a long one is not kept).
    KEPT_THREADS = 1 << 12
    KEPT_ID_LENGTH = 128

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._keys: dict[str, ThreadKeys] = {}

    def _tag(self, thread: str) -> str:
        return f"{self.prefix}:t:{hash_tag(thread)}"

    def thread_of_meta(self, key: str) -> str:
        """The thread id of one of this store's meta keys (`_tag` undone)."""
        tag = key[len(self.prefix) + len(":t:{") : -len("}:meta")]
        return tag.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")

    def keys(self, thread: str) -> ThreadKeys:
        """The thread's keys."""
        names = self._keys.get(thread)
        if names is None:
            base = self._tag(thread)
            names = ThreadKeys(*(f"{base}:{name}" for name in ThreadKeys.__struct_fields__))
            if len(thread) <= self.KEPT_ID_LENGTH:
                if len(self._keys) >= self.KEPT_THREADS:
                    self._keys.clear()
                self._keys[thread] = names
        return names

    def waits_key(self, partition: int) -> str:
        """The threads of a partition with requests waiting for their turn (the sweep's index)."""
        return f"{self.prefix}:waits:{partition}"

    def gateways_key(self, topic: str) -> str:
        """The gateways that share the partitions of `topic` (and the leases beside it, in its slot)."""
        return f"{self.prefix}:gateways:{{{topic}}}"

    def pending_key(self, thread: str, key: bytes) -> str:
        """Where the record of a processed request (`window_key`) waits for its batch's Kafka commit."""
        return f"{self._tag(thread)}:pending:{key.hex()}"

    def id_key(self, mid: str) -> tuple[str, bytes]:
        """Where the message-id index keeps an id: its bucket, and its field there (8 bytes of
        digest beside the bucket's 12 bits: ids collide with odds of 2**-76 a pair)."""
        digest = _digest(mid, 10)
        return f"{self.prefix}:idx:{{{int.from_bytes(digest[:2], 'big') % ID_BUCKETS}}}", digest[2:]

"""The history store: threads' stored messages in Redis, read and written a batch at a time.

Stored history is the truth the filter decides against, so this module keeps it exact and
safe to write from several workers and from replays:

Layout (prefix `MEMFILTER_REDIS_PREFIX`, default `mf`; every key of a thread shares the hash
tag `{<thread id>}`, so a thread's keys sit in one slot of a Redis Cluster):

| key | type | holds |
|---|---|---|
| `mf:t:{T}:rows` | hash | message id -> the stored row (JSON), as saved |
| `mf:t:{T}:order` | list | message ids in save order: the thread's order |
| `mf:t:{T}:meta` | hash | `owner` (resourceId), `version` (writes so far), `newest` (newest createdAt, epoch ms) |
| `mf:t:{T}:done` | hash | processed request id -> what was emitted for it (`Recorded`, msgpack) |
| `mf:m:{ID}` | string | the thread that owns message id ID |

A request's rows, its owner claim, the version bump and its processed record are written by
one Lua script (`COMMIT`), atomically and once: the script refuses a request already recorded
(`dup`) and a decision made on a version that has since moved (`stale`, e.g. the persister
saved a reply meanwhile, or the batch's earlier request of the thread did not commit), and
the caller re-decides. Message-id claims live in another slot,
so they are made first (`SET NX GET`), before the thread write: a crash in between leaves
claims that the re-delivered request finds as its own.

Every call here is one pipelined round trip for a whole batch of threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis

from streams.filter import Rejection

COMMIT = """
local rec = redis.call('HGET', KEYS[4], ARGV[1])
if rec then return {'dup', rec} end
local version = tonumber(redis.call('HGET', KEYS[3], 'version') or '0')
if version ~= tonumber(ARGV[2]) then return {'stale', tostring(version)} end
if ARGV[7] ~= '' and redis.call('HEXISTS', KEYS[4], ARGV[7]) == 0 then return {'stale', tostring(version)} end
local n = tonumber(ARGV[5])
if n > 0 then
  redis.call('HSETNX', KEYS[3], 'owner', ARGV[3])
  for i = 0, n - 1 do
    local id, row = ARGV[8 + 2 * i], ARGV[9 + 2 * i]
    if redis.call('HSETNX', KEYS[1], id, row) == 1 then
      redis.call('RPUSH', KEYS[2], id)
    else
      redis.call('HSET', KEYS[1], id, row)
    end
  end
  local newest = tonumber(redis.call('HGET', KEYS[3], 'newest') or '-1')
  if tonumber(ARGV[4]) > newest then redis.call('HSET', KEYS[3], 'newest', ARGV[4]) end
  version = version + 1
  redis.call('HSET', KEYS[3], 'version', version)
end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[6])
return {'ok', tostring(version)}
"""

# Rows from `persist-messages` (other services' saves, and the processor's own again): a row
# equal to the stored one changes nothing, so applying an event twice is harmless.
APPLY = """
local owner = redis.call('HGET', KEYS[3], 'owner')
if owner and owner ~= ARGV[1] then return {'ownership', owner} end
local n = tonumber(ARGV[3])
local changed = 0
for i = 0, n - 1 do
  local id, row = ARGV[4 + 2 * i], ARGV[5 + 2 * i]
  local old = redis.call('HGET', KEYS[1], id)
  if not old then
    redis.call('HSET', KEYS[1], id, row)
    redis.call('RPUSH', KEYS[2], id)
    changed = 1
  elseif old ~= row then
    redis.call('HSET', KEYS[1], id, row)
    changed = 1
  end
end
if changed == 1 then
  redis.call('HSETNX', KEYS[3], 'owner', ARGV[1])
  local newest = tonumber(redis.call('HGET', KEYS[3], 'newest') or '-1')
  if tonumber(ARGV[2]) > newest then redis.call('HSET', KEYS[3], 'newest', ARGV[2]) end
  redis.call('HINCRBY', KEYS[3], 'version', 1)
end
return {'ok', tostring(changed)}
"""


class Recorded(msgspec.Struct, array_like=True):
    """What was emitted for a processed request, to emit again byte for byte on re-delivery."""

    filtered: bytes | None = None
    persist: bytes | None = None
    error: Rejection | None = None


_RECORDED = msgspec.msgpack.Decoder(Recorded)
_encode_recorded = msgspec.msgpack.Encoder().encode


def encode_recorded(r: Recorded) -> bytes:
    return _encode_recorded(r)


@dataclass
class ThreadState:
    """One thread as a batch saw it: meta, and the rows and records its requests name."""

    owner: str | None
    version: int
    newest_ms: int | None
    size: int
    rows: dict[str, bytes]  # stored rows of the ids asked for
    elsewhere: dict[str, str]  # asked-for id -> the other thread that owns it
    done: dict[str, Recorded] = field(default_factory=dict)  # asked-for request ids processed


@dataclass(frozen=True)
class Write:
    """One request's effect on its thread (see COMMIT)."""

    thread: str
    request_id: str
    version: int  # the version the decision saw
    after: str  # the request of this thread committed just before in the same batch, or ""
    owner: str
    newest_ms: int
    rows: list[tuple[str, bytes]]
    recorded: bytes
    new_ids: list[str]  # ids of `rows` not stored in the thread before: to claim first


class HistoryStore:
    def __init__(self, client: aioredis.Redis, prefix: str = "mf"):
        self.redis = client
        self.prefix = prefix
        self._commit = client.register_script(COMMIT)
        self._apply = client.register_script(APPLY)

    def keys(self, thread: str) -> list[str]:
        base = f"{self.prefix}:t:{{{thread}}}"
        return [f"{base}:rows", f"{base}:order", f"{base}:meta", f"{base}:done"]

    def id_key(self, mid: str) -> str:
        return f"{self.prefix}:m:{{{mid}}}"

    async def read(self, wanted: dict[str, tuple[list[str], list[str]]]) -> dict[str, ThreadState]:
        """For each thread, its (message ids, request ids) of interest: one round trip.
        Every thread asks for at least one request id."""
        pipe = self.redis.pipeline(transaction=False)
        for thread, (ids, request_ids) in wanted.items():
            rows, _, meta, done = self.keys(thread)
            pipe.hmget(meta, "owner", "version", "newest")
            pipe.hlen(rows)
            if ids:
                pipe.hmget(rows, ids)
                for mid in ids:
                    pipe.get(self.id_key(mid))
            pipe.hmget(done, request_ids)
        replies = iter(await pipe.execute())
        states = {}
        for thread, (ids, request_ids) in wanted.items():
            owner, version, newest = next(replies)
            size = next(replies)
            row_values = next(replies) if ids else []
            claims = [next(replies) for _ in ids]
            done_values = next(replies)
            states[thread] = ThreadState(
                owner=owner.decode() if owner is not None else None,
                version=int(version or 0),
                newest_ms=int(newest) if newest is not None else None,
                size=size,
                rows={mid: row for mid, row in zip(ids, row_values) if row is not None},
                elsewhere={mid: c.decode() for mid, c in zip(ids, claims) if c is not None and c.decode() != thread},
                done={rid: _RECORDED.decode(v) for rid, v in zip(request_ids, done_values) if v is not None},
            )
        return states

    async def claim(self, claims: list[tuple[str, str]]) -> list[str | None]:
        """Claim message ids for threads; for each, the other thread that holds it, or None."""
        if not claims:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for mid, thread in claims:
            pipe.set(self.id_key(mid), thread, nx=True, get=True)
        held = await pipe.execute()
        return [h.decode() if h is not None and h.decode() != thread else None for h, (_, thread) in zip(held, claims)]

    async def commit(self, writes: list[Write]) -> list[tuple[str, Any]]:
        """Run COMMIT for each write, in order: ('ok', version), ('dup', Recorded), ('stale', version)."""
        pipe = self.redis.pipeline(transaction=False)
        for w in writes:
            args: list[Any] = [w.request_id, w.version, w.owner, w.newest_ms, len(w.rows), w.recorded, w.after]
            for mid, row in w.rows:
                args += [mid, row]
            await self._commit(keys=self.keys(w.thread), args=args, client=pipe)
        out = []
        for status, value in await pipe.execute():
            status = status.decode()
            out.append((status, _RECORDED.decode(value) if status == "dup" else int(value)))
        return out

    async def apply(self, thread: str, owner: str, newest_ms: int, rows: list[tuple[str, bytes]]) -> str | None:
        """Save rows from `persist-messages`; the owner that refuses them, else None."""
        args: list[Any] = [owner, newest_ms, len(rows)]
        for mid, row in rows:
            args += [mid, row]
        status, value = await self._apply(keys=self.keys(thread), args=args)
        return value.decode() if status == b"ownership" else None

    async def thread_rows(self, thread: str) -> list[bytes]:
        """A thread's rows in save order."""
        rows, order, _, _ = self.keys(thread)
        ids = await self.redis.lrange(order, 0, -1)
        return await self.redis.hmget(rows, ids) if ids else []

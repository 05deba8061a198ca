"""Gateways that share the outcome topics by thread: each reads its own part, and forwards the rest.

A gateway follows what becomes of its requests on four topics keyed by thread
(`memfilter.gateway.outcomes`). Alone, or without MEMFILTER_GATEWAY_ADDRESS, it reads every
partition of them, and so does every other: with N gateways the brokers send every decision and
every token of every reply N times, and each gateway's cost grows with the whole deployment's
traffic. With MEMFILTER_GATEWAY_ADDRESS (the URL the other gateways reach this one at), the
gateways of a deployment (those on one Redis prefix and one `filtered-inputs` topic) divide the
partitions among themselves:

- each gateway holds a lease in Redis, renewed every HEARTBEAT_S, that Redis expires LEASE_S
  after its last renewal (by Redis's clock: the gateways' clocks need not agree), and is listed
  under the topic's key (`memfilter.store.layout`, `gateways_key`); one stopping gives its lease
  back at once;
- partition P belongs to the live gateway of highest `weight(address, P)` among those not
  holding their even share yet (`owners`: rendezvous hashing, bounded): every gateway computes
  the same owners from the same leases, none reads more than its share, and a gateway joining
  or leaving moves about the partitions it takes or held;
- a request or a resume for a thread on another gateway's partition is forwarded there
  (`forward`), once, the caller's headers and body as they came, and the answer streamed back as
  it comes. A forwarded request is served where it arrives, whoever owns its partition then; so
  is one whose owner does not answer: the gateway then reads that partition too for as long as
  it holds the request (`Outcomes.waiting`). Any gateway still serves any request and resumes any
  reply; the shares only decide who serves it cheaply.

Two gateways that briefly disagree on the leases (between heartbeats) at worst both read a
partition, or forward a request that is then served where it lands: nothing is missed, because
what a gateway holds a request for it reads whatever it owns.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable

import aiohttp
from aiohttp import web
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

log = logging.getLogger("memfilter")

HEARTBEAT_S = 1.0  # how often a gateway renews its lease and reads the others'
LEASE_S = 5.0  # a gateway not heard from for this long has lost its partitions to the others
# A request forwarded by another gateway carries this header, and is served where it lands.
FORWARDED = "Memfilter-Forwarded"
# What a forwarded request keeps of the caller's: who it is (as either identity mode reads it), its body's type, its retry key.
CALLER_HEADERS = ("Authorization", "Content-Type", "Idempotency-Key")
# What a forwarded answer keeps of the owner's headers: what the AI SDK's transport reads, and
# what keeps a proxy in front from buffering the stream (`memfilter.core.ui_stream.HEADERS`).
ANSWER_HEADERS = ("Content-Type", "Cache-Control", "x-vercel-ai-ui-message-stream", "x-accel-buffering", "Retry-After")
CONNECT_S = 2.0  # an owner that does not take the connection in this long is taken for gone


def weight(address: str, partition: int) -> int:
    """A gateway's claim on a partition: the highest among the live gateways owns it."""
    return int.from_bytes(hashlib.blake2b(f"{partition}@{address}".encode(), digest_size=8).digest(), "big")


def owners(partitions: int, live: list[str]) -> list[str]:
    """Each partition's gateway, by rendezvous hashing over the live ones, bounded: a partition
    goes to the gateway of highest weight that holds fewer than its even share (rounded up), so
    that no gateway reads more than that (plain rendezvous hashing gives one of four gateways
    three of eight partitions as often as not)."""
    share, held = -(-partitions // len(live)), dict.fromkeys(live, 0)
    chosen = []
    for p in range(partitions):
        owner = next(a for a in sorted(live, key=lambda a: weight(a, p), reverse=True) if held[a] < share)
        held[owner] += 1
        chosen.append(owner)
    return chosen


class Peers:
    """This gateway's lease, and the live gateways as the leases say (`live`)."""

    def __init__(self, redis: Redis | RedisCluster, key: str, address: str, on_change: Callable[[], None]):
        self.redis, self.key, self.address, self.on_change = redis, key, address, on_change
        self.live = [address]
        self._task: asyncio.Task | None = None

    def _lease(self, address: str) -> str:
        return f"{self.key}:{address}"

    async def start(self) -> None:
        """Take the lease and read the others' (Redis not answering: this gateway alone, until it does)."""
        try:
            await self._beat()
        except Exception as e:  # Redis's outage is the heartbeat loop's to wait out
            log.warning("memfilter gateway: cannot take a lease in Redis (%s); reading every partition until it can", type(e).__name__)
        self._task = asyncio.create_task(self._beating())

    async def stop(self) -> None:
        """Give the lease back: the others take this gateway's partitions at their next heartbeat."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self._lease(self.address))
            pipe.srem(self.key, self.address)
            await pipe.execute()

    async def _beating(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._beat()
            except Exception as e:
                log.warning("memfilter gateway: renewing its lease in Redis failed (%s); trying again", type(e).__name__)

    async def _beat(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(self._lease(self.address), b"1", px=int(LEASE_S * 1000))
        pipe.sadd(self.key, self.address)
        pipe.smembers(self.key)
        *_, members = await pipe.execute()
        listed = sorted(m.decode() for m in members)
        held = await self.redis.mget([self._lease(a) for a in listed])
        gone = [a for a, lease in zip(listed, held) if lease is None and a != self.address]
        if gone:
            await self.redis.srem(self.key, *gone)
        live = sorted({a for a, lease in zip(listed, held) if lease is not None} | {self.address})
        if live != self.live:
            log.info("memfilter gateway: %d gateways share the partitions: %s", len(live), ", ".join(live))
            self.live = live
            self.on_change()


async def forward(
    http: aiohttp.ClientSession, request: web.Request, address: str, body: bytes, resource_header: str, stall_s: float
) -> web.StreamResponse | None:
    """`request` sent to the gateway at `address`, and its answer streamed back as it comes; None
    if that gateway does not take it (gone, or not listening): the caller serves it itself. The
    caller's identity goes as it came (`resource_header` too, for a gateway behind a proxy that
    sets it) and is checked there again. A client that stops reading is cut once a write has waited `stall_s`, as a relayed reply is."""
    headers = {h: v for h in (*CALLER_HEADERS, resource_header) if (v := request.headers.get(h)) is not None}
    try:
        upstream = await http.request(
            request.method,
            address.rstrip("/") + request.rel_url.path_qs,
            data=body,
            headers=headers | {FORWARDED: "1"},
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_S),
        )
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        log.warning("memfilter gateway: %s did not take a forwarded request (%s); serving it here", address, type(e).__name__)
        return None
    async with upstream:
        response = web.StreamResponse(status=upstream.status, headers={h: v for h in ANSWER_HEADERS if (v := upstream.headers.get(h)) is not None})
        await response.prepare(request)
        try:
            async for data in upstream.content.iter_any():
                await asyncio.wait_for(response.write(data), stall_s)
        except (ConnectionResetError, TimeoutError):  # the client went away, or stopped reading: the reply goes on, and a resume finds it
            if request.transport is not None:
                request.transport.abort()
        except aiohttp.ClientError:  # the owner went away mid-answer: the client's stream ends, and it may resume
            if request.transport is not None:
                request.transport.abort()
    return response

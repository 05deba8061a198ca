"""The Redis driver: connecting, and one round trip of many commands, on redis-py.

This is the one module of the product that touches redis-py's private internals, so that a
redis-py upgrade has one place to look. It was written for the release line `WRITTEN_FOR`
(pyproject bounds redis to it) and refuses to load on another, naming both, rather than fail
later in the middle of a batch; `tests/store/test_redis_driver.py` fails loudly too.

What it uses, and why:
- `send`: replies read straight from the connection's hiredis reader (`conn._parser._reader.gets`,
  `_parser.read_from_socket`, `redis._parsers.hiredis.NOT_ENOUGH_DATA`). redis-py's per-reply
  path costs ~3 µs of Python each and a batch has a few thousand replies; the reader's `gets`
  costs a tenth of that (`benchmarks.redis_replies` measures both side by side).
- `node_client`: a client of one Redis Cluster node with the cluster client's connection
  settings (`node.connection_class`, `node.connection_kwargs`), so a batch's commands go to
  each node in one write.
- `read_map`: the cluster's slot map read again (`nodes_manager.initialize()`), after a node
  answered MOVED, ASK, TRYAGAIN or CLUSTERDOWN or did not answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError

from memfilter.settings import CLUSTER_SCHEMES

WRITTEN_FOR = "8.1"  # redis-py's release line whose private parser `send` reads
if redis.__version__.rsplit(".", 1)[0] != WRITTEN_FOR:
    raise ImportError(
        f"memfilter.store.redis_driver was written for redis-py {WRITTEN_FOR}.x and found {redis.__version__}: "
        "install the redis that pyproject.toml names (redis>=8.1.0,<8.2), or port this module"
    )

# A whole batch's commands must be answered within this; redis-py's own socket timeout would
# arm a timer for every reply, a fifth of the cost of a batch's reads.
TIMEOUT_S = 10.0


def connect(url: str, waits: bool = False, **options: Any) -> aioredis.Redis | RedisCluster:
    """A Redis client for the history store (`url` as in REDIS_URL): redis-py's cluster client
    for a `redis+cluster://HOST:PORT[,HOST:PORT...]` URL (nodes of the cluster: it finds the
    others from whichever answers, so name several, or a node that is down stops a start).
    `waits`: a call finding every connection of the pool (100) in use waits for one (up to
    TIMEOUT_S) rather than fail, for a server whose requests use Redis all at once (the gateway;
    a cluster's client keeps pools of its own, per node)."""
    # No socket timeout: it would put every command's send in a task of its own (`wait_for`),
    # which waits for the event loop's next turn: a fifth of the worker's throughput. The
    # store bounds its calls itself (`send`: TIMEOUT_S).
    options = {"socket_timeout": None, "socket_connect_timeout": 5, **options}
    if url.startswith(CLUSTER_SCHEMES):
        scheme, _, rest = url.replace("+cluster", "", 1).partition("://")
        credentials, at, hosts = rest.rpartition("@")
        first, *others = hosts.split("/")[0].split(",")
        nodes = [ClusterNode(host, int(port)) for host, port in (node.rsplit(":", 1) for node in others)]
        return RedisCluster.from_url(f"{scheme}://{credentials}{at}{first}", startup_nodes=nodes, **options)
    if waits:
        return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, max_connections=100, timeout=TIMEOUT_S, **options))
    return aioredis.from_url(url, **options)


async def send(client: aioredis.Redis, commands: list[tuple]) -> list[Any]:
    """Send the commands in one write and read their replies, error replies among them: one
    round trip. The reader turns each error reply into redis-py's exception for its prefix,
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
            replies: list[Any] = []
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


def node_client(node: Any) -> aioredis.Redis:
    """A client of one cluster node alone, made with the cluster client's connection settings."""
    pool = aioredis.ConnectionPool(connection_class=node.connection_class, **node.connection_kwargs)
    return aioredis.Redis(connection_pool=pool)


async def read_map(cluster: RedisCluster) -> None:
    """Read the cluster's slot map again."""
    await cluster.nodes_manager.initialize()

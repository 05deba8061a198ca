"""What the commands share: reading input, checking that Kafka, Redis and the secret will do, progress bars, the store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memfilter.settings import Settings


def read_input(path: str | None) -> bytes:
    if path in (None, "-"):
        return sys.stdin.buffer.read()
    return Path(path).read_bytes()


def reachable(settings) -> str | None:
    """None if Kafka answers, else a one-line reason."""
    import asyncio

    from memfilter.stack import broker_answers

    if not asyncio.run(broker_answers(settings.kafka.bootstrap, timeout=10)):
        return f"Kafka at {settings.kafka.bootstrap} does not answer; start it (memfilter stack up) or set KAFKA_BOOTSTRAP_SERVERS"
    return None


def no_secret(settings) -> str | None:
    """Why MEMFILTER_SECRET will not do, or None. Server-assigned message ids and the
    processor's signature on its persist events are keyed by it: every worker, replay and
    rebuild of a deployment needs the same one, and no client may know it."""
    make = "make one: python3 -c 'import secrets; print(secrets.token_hex(32))'; `memfilter stack up` exports the local stack's"
    if not settings.secret:
        return f"MEMFILTER_SECRET is not set: set it to the deployment's secret, 16 characters or more ({make})"
    if len(settings.secret) < 16:
        return f"MEMFILTER_SECRET is {len(settings.secret)} characters; the deployment's secret needs 16 or more ({make})"
    return None


def data_dir_missing(settings: Settings) -> str | None:
    """Why MEMFILTER_DATA_DIR cannot be made, or None: Faust makes the folder, not its parents."""
    folder = Path(settings.worker.data_dir)
    if not folder.parent.is_dir():
        return f"MEMFILTER_DATA_DIR={folder}: its folder {folder.parent} does not exist; create it or choose another"
    return None


def web_port_free(settings, port: int | None = None, variable: str = "MEMFILTER_WEB_PORT", what: str = "worker") -> str | None:
    """None if the web server can listen on `port` (the worker's by default), else a one-line reason."""
    import socket

    port = settings.worker.web_port if port is None else port
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.worker.web_bind, port))
            return None
        except OSError as e:
            return (
                f"cannot serve the web server on {settings.worker.web_bind}:{port} ({e.strerror}): "
                f"each {what} on a host needs its own port: --web-port or {variable}"
            )


def progress_bar(label: str):
    """`show(n, total)`: a progress bar on stderr when it is a terminal (tqdm), nothing else."""
    from tqdm import tqdm

    bars: dict = {}

    def show(n: int, total: int, what: str = label) -> None:
        bar = bars.get(what)
        if bar is None:
            bar = bars[what] = tqdm(total=total, desc=what, file=sys.stderr, disable=None, leave=False, mininterval=0.5)
        bar.update(n - bar.n)
        if n >= total:
            bar.close()

    return show


def plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def run_or_explain(command: str, settings, coroutine):
    """Run `coroutine`; a missing topic, or a Kafka or Redis that does not answer, is one line
    on stderr and exit 1 instead of a traceback."""
    import asyncio

    from aiokafka.errors import KafkaConnectionError
    from redis.exceptions import RedisError

    from memfilter.audit.recorded import TopicMissing

    try:
        return asyncio.run(coroutine)
    except TopicMissing as e:
        reason = f"{e}; create it (`memfilter stack up` does) or set MEMFILTER_TOPIC_*"
    except KafkaConnectionError:
        reason = f"Kafka at {settings.kafka.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS"
    except (RedisError, TimeoutError) as e:
        reason = f"Redis does not answer as Redis ({type(e).__name__}: {e}); set REDIS_URL or --redis-url"
    print(f"memfilter {command}: {reason}", file=sys.stderr)
    raise SystemExit(1)


def history_store(url: str, prefix: str, settings: Settings):
    from memfilter.store.cold import Warmer
    from memfilter.store.history import HistoryStore
    from memfilter.store.redis_driver import connect

    budget = settings.policy.budget  # a rebuild writes the rows' token counts as the worker does
    return HistoryStore(
        connect(url),
        prefix,
        processed_ttl=settings.worker.processed_ttl,
        retry_window=settings.worker.retry_window,
        counter=budget.counter if budget is not None else None,
        warmer=Warmer.of(settings, prefix),
    )


async def workers_of(settings) -> int:
    """How many workers the group has now (members of its consumer group)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka.bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        described = await admin.describe_consumer_groups([settings.worker.group])
        return sum(len(g["members"]) for d in described for g in d.to_object()["groups"])
    finally:
        await admin.close()


async def refuse_live(settings, url: str, prefix: str, doing: str) -> str | None:
    """Why `doing` may not touch `prefix` in the Redis at `url` now: the workers run on it."""
    if (url, prefix) != (settings.redis.url, settings.redis.prefix):
        return None
    workers = await workers_of(settings)
    if workers:
        return (
            f"{plural(workers, 'worker')} of group {settings.worker.group} {'runs' if workers == 1 else 'run'} on prefix {prefix}; "
            f"stop {'it' if workers == 1 else 'them'} before you {doing} it, "
            "or use another prefix (--prefix NEW; point the workers at it with MEMFILTER_REDIS_PREFIX)"
        )
    return None


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return int(text)


def consume_until_stopped(name: str, make, settings: Settings, port: int, banner: str, summary) -> int:
    """Run a consumer of persist-messages (`memfilter sink`, `memfilter embedder`) that
    `make()` makes: its web server on MEMFILTER_WEB_BIND:`port`, its `run(stop)` until SIGTERM
    or SIGINT, then at most MEMFILTER_SHUTDOWN_S to stop; `banner` said on start,
    `summary(part)` on a clean stop. What it did not commit is consumed again by the next one,
    and changes nothing."""
    import asyncio
    import signal

    from memfilter.runtime.sink import serve

    async def main() -> int:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        part = make()
        web = await serve(part, settings.worker.web_bind, port)
        print(f"memfilter {name}: {banner}; web server on {settings.worker.web_bind}:{port}", file=sys.stderr, flush=True)
        running = asyncio.ensure_future(part.run(stop))
        try:
            await asyncio.wait({running, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
            try:
                await asyncio.wait_for(running, settings.worker.shutdown_s)
            except TimeoutError:
                print(f"memfilter {name}: not stopped within {settings.worker.shutdown_s:g} s (MEMFILTER_SHUTDOWN_S); exiting", file=sys.stderr)
                return 1
        finally:
            await web.cleanup()
        print(f"memfilter {name}: stopped; {summary(part)}", file=sys.stderr)
        return 0

    return asyncio.run(main())

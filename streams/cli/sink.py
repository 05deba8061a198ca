"""`memfilter sink`: persist-messages into PostgreSQL, idle threads out of Redis."""

from __future__ import annotations

import argparse
import logging
import sys

from memfilter.cli.common import web_port_free
from memfilter.settings import Kafka, Postgres, Redis, Settings, Topics, variables

EXTRA = "worker"


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    import msgspec

    from memfilter.runtime.sink import Sink, serve
    from memfilter.settings import without_password

    settings = Settings.from_env()
    if args.web_port is not None:
        settings = msgspec.structs.replace(settings, postgres=msgspec.structs.replace(settings.postgres, sink_web_port=args.web_port))
    if not settings.postgres.url:
        print("memfilter sink: no POSTGRES_URL: set it to the PostgreSQL that holds the history (memfilter stack up exports the local one)", file=sys.stderr)
        return 2
    if reason := web_port_free(settings, settings.postgres.sink_web_port, "MEMFILTER_SINK_WEB_PORT", "sink"):
        print(f"memfilter sink: {reason}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=getattr(logging, {"crit": "CRITICAL", "warn": "WARNING"}.get(args.loglevel, args.loglevel.upper())),
        format="[%(asctime)s] [%(levelname)s] %(message)s",
    )

    async def main() -> int:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        sink = Sink(settings)
        web = await serve(sink, settings.worker.web_bind, settings.postgres.sink_web_port)
        print(
            f"memfilter sink: {settings.topics.persist} into {without_password(settings.postgres.url)} (schema {settings.redis.prefix}); "
            f"threads idle {settings.postgres.idle_s:g} s leave Redis; web server on {settings.worker.web_bind}:{settings.postgres.sink_web_port}",
            file=sys.stderr,
            flush=True,
        )
        running = asyncio.ensure_future(sink.run(stop))
        try:
            await asyncio.wait({running, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
            try:  # stopping: what is not committed is consumed again by the next sink, and changes nothing
                await asyncio.wait_for(running, settings.worker.shutdown_s)
            except TimeoutError:
                print(f"memfilter sink: not stopped within {settings.worker.shutdown_s:g} s (MEMFILTER_SHUTDOWN_S); exiting", file=sys.stderr)
                return 1
        finally:
            await web.cleanup()
        m = sink.metrics
        print(
            f"memfilter sink: stopped; {m.value('memfilter_sink_threads_written_total'):.0f} thread writes, "
            f"{m.value('memfilter_sink_threads_evicted_total'):.0f} threads evicted",
            file=sys.stderr,
        )
        return 0

    return asyncio.run(main())


def add(sub) -> None:
    p = sub.add_parser(
        "sink",
        help="write persist-messages into PostgreSQL, and take idle threads out of Redis",
        description="Consume persist-messages once the workers applied it, write each thread it names to PostgreSQL, and evict "
        "threads idle for MEMFILTER_IDLE_S from Redis once PostgreSQL holds them; settings from the environment ("
        + ", ".join(v for part in (Kafka, Redis, Postgres, Topics) for v in variables(part))
        + ", MEMFILTER_GROUP, MEMFILTER_WEB_BIND, MEMFILTER_SHUTDOWN_S; docs/postgres.md).",
    )
    p.add_argument("--web-port", type=int, help="port of the sink's web server (default MEMFILTER_SINK_WEB_PORT or 6069)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(parser=p, run=run)

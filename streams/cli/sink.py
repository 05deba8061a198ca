"""`memfilter sink`: persist-messages into PostgreSQL, idle threads out of Redis."""

from __future__ import annotations

import argparse
import sys

from memfilter.settings import Kafka, Postgres, Redis, Settings, Topics, variables


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from memfilter.runtime.sink import Sink
    from memfilter.settings import without_password

    settings = Settings.from_env()
    if not settings.postgres.url:
        print("memfilter sink: no POSTGRES_URL: set it to the PostgreSQL that holds the history (memfilter stack up exports the local one)", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        sink = Sink(settings)
        print(
            f"memfilter sink: {settings.topics.persist} into {without_password(settings.postgres.url)} (schema {settings.redis.prefix}); "
            f"threads idle {settings.postgres.idle_s:g} s leave Redis",
            file=sys.stderr,
            flush=True,
        )
        await sink.run(stop)
        print(f"memfilter sink: stopped; {sink.written} thread writes, {sink.evicted} threads evicted", file=sys.stderr)

    asyncio.run(main())
    return 0


def add(sub) -> None:
    p = sub.add_parser(
        "sink",
        help="write persist-messages into PostgreSQL, and take idle threads out of Redis",
        description="Consume persist-messages once the workers applied it, write each thread it names to PostgreSQL, and evict "
        "threads idle for MEMFILTER_IDLE_S from Redis once PostgreSQL holds them; settings from the environment ("
        + ", ".join(v for part in (Kafka, Redis, Postgres, Topics) for v in variables(part))
        + ", MEMFILTER_GROUP; docs/postgres.md).",
    )
    p.set_defaults(parser=p, run=run)

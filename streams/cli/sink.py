"""`memfilter sink`: persist-messages into PostgreSQL, idle threads out of Redis."""

from __future__ import annotations

import argparse
import logging
import sys

from memfilter.cli.common import consume_until_stopped, web_port_free
from memfilter.settings import Kafka, Postgres, Redis, Settings, Topics, variables

EXTRA = "worker"


def run(args: argparse.Namespace) -> int:
    import msgspec

    from memfilter.runtime.sink import Sink
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

    return consume_until_stopped(
        "sink",
        lambda: Sink(settings),
        settings,
        settings.postgres.sink_web_port,
        f"{settings.topics.persist} into {without_password(settings.postgres.url)} (schema {settings.redis.prefix}); "
        f"threads idle {settings.postgres.idle_s:g} s leave Redis",
        lambda sink: (
            f"{sink.metrics.value('memfilter_sink_threads_written_total'):.0f} thread writes, "
            f"{sink.metrics.value('memfilter_sink_threads_evicted_total'):.0f} threads evicted"
        ),
    )


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

"""`memfilter embedder`: saved messages into recall's vectors in PostgreSQL."""

from __future__ import annotations

import argparse
import logging
import sys

from memfilter.cli.common import consume_until_stopped, web_port_free
from memfilter.settings import Kafka, Postgres, Recall, Redis, Settings, Topics, variables

EXTRA = "agent"


def run(args: argparse.Namespace) -> int:
    import msgspec

    from memfilter.runtime.embedder import Embedder
    from memfilter.settings import without_password

    settings = Settings.from_env()
    if args.web_port is not None:
        settings = msgspec.structs.replace(settings, recall=msgspec.structs.replace(settings.recall, web_port=args.web_port))
    if not settings.postgres.url:
        print(
            "memfilter embedder: no POSTGRES_URL: set it to the PostgreSQL that holds the history (memfilter stack up exports the local one)", file=sys.stderr
        )
        return 2
    if reason := web_port_free(settings, settings.recall.web_port, "MEMFILTER_EMBEDDER_WEB_PORT", "embedder"):
        print(f"memfilter embedder: {reason}", file=sys.stderr)
        return 1
    logging.basicConfig(
        level=getattr(logging, {"crit": "CRITICAL", "warn": "WARNING"}.get(args.loglevel, args.loglevel.upper())),
        format="[%(asctime)s] [%(levelname)s] %(message)s",
    )
    r = settings.recall
    return consume_until_stopped(
        "embedder",
        lambda: Embedder(settings),
        settings,
        r.web_port,
        f"{settings.topics.persist}, once the sink wrote it, embedded by {r.model} at {r.base_url} into "
        f"{without_password(settings.postgres.url)} (schema {settings.redis.prefix})",
        lambda embedder: (
            f"{embedder.metrics.value('memfilter_embedder_messages_embedded_total'):.0f} messages embedded, "
            f"{embedder.metrics.value('memfilter_embedder_refused_total'):.0f} refused by the endpoint"
        ),
    )


def add(sub) -> None:
    p = sub.add_parser(
        "embedder",
        help="embed saved messages for semantic recall, into PostgreSQL",
        description="Consume persist-messages once the sink wrote it to PostgreSQL, embed each message it names that is in its "
        "thread's conversation, keep the vectors beside the history, and take out those of messages that left it; settings "
        "from the environment ("
        + ", ".join(v for part in (Kafka, Redis, Postgres, Topics, Recall) for v in variables(part))
        + ", OPENAI_API_KEY, MEMFILTER_WEB_BIND, MEMFILTER_SHUTDOWN_S; docs/recall.md).",
    )
    p.add_argument("--web-port", type=int, help="port of the embedder's web server (default MEMFILTER_EMBEDDER_WEB_PORT or 6070)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(parser=p, run=run)

"""`memfilter gateway`: run the HTTP backend of `useChat` (`memfilter.gateway`)."""

from __future__ import annotations

import argparse
import logging
import sys

from memfilter.cli.common import no_secret
from memfilter.settings import Gateway, Settings, variables

log = logging.getLogger("memfilter")

EXTRA = "gateway"


def run(args: argparse.Namespace) -> int:
    import msgspec
    from aiohttp import web

    from memfilter.gateway.outcomes import BadTopics
    from memfilter.gateway.server import Gateway as Server

    settings = Settings.from_env()
    if args.port is not None:
        settings = msgspec.structs.replace(settings, gateway=msgspec.structs.replace(settings.gateway, port=args.port))
    g = settings.gateway
    if g.auth == "jwt" and bool(g.jwt_key) == bool(g.jwks_url):
        print(
            "memfilter gateway: MEMFILTER_GATEWAY_AUTH=jwt needs one of MEMFILTER_GATEWAY_JWKS_URL (your identity provider's keys) "
            "or MEMFILTER_GATEWAY_JWT_KEY (an HS256 secret or a PEM public key)"
            + (", not both" if g.jwt_key else "; or MEMFILTER_GATEWAY_AUTH=header behind a proxy that sets the caller's resource"),
            file=sys.stderr,
        )
        return 2
    if reason := no_secret(settings):  # it verifies the replies the agent runner streams
        print(f"memfilter gateway: {reason}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO if args.loglevel == "info" else logging.WARNING, format="[%(asctime)s] [%(levelname)s] %(message)s")
    log.setLevel(logging.INFO)
    if g.auth == "header":
        log.warning(
            "memfilter gateway: MEMFILTER_GATEWAY_AUTH=header trusts the %s header as it comes: anyone who reaches "
            "http://%s:%d acts for any resource. Only behind a proxy that sets it, or on loopback.",
            g.resource_header,
            g.bind,
            g.port,
        )
    log.info("memfilter gateway on http://%s:%d (Kafka %s, auth %s)", g.bind, g.port, settings.kafka.bootstrap, g.auth)
    try:
        web.run_app(Server(settings).app(), host=g.bind, port=g.port, print=None, shutdown_timeout=settings.worker.shutdown_s)
    except BadTopics as e:
        print(f"memfilter gateway: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"memfilter gateway: cannot listen on {g.bind}:{g.port} ({e.strerror}): set MEMFILTER_GATEWAY_PORT or --port", file=sys.stderr)
        return 1
    log.info("memfilter gateway stopped")
    return 0


def add(sub) -> None:
    p = sub.add_parser(
        "gateway",
        help="run the HTTP backend of useChat: POST /api/chat publishes, waits for the decision and the reply, streams it",
        description="The backend a useChat app points its transport at; settings from the environment ("
        + ", ".join(variables(Gateway))
        + ", and KAFKA_BOOTSTRAP_SERVERS, REDIS_URL, MEMFILTER_REDIS_PREFIX, the topics, MEMFILTER_SECRET: it verifies the replies the agent runner streams).",
    )
    p.add_argument("--port", type=int, help="port to listen on (default MEMFILTER_GATEWAY_PORT or 6068)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(parser=p, run=run)

"""The `memfilter` command line: one entry point, a subcommand per thing a user does."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path


def _read_input(path: str | None) -> bytes:
    if path in (None, "-"):
        return sys.stdin.buffer.read()
    return Path(path).read_bytes()


def cmd_explain(args: argparse.Namespace) -> int:
    from streams.explain import UnusableInput, explain

    try:
        out = explain(_read_input(args.file))
    except (UnusableInput, OSError) as e:
        print(f"memfilter explain: {e}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(out + b"\n")
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    from streams import stack

    settings = stack.Settings.from_env()
    if args.partitions is not None:
        settings = dataclasses.replace(settings, partitions=args.partitions)
    try:
        if args.action == "up":
            print(stack.up(settings).exports())
        elif args.action == "down":
            print("stopped" if stack.down(settings) else f"no stack recorded in {settings.dir}")
        else:
            print(stack.status(settings))
    except stack.StackError as e:
        print(f"memfilter stack {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


def _reachable(settings) -> str | None:
    """None if Kafka and Redis answer, else a one-line reason."""
    import asyncio

    import redis

    from streams.stack import broker_answers

    try:
        redis.Redis.from_url(settings.redis_url, socket_connect_timeout=3).ping()
    except redis.RedisError as e:
        return f"Redis at {settings.redis_url} does not answer ({e}); start it (memfilter stack up) or set REDIS_URL"
    if not asyncio.run(broker_answers(settings.bootstrap, timeout=10)):
        return f"Kafka at {settings.bootstrap} does not answer; start it (memfilter stack up) or set KAFKA_BOOTSTRAP_SERVERS"
    return None


def cmd_worker(args: argparse.Namespace) -> int:
    import faust

    from streams.app import create_app
    from streams.settings import WorkerSettings

    settings = WorkerSettings.from_env()
    if args.web_port is not None:
        settings = dataclasses.replace(settings, web_port=args.web_port)
    reason = _reachable(settings)
    if reason is not None:
        print(f"memfilter worker: {reason}", file=sys.stderr)
        return 1
    app = create_app(settings)
    faust.Worker(app, loglevel=args.loglevel).execute_from_commandline()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfilter", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("explain", help="the filter's decision for a request and a history, without Kafka or Redis")
    p.add_argument("file", nargs="?", help="a case or JSON array of cases (default: stdin)")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser(
        "worker",
        help="run a processor worker (a Faust worker); several workers form one consumer group",
        description="Consume chat-requests and persist-messages; settings from the environment "
        "(KAFKA_BOOTSTRAP_SERVERS, REDIS_URL, MEMFILTER_GROUP, MEMFILTER_REDIS_PREFIX, MEMFILTER_TOPIC_*, "
        "MEMFILTER_BATCH_MAX, MEMFILTER_BATCH_WITHIN, MEMFILTER_MAX_BYTES, MEMFILTER_MAX_MESSAGES, MEMFILTER_WEB_PORT, "
        "MEMFILTER_SESSION_TIMEOUT, MEMFILTER_DATA_DIR).",
    )
    p.add_argument("--web-port", type=int, help="port of the worker's web server (default MEMFILTER_WEB_PORT or 6066)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(run=cmd_worker)

    p = sub.add_parser(
        "stack",
        help="a local Kafka (KRaft) and Redis for the product and its tests",
        description="Start, stop or show a local single-node Kafka broker and Redis server on loopback ports. "
        "Settings: MEMFILTER_STACK_DIR (default .stack/ in the checkout), MEMFILTER_KAFKA_PORT (9092), "
        "MEMFILTER_CONTROLLER_PORT (9093), MEMFILTER_REDIS_PORT (6379), MEMFILTER_PARTITIONS (8), "
        "MEMFILTER_MAVEN_SETTINGS (a Maven settings.xml, optional).",
    )
    p.add_argument("action", choices=["up", "down", "status"], help='up prints `export` lines: eval "$(memfilter stack up)"')
    p.add_argument("--partitions", type=int, help="partitions of each topic created by `up` (default 8)")
    p.set_defaults(run=cmd_stack)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

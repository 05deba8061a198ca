"""`memfilter publish`: ChatRequests from a file or stdin to chat-requests, checked first."""

from __future__ import annotations

import argparse
import sys

from memfilter.cli.common import plural, progress_bar, read_input
from memfilter.settings import Settings


def _requests_of(raw: bytes) -> list[tuple[str, bytes]]:
    """(where: "item N" of a JSON array or "line N" of JSON lines, request bytes)."""
    import msgspec

    if raw.lstrip().startswith(b"["):
        try:
            items = msgspec.json.decode(raw, type=list[msgspec.Raw])
        except msgspec.DecodeError as e:
            raise ValueError(f"input is not a JSON array: {e}") from None
        return [(f"item {n}", bytes(item)) for n, item in enumerate(items, 1)]
    return [(f"line {n}", line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]


def run(args: argparse.Namespace) -> int:
    import asyncio

    from memfilter.client import Client
    from memfilter.core.filter import Rejected, decode_request
    from memfilter.stack import broker_answers

    settings = Settings.from_env()
    try:
        numbered = _requests_of(read_input(args.file))
    except (OSError, ValueError) as e:
        print(f"memfilter publish: {e}", file=sys.stderr)
        return 2
    if not numbered:
        print("memfilter publish: no requests in the input (a JSON array or JSON lines of ChatRequests)", file=sys.stderr)
        return 2
    good, bad = [], []
    for where, value in numbered:
        try:
            decode_request(value, "publish", settings.policy.limits)
            good.append(value)
        except Rejected as e:
            bad.append(f"{where}: {e.type}: {e.message}")
    for line in bad:
        print(f"memfilter publish: {'skipped ' if args.skip_invalid else ''}{line}", file=sys.stderr)
    if bad and not args.skip_invalid:
        print(f"memfilter publish: {plural(len(bad), 'invalid request')}; nothing published (--skip-invalid sends the valid ones)", file=sys.stderr)
        return 1
    if not asyncio.run(broker_answers(settings.kafka.bootstrap, timeout=10)):
        print(f"memfilter publish: Kafka at {settings.kafka.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 1

    shown = progress_bar("published")

    async def send() -> list[str]:
        async with Client(settings.kafka.bootstrap, settings.topics, settings.policy.limits) as client:
            return await client.publish(good, on_sent=lambda n: shown(n, len(good)))

    print(f"published {plural(len(asyncio.run(send())), 'request')} to {settings.topics.requests}")
    return 0


def add(sub) -> None:
    p = sub.add_parser("publish", help="publish ChatRequests (JSON array or JSON lines) to chat-requests")
    p.add_argument("file", nargs="?", help="requests file (default: stdin)")
    p.add_argument("--skip-invalid", action="store_true", help="publish the valid requests and report the others")
    p.set_defaults(parser=p, run=run)

"""`memfilter tail`: follow filtered-inputs, or another of the product's topics."""

from __future__ import annotations

import argparse
import sys

from memfilter.cli.common import positive
from memfilter.settings import Settings


def _readable(topic_kind: str, record) -> str:
    import contextlib

    import msgspec

    from memfilter.core.filtered import BadReference, whole_messages

    key = record.key.decode(errors="replace") if record.key else "-"
    if topic_kind == "dlq":
        headers = {k: v.decode(errors="replace") for k, v in record.headers}
        return f"{key}  {headers.get('error.type')}: {headers.get('error.message')}"
    try:
        event = msgspec.json.decode(record.value)
    except msgspec.DecodeError:
        return f"{key}  (not JSON) {record.value[:80]!r}"
    if topic_kind == "streams":  # a chunk of a reply being made
        chunk = event.get("chunk") or {}
        said = chunk.get("delta") or chunk.get("finishReason") or chunk.get("errorText") or chunk.get("toolName") or ""
        return f"{key}  {event.get('requestId')}  {chunk.get('type')}  {said}".rstrip()
    if topic_kind == "stops":
        return f"{key}  stop {event.get('requestId') or '(the reply in flight)'} for {event.get('resourceId')}"
    messages = event.get("messages", [])
    if topic_kind == "filtered":  # format 2 refers into the context
        with contextlib.suppress(BadReference):
            messages = whole_messages(messages, event.get("context", []))
    ids = [m.get("id", "?") for m in messages]
    if topic_kind == "filtered":
        dropped = len(event.get("dropped", []))
        return f"{key}  {event.get('requestId')}  {event.get('outcome'):<26} kept {len(ids)} {ids}  dropped {dropped}"
    return f"{key}  {event.get('requestId')}  {len(ids)} messages {ids}"


def _with_meta(record, readable: str, as_json: bool) -> str:
    """The event with its record's topic, partition, offset, timestamp, key and headers (--meta):
    one JSON object (the value under "value", as a string if it is not JSON), or two lines."""
    import msgspec

    key = record.key.decode(errors="replace") if record.key is not None else None
    headers = {k: v.decode(errors="replace") for k, v in record.headers}
    if not as_json:
        shown = "  ".join(f"{k}={v}" for k, v in headers.items())
        return f"{record.topic}-{record.partition}@{record.offset}  key={key or '-'}  {shown}".rstrip() + f"\n    {readable}"
    try:
        msgspec.json.decode(record.value)
        value = msgspec.Raw(record.value)
    except (msgspec.DecodeError, TypeError):  # a dead letter keeps what the client sent, JSON or not
        value = record.value.decode(errors="replace") if record.value is not None else None
    meta = {"topic": record.topic, "partition": record.partition, "offset": record.offset, "timestamp": record.timestamp}
    return msgspec.json.encode({**meta, "key": key, "headers": headers, "value": value}).decode()


def run(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    from memfilter.client import Client
    from memfilter.stack import broker_answers

    settings = Settings.from_env()
    kinds = {v: k for k, v in msgspec.structs.asdict(settings.topics).items()}
    topic = args.topic or settings.topics.filtered
    if topic not in kinds:
        print(f"memfilter tail: {topic} is not one of the product's topics {sorted(kinds)}", file=sys.stderr)
        return 2
    if not asyncio.run(broker_answers(settings.kafka.bootstrap, timeout=10)):
        print(f"memfilter tail: Kafka at {settings.kafka.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 1

    async def follow() -> None:
        shown = 0
        client = Client(settings.kafka.bootstrap, settings.topics)
        async for record in client.records(topic, args.thread, args.from_beginning, args.idle_ms):
            value = record.value.decode(errors="replace") if args.json else _readable(kinds[topic], record)
            print(_with_meta(record, value, args.json) if args.meta else value, flush=True)
            shown += 1
            if args.max is not None and shown >= args.max:
                return

    try:
        asyncio.run(follow())
    except KeyboardInterrupt:
        pass
    return 0


def add(sub) -> None:
    p = sub.add_parser("tail", help="follow filtered-inputs (or another of the product's topics)")
    p.add_argument("topic", nargs="?", help="topic name (default: filtered-inputs)")
    p.add_argument("--json", action="store_true", help="print each event's value as one line of JSON")
    p.add_argument("--thread", help="only this thread's events")
    p.add_argument("--from-beginning", action="store_true", help="start at the topic's first event")
    p.add_argument("--max", type=positive, help="stop after this many events")
    p.add_argument("--idle-ms", type=positive, help="stop after this long without an event")
    p.add_argument("--meta", action="store_true", help="show each record's topic, partition, offset, key and headers too")
    p.set_defaults(parser=p, run=run)

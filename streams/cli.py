"""The `memfilter` command line: one entry point, a subcommand per thing a user does."""

from __future__ import annotations

import argparse
import importlib.metadata
import gc
import dataclasses
import os
import sys
from pathlib import Path


def _read_input(path: str | None) -> bytes:
    if path in (None, "-"):
        return sys.stdin.buffer.read()
    return Path(path).read_bytes()


def cmd_explain(args: argparse.Namespace) -> int:
    from streams.explain import UnusableInput, explain

    try:
        out = explain(_read_input(args.file), os.environ.get("MEMFILTER_SECRET", "").encode())
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
            print(stack.up(settings).exports(stack.secret(settings)))
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


def _no_secret(settings) -> str | None:
    """Why MEMFILTER_SECRET will not do, or None. Server-assigned message ids and the
    processor's signature on its persist events are keyed by it: every worker, replay and
    rebuild of a deployment needs the same one, and no client may know it."""
    if len(settings.secret) < 16:
        return (
            "MEMFILTER_SECRET must be set to the deployment's secret, 16 characters or more "
            "(make one: python3 -c 'import secrets; print(secrets.token_hex(32))'; `memfilter stack up` exports the local stack's)"
        )
    return None


def cmd_worker(args: argparse.Namespace) -> int:
    import faust

    from streams.app import create_app
    from streams.settings import WorkerSettings

    settings = WorkerSettings.from_env()
    if args.web_port is not None:
        settings = dataclasses.replace(settings, web_port=args.web_port)
    reason = _no_secret(settings) or _reachable(settings)
    if reason is not None:
        print(f"memfilter worker: {reason}", file=sys.stderr)
        return 1
    app = create_app(settings)
    gc.freeze()  # what start-up made stays: the collector need not scan it on every batch
    worker = faust.Worker(app, loglevel=args.loglevel)
    # Faust's terminal spinner sets the root logger to DEBUG so that every record spins it:
    # aiokafka then formats a debug line per record sent, 6% of the worker's time.
    worker.spinner = None
    worker.execute_from_commandline()
    return 0


def _requests_of(raw: bytes) -> list[tuple[int, bytes]]:
    """(line or item number, request bytes) from a JSON array or JSON lines."""
    import msgspec

    if raw.lstrip().startswith(b"["):
        try:
            items = msgspec.json.decode(raw, type=list[msgspec.Raw])
        except msgspec.DecodeError as e:
            raise ValueError(f"input is not a JSON array: {e}") from None
        return [(n, bytes(item)) for n, item in enumerate(items, 1)]
    return [(n, line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]


def _progress(label: str):
    """A progress line on stderr for long runs (every 1,000 items and at the end)."""

    def show(n: int, total: int) -> None:
        if total >= 1000 and (n % 1000 == 0 or n == total):
            print(f"\r{label} {n:,}/{total:,}", end="" if n < total else "\n", file=sys.stderr, flush=True)

    return show


def cmd_publish(args: argparse.Namespace) -> int:
    import asyncio

    from streams.client import Client
    from streams.filter import Rejected, decode_request
    from streams.settings import WorkerSettings
    from streams.stack import broker_answers

    settings = WorkerSettings.from_env()
    try:
        numbered = _requests_of(_read_input(args.file))
    except (OSError, ValueError) as e:
        print(f"memfilter publish: {e}", file=sys.stderr)
        return 2
    good, bad = [], []
    for n, value in numbered:
        try:
            decode_request(value, "publish", settings.limits)
            good.append(value)
        except Rejected as e:
            bad.append(f"line {n}: {e.type}: {e.message}")
    if bad and not args.skip_invalid:
        print(f"memfilter publish: {bad[0]} (nothing published; --skip-invalid sends the valid ones)", file=sys.stderr)
        return 1
    for line in bad:
        print(f"memfilter publish: skipped {line}", file=sys.stderr)
    if not asyncio.run(broker_answers(settings.bootstrap, timeout=10)):
        print(f"memfilter publish: Kafka at {settings.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 1

    shown = _progress("published")

    async def send() -> int:
        async with Client(settings.bootstrap, settings.topics) as client:
            return await client.publish(good, on_sent=lambda n: shown(n, len(good)))

    print(f"published {asyncio.run(send())} requests to {settings.topics.requests}")
    return 0


def _readable(topic_kind: str, record) -> str:
    import msgspec

    key = record.key.decode(errors="replace") if record.key else "-"
    if topic_kind == "dlq":
        headers = {k: v.decode(errors="replace") for k, v in record.headers}
        return f"{key}  {headers.get('error.type')}: {headers.get('error.message')}"
    try:
        event = msgspec.json.decode(record.value)
    except msgspec.DecodeError:
        return f"{key}  (not JSON) {record.value[:80]!r}"
    ids = [m.get("id", "?") for m in event.get("messages", [])]
    if topic_kind == "filtered":
        dropped = len(event.get("dropped", []))
        return f"{key}  {event.get('requestId')}  {event.get('outcome'):<26} kept {len(ids)} {ids}  dropped {dropped}"
    return f"{key}  {event.get('requestId')}  {len(ids)} messages {ids}"


def cmd_tail(args: argparse.Namespace) -> int:
    import asyncio

    from streams.client import Client
    from streams.settings import WorkerSettings
    from streams.stack import broker_answers

    settings = WorkerSettings.from_env()
    kinds = {v: k for k, v in vars(settings.topics).items()}
    topic = args.topic or settings.topics.filtered
    if topic not in kinds:
        print(f"memfilter tail: {topic} is not one of the product's topics {sorted(kinds)}", file=sys.stderr)
        return 2
    if not asyncio.run(broker_answers(settings.bootstrap, timeout=10)):
        print(f"memfilter tail: Kafka at {settings.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 1

    async def follow() -> None:
        shown = 0
        client = Client(settings.bootstrap, settings.topics)
        async for record in client.records(topic, args.thread, args.from_beginning, args.idle_ms):
            print(record.value.decode(errors="replace") if args.json else _readable(kinds[topic], record), flush=True)
            shown += 1
            if args.max is not None and shown >= args.max:
                return

    try:
        asyncio.run(follow())
    except KeyboardInterrupt:
        pass
    return 0


def _run_or_explain(command: str, settings, coroutine):
    """Run `coroutine`; a missing topic, or a Kafka or Redis that does not answer, is one line
    on stderr and exit 1 instead of a traceback."""
    import asyncio

    from aiokafka.errors import KafkaConnectionError
    from redis.exceptions import ConnectionError as RedisConnectionError

    from streams.replay import TopicMissing

    try:
        return asyncio.run(coroutine)
    except TopicMissing as e:
        reason = f"{e}; create it (`memfilter stack up` does) or set MEMFILTER_TOPIC_*"
    except KafkaConnectionError:
        reason = f"Kafka at {settings.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS"
    except RedisConnectionError as e:
        reason = f"Redis does not answer ({e}); set REDIS_URL or --redis-url"
    print(f"memfilter {command}: {reason}", file=sys.stderr)
    raise SystemExit(1)


def _store(url: str, prefix: str):
    from streams.history import HistoryStore, connect

    return HistoryStore(connect(url), prefix)


def cmd_history(args: argparse.Namespace) -> int:
    import msgspec

    from streams.replay import rebuild
    from streams.settings import WorkerSettings

    settings = WorkerSettings.from_env()
    url, prefix = args.redis_url or settings.redis_url, args.prefix or settings.redis_prefix

    async def show() -> int:
        store = _store(url, prefix)
        rows = await store.thread_rows(args.thread)
        if not rows:
            print(f"memfilter history show: thread {args.thread} has no stored messages under prefix {prefix}", file=sys.stderr)
            return 1
        for row in rows:
            if args.json:
                print(row.decode())
                continue
            m = msgspec.json.decode(row)
            parts = (m.get("content") or {}).get("parts") or [] if isinstance(m.get("content"), dict) else []
            text = " ".join(str(p.get("text", f"[{p.get('type')}]")) for p in parts if isinstance(p, dict)) or str(m.get("content"))[:80]
            print(f"{m.get('createdAt', ''):24}  {m.get('id', ''):20}  {m.get('role', ''):9}  {text[:100]}")
        return 0

    async def rebuild_all() -> int:
        applied, refused = await rebuild(settings.bootstrap, settings.topics, _store(url, prefix), settings.secret, _progress("applied"))
        print(f"rebuilt history under prefix {prefix} from {applied + refused:,} events of {settings.topics.persist} ({refused:,} refused)")
        return 0

    if args.action == "rebuild" and (reason := _no_secret(settings)):
        print(f"memfilter history rebuild: {reason}", file=sys.stderr)
        return 2
    return _run_or_explain(f"history {args.action}", settings, show() if args.action == "show" else rebuild_all())


def cmd_replay(args: argparse.Namespace) -> int:
    from streams.replay import parse_position, replay
    from streams.settings import WorkerSettings

    settings = WorkerSettings.from_env()
    try:
        start, end = parse_position(args.start), parse_position(args.end)
    except ValueError as e:
        print(f"memfilter replay: {e}", file=sys.stderr)
        return 2
    if reason := _no_secret(settings):
        print(f"memfilter replay: {reason}", file=sys.stderr)
        return 2
    url = args.redis_url or settings.redis_url
    report = _run_or_explain(
        "replay",
        settings,
        replay(
            settings.bootstrap, settings.topics, lambda prefix: _store(url, prefix), settings.secret, start, end, settings.limits, _progress("replayed")
        ),
    )
    for d in report.differences:
        print(f"DIFFERENT {d.requestId} (thread {d.threadId}, {d.source})")
        for line in d.diff:
            print(f"    {line}")
    print(f"replayed {report.requests:,} requests: {report.identical:,} identical, {report.different:,} different")
    if args.report:
        with open(args.report, "wb") as f:
            f.write(report.to_json())
    return 1 if args.strict and report.different else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfilter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('memfilter')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("explain", help="the filter's decision for a request and a history, without Kafka or Redis")
    p.add_argument("file", nargs="?", help="a case or JSON array of cases (default: stdin)")
    p.set_defaults(run=cmd_explain)

    p = sub.add_parser(
        "worker",
        help="run a processor worker (a Faust worker); several workers form one consumer group",
        description="Consume chat-requests and persist-messages; settings from the environment "
        "(KAFKA_BOOTSTRAP_SERVERS, REDIS_URL, MEMFILTER_GROUP, MEMFILTER_REDIS_PREFIX, MEMFILTER_TOPIC_*, "
        "MEMFILTER_BATCH_MAX, MEMFILTER_BATCH_WITHIN, MEMFILTER_MAX_BYTES, MEMFILTER_MAX_MESSAGES, MEMFILTER_WEB_PORT, MEMFILTER_WEB_BIND, "
        "MEMFILTER_SESSION_TIMEOUT, MEMFILTER_DATA_DIR).",
    )
    p.add_argument("--web-port", type=int, help="port of the worker's web server (default MEMFILTER_WEB_PORT or 6066)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(run=cmd_worker)

    p = sub.add_parser("publish", help="publish ChatRequests (JSON array or JSON lines) to chat-requests")
    p.add_argument("file", nargs="?", help="requests file (default: stdin)")
    p.add_argument("--skip-invalid", action="store_true", help="publish the valid requests and report the others")
    p.set_defaults(run=cmd_publish)

    p = sub.add_parser("tail", help="follow filtered-inputs (or another of the product's topics)")
    p.add_argument("topic", nargs="?", help="topic name (default: filtered-inputs)")
    p.add_argument("--json", action="store_true", help="print each event's value as one line of JSON")
    p.add_argument("--thread", help="only this thread's events")
    p.add_argument("--from-beginning", action="store_true", help="start at the topic's first event")
    p.add_argument("--max", type=int, help="stop after this many events")
    p.add_argument("--idle-ms", type=int, help="stop after this long without an event")
    p.set_defaults(run=cmd_tail)

    p = sub.add_parser("history", help="show a stored thread, or rebuild history from persist-messages")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="a stored thread in save order")
    show.add_argument("thread", help="thread id")
    show.add_argument("--json", action="store_true", help="each stored row as one line of JSON")
    rebuild = actions.add_parser("rebuild", help="replace the history under a prefix with persist-messages applied as it was live")
    for q in (show, rebuild):
        q.add_argument("--redis-url", help="Redis to read or rebuild into (default REDIS_URL)")
        q.add_argument("--prefix", help="key prefix (default MEMFILTER_REDIS_PREFIX or mf)")
        q.set_defaults(run=cmd_history)

    p = sub.add_parser(
        "replay",
        help="audit: decide a range of chat-requests again on history rebuilt from persist-messages, compare with what was recorded",
    )
    p.add_argument("--from", dest="start", help="first request: offset, partition:offset list, or ISO time (default: the beginning)")
    p.add_argument("--to", dest="end", help="end of the range, exclusive, in the same forms (default: the end)")
    p.add_argument("--report", help="write the report as JSON to this file")
    p.add_argument("--strict", action="store_true", help="exit 1 when any request differs")
    p.add_argument("--redis-url", help="Redis for the isolated rebuild (default REDIS_URL; keys under a fresh replay-* prefix, deleted after)")
    p.set_defaults(run=cmd_replay)

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

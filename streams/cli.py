"""The `memfilter` command line: one entry point, a subcommand per thing a user does."""

from __future__ import annotations

import argparse
import importlib.metadata
import gc
import logging
import os
import sys
from pathlib import Path

from streams.settings import AGENT_VARIABLES, STACK_VARIABLES, VARIABLES, Settings, SettingError


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

    settings = stack.Settings.of(Settings.from_env(), args.partitions, args.brokers, args.redis_cluster)
    try:
        if args.action == "up":
            print(stack.up(settings).exports(settings, stack.secret(settings)))
        elif args.action == "down":
            print("stopped" if stack.down(settings) else f"no stack recorded in {settings.dir}")
        else:
            text, all_running = stack.status(settings)
            print(text)
            return 0 if all_running else 3
    except stack.StackError as e:
        print(f"memfilter stack {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


def _reachable(settings, redis_too: bool = True) -> str | None:
    """None if Kafka (and Redis, if `redis_too`) answer, else a one-line reason."""
    import asyncio

    import redis

    from streams.history import connect
    from streams.stack import broker_answers

    async def ping() -> None:
        client = connect(settings.redis_url, socket_connect_timeout=3)
        try:
            await client.ping()
        finally:
            await client.aclose()

    try:
        if redis_too:
            asyncio.run(ping())
    except (redis.RedisError, OSError) as e:
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


def _web_port_free(settings, port: int | None = None, variable: str = "MEMFILTER_WEB_PORT", what: str = "worker") -> str | None:
    """None if the web server can listen on `port` (the worker's by default), else a one-line reason."""
    import socket

    port = settings.web_port if port is None else port
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((settings.web_bind, port))
            return None
        except OSError as e:
            return (
                f"cannot serve the web server on {settings.web_bind}:{port} ({e.strerror}): "
                f"each {what} on a host needs its own port: --web-port or {variable}"
            )


def cmd_worker(args: argparse.Namespace) -> int:
    import msgspec

    from streams.app import create_app
    from streams.logs import Worker

    settings = Settings.from_env()
    if args.web_port is not None:
        settings = msgspec.structs.replace(settings, web_port=args.web_port)
    reason = _no_secret(settings) or _web_port_free(settings) or _reachable(settings)
    if reason is not None:
        print(f"memfilter worker: {reason}", file=sys.stderr)
        return 1
    app = create_app(settings)
    gc.freeze()  # what start-up made stays: the collector need not scan it on every batch
    worker = Worker(app, loglevel=args.loglevel)
    worker.execute_from_commandline()
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    import msgspec

    from streams.agent import create_agent_app
    from streams.logs import Worker

    settings = Settings.from_env()
    if args.web_port is not None:
        settings = msgspec.structs.replace(settings, agent_web_port=args.web_port)
    if args.backend is not None:
        settings = msgspec.structs.replace(settings, agent_backend=args.backend)
    reason = _no_secret(settings) or _web_port_free(settings, settings.agent_web_port, "MEMFILTER_AGENT_WEB_PORT", "agent runner") or _reachable(settings, redis_too=False)
    if reason is not None:
        print(f"memfilter agent: {reason}", file=sys.stderr)
        return 1
    Worker(create_agent_app(settings), loglevel=args.loglevel).execute_from_commandline()
    return 0


def cmd_converse(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from streams.conversations import DEMO_SCRIPT, Conversation, Driver, describe

    settings = Settings.from_env()
    reason = _reachable(settings, redis_too=False)
    if reason is not None:
        print(f"memfilter converse: {reason}", file=sys.stderr)
        return 1
    conversation = Conversation(args.thread or f"demo-thread-{int(time.time())}", args.resource, args.texts or DEMO_SCRIPT)
    try:
        asyncio.run(Driver(settings.bootstrap, settings.topics, args.timeout).run([conversation]))
    except TimeoutError as e:
        print(f"memfilter converse: {e}", file=sys.stderr)
        return 1
    finally:
        print(f"thread {conversation.thread} of resource {conversation.resource}: each request, what the model saw, its answer")
        for turn in conversation.turns:
            print(f"> {describe(turn.view[-1])}")
            if turn.superseded:
                print(f"    superseded (out of the conversation, still stored): {', '.join(turn.superseded)}")
            print(f"    the model saw {len(turn.context)} messages: " + " | ".join(describe(m, 40) for m in turn.context))
            if turn.reply is not None:
                print(f"< {describe(turn.reply)}")
    return 0


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


def _progress(label: str):
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


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def cmd_publish(args: argparse.Namespace) -> int:
    import asyncio

    from streams.client import Client
    from streams.filter import Rejected, decode_request
    from streams.stack import broker_answers

    settings = Settings.from_env()
    try:
        numbered = _requests_of(_read_input(args.file))
    except (OSError, ValueError) as e:
        print(f"memfilter publish: {e}", file=sys.stderr)
        return 2
    if not numbered:
        print("memfilter publish: no requests in the input (a JSON array or JSON lines of ChatRequests)", file=sys.stderr)
        return 2
    good, bad = [], []
    for where, value in numbered:
        try:
            decode_request(value, "publish", settings.limits)
            good.append(value)
        except Rejected as e:
            bad.append(f"{where}: {e.type}: {e.message}")
    for line in bad:
        print(f"memfilter publish: {'skipped ' if args.skip_invalid else ''}{line}", file=sys.stderr)
    if bad and not args.skip_invalid:
        print(f"memfilter publish: {_plural(len(bad), 'invalid request')}; nothing published (--skip-invalid sends the valid ones)", file=sys.stderr)
        return 1
    if not asyncio.run(broker_answers(settings.bootstrap, timeout=10)):
        print(f"memfilter publish: Kafka at {settings.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS", file=sys.stderr)
        return 1

    shown = _progress("published")

    async def send() -> list[str]:
        async with Client(settings.bootstrap, settings.topics, settings.limits) as client:
            return await client.publish(good, on_sent=lambda n: shown(n, len(good)))

    print(f"published {_plural(len(asyncio.run(send())), 'request')} to {settings.topics.requests}")
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


def _with_meta(record, readable: str, as_json: bool) -> str:
    """The event with its record's topic, partition, offset, timestamp, key and headers (--meta):
    one JSON object (the value under "value", as a string if it is not JSON), or two lines."""
    import msgspec

    key = record.key.decode(errors="replace") if record.key is not None else None
    headers = {k: v.decode(errors="replace") for k, v in record.headers}
    if not as_json:
        return f"{record.topic}-{record.partition}@{record.offset}  key={key}  headers={headers}\n    {readable}"
    try:
        msgspec.json.decode(record.value)
        value = msgspec.Raw(record.value)
    except (msgspec.DecodeError, TypeError):  # a dead letter keeps what the client sent, JSON or not
        value = record.value.decode(errors="replace") if record.value is not None else None
    meta = {"topic": record.topic, "partition": record.partition, "offset": record.offset, "timestamp": record.timestamp}
    return msgspec.json.encode({**meta, "key": key, "headers": headers, "value": value}).decode()


def cmd_tail(args: argparse.Namespace) -> int:
    import asyncio

    from streams.client import Client
    from streams.stack import broker_answers

    settings = Settings.from_env()
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


def _run_or_explain(command: str, settings, coroutine):
    """Run `coroutine`; a missing topic, or a Kafka or Redis that does not answer, is one line
    on stderr and exit 1 instead of a traceback."""
    import asyncio

    from aiokafka.errors import KafkaConnectionError
    from redis.exceptions import RedisError

    from streams.recorded import TopicMissing

    try:
        return asyncio.run(coroutine)
    except TopicMissing as e:
        reason = f"{e}; create it (`memfilter stack up` does) or set MEMFILTER_TOPIC_*"
    except KafkaConnectionError:
        reason = f"Kafka at {settings.bootstrap} does not answer; set KAFKA_BOOTSTRAP_SERVERS"
    except (RedisError, TimeoutError) as e:
        reason = f"Redis does not answer as Redis ({type(e).__name__}: {e}); set REDIS_URL or --redis-url"
    print(f"memfilter {command}: {reason}", file=sys.stderr)
    raise SystemExit(1)


def _store(url: str, prefix: str, settings: Settings):
    from streams.history import HistoryStore, connect

    return HistoryStore(connect(url), prefix, processed_ttl=settings.processed_ttl, retry_window=settings.retry_window)


async def _workers_of(settings) -> int:
    """How many workers the group has now (members of its consumer group)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap, request_timeout_ms=10_000)
    await admin.start()
    try:
        described = await admin.describe_consumer_groups([settings.group])
        return sum(len(g["members"]) for d in described for g in d.to_object()["groups"])
    finally:
        await admin.close()


async def _refuse_live(settings, url: str, prefix: str, doing: str) -> str | None:
    """Why `doing` may not touch `prefix` in the Redis at `url` now: the workers run on it."""
    if (url, prefix) != (settings.redis_url, settings.redis_prefix):
        return None
    workers = await _workers_of(settings)
    if workers:
        return (
            f"{_plural(workers, 'worker')} of group {settings.group} {'runs' if workers == 1 else 'run'} on prefix {prefix}; "
            f"stop {'it' if workers == 1 else 'them'} before you {doing} it, "
            "or use another prefix (--prefix NEW; point the workers at it with MEMFILTER_REDIS_PREFIX)"
        )
    return None


def cmd_history(args: argparse.Namespace) -> int:
    import msgspec

    from streams.history import prefixes
    from streams.replay import rebuild

    settings = Settings.from_env()
    url, prefix = args.redis_url or settings.redis_url, getattr(args, "prefix", None) or settings.redis_prefix

    async def show() -> int:
        store = _store(url, prefix, settings)
        rows, superseded = await store.thread_rows(args.thread), await store.superseded_rows(args.thread)
        if not rows and not superseded:
            print(f"memfilter history show: thread {args.thread} has no stored messages under prefix {prefix}", file=sys.stderr)
            return 1
        for by, row in [(None, row) for row in rows] + sorted(superseded, key=lambda s: msgspec.json.decode(s[1]).get("createdAt") or ""):
            if args.json:
                print(row.decode() if by is None else msgspec.json.encode({"supersededBy": by, "row": msgspec.Raw(row)}).decode())
                continue
            m = msgspec.json.decode(row)
            parts = (m.get("content") or {}).get("parts") or [] if isinstance(m.get("content"), dict) else []
            text = " ".join(str(p.get("text", f"[{p.get('type')}]")) for p in parts if isinstance(p, dict)) or str(m.get("content"))[:80]
            mark = "" if by is None else f"  (superseded by request {by})"
            print(f"{m.get('createdAt', ''):24}  {m.get('id', ''):20}  {m.get('role', ''):9}  {text[:100]}{mark}")
        return 0

    async def rebuild_all() -> int:
        if reason := await _refuse_live(settings, url, prefix, "rebuild"):
            print(f"memfilter history rebuild: {reason}", file=sys.stderr)
            return 1
        print(f"memfilter history rebuild: replacing the history under prefix {prefix} with {settings.topics.persist}", file=sys.stderr)
        applied, refused = await rebuild(settings.bootstrap, settings.topics, _store(url, prefix, settings), settings.secret, _progress("applied"))
        print(f"rebuilt history under prefix {prefix} from {applied + refused:,} events of {settings.topics.persist} ({refused:,} refused)")
        return 0

    async def list_prefixes() -> int:
        found = await prefixes(_store(url, prefix, settings).redis)
        for name, keys in sorted(found.items()):
            print(f"{name}  {_plural(keys, 'key')}{'  (the workers’ prefix: MEMFILTER_REDIS_PREFIX)' if name == settings.redis_prefix else ''}")
        return 0

    async def drop() -> int:
        if reason := await _refuse_live(settings, url, prefix, "drop"):
            print(f"memfilter history drop: {reason}", file=sys.stderr)
            return 1
        print(f"dropped prefix {prefix}: {_plural(await _store(url, prefix, settings).drop(), 'key')} deleted")
        return 0

    if args.action == "rebuild" and (reason := _no_secret(settings)):
        print(f"memfilter history rebuild: {reason}", file=sys.stderr)
        return 2
    run = {"show": show, "rebuild": rebuild_all, "prefixes": list_prefixes, "drop": drop}[args.action]
    return _run_or_explain(f"history {args.action}", settings, run())


def cmd_replay(args: argparse.Namespace) -> int:
    from streams.recorded import parse_position
    from streams.replay import replay

    settings = Settings.from_env()
    try:
        start, end = parse_position(args.start), parse_position(args.end)
    except ValueError as e:
        print(f"memfilter replay: {e}", file=sys.stderr)
        return 2
    if reason := _no_secret(settings):
        print(f"memfilter replay: {reason}", file=sys.stderr)
        return 2
    if args.report and not os.access(Path(args.report).resolve().parent, os.W_OK):
        print(f"memfilter replay: cannot write the report {args.report}: its folder does not exist or is not writable", file=sys.stderr)
        return 2
    url = args.redis_url or settings.redis_url
    report = _run_or_explain(
        "replay",
        settings,
        replay(
            settings.bootstrap, settings.topics, lambda prefix: _store(url, prefix, settings), settings.secret,
            start,
            end,
            settings.limits,
            _progress("replayed"),
            settings.history_messages,
            settings.edits == "on",
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


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfilter", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('memfilter')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("explain", help="the filter's decision for a request and a history, without Kafka or Redis")
    p.add_argument("file", nargs="?", help="a case or JSON array of cases (default: stdin)")
    p.set_defaults(parser=p, run=cmd_explain)

    p = sub.add_parser(
        "worker",
        help="run a processor worker (a Faust worker); several workers form one consumer group",
        description="Consume chat-requests and persist-messages; settings from the environment ("
        + ", ".join(v for v in VARIABLES.values() if v not in STACK_VARIABLES | AGENT_VARIABLES)
        + "; the README's settings table says what each does).",
    )
    p.add_argument("--web-port", type=int, help="port of the worker's web server (default MEMFILTER_WEB_PORT or 6066)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(parser=p, run=cmd_worker)

    p = sub.add_parser(
        "agent",
        help="run the reference agent runner: answer filtered inputs with a model, save replies to persist-messages",
        description="Consume filtered-inputs, send each context that asks for an answer to the model, publish the reply "
        "as a PersistMessages event; settings from the environment (" + ", ".join(sorted(AGENT_VARIABLES))
        + ", and KAFKA_BOOTSTRAP_SERVERS, MEMFILTER_SECRET, the topics, MEMFILTER_SESSION_TIMEOUT, MEMFILTER_BATCH_WITHIN).",
    )
    p.add_argument("--backend", choices=["echo", "openai"], help="the model (default MEMFILTER_AGENT_BACKEND or echo)")
    p.add_argument("--web-port", type=int, help="port of the runner's web server (default MEMFILTER_AGENT_WEB_PORT or 6067)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(parser=p, run=cmd_agent)

    p = sub.add_parser(
        "converse",
        help="a scripted useChat-like client: send each text as a turn (full echo, UI messages), wait for the saved reply, print what the model saw",
    )
    p.add_argument("texts", nargs="*", help="the user's turns; '/tool NAME {json}' asks the echo model for a client tool call, '/regenerate' regenerates the last answer, '/edit TEXT' edits the last user message (default: a short demo of each)")
    p.add_argument("--thread", help="thread id (default demo-thread-<time>)")
    p.add_argument("--resource", default="demo-user", help="resource id (default demo-user)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each filtered input and reply (default 60)")
    p.set_defaults(parser=p, run=cmd_converse)

    p = sub.add_parser("publish", help="publish ChatRequests (JSON array or JSON lines) to chat-requests")
    p.add_argument("file", nargs="?", help="requests file (default: stdin)")
    p.add_argument("--skip-invalid", action="store_true", help="publish the valid requests and report the others")
    p.set_defaults(parser=p, run=cmd_publish)

    p = sub.add_parser("tail", help="follow filtered-inputs (or another of the product's topics)")
    p.add_argument("topic", nargs="?", help="topic name (default: filtered-inputs)")
    p.add_argument("--json", action="store_true", help="print each event's value as one line of JSON")
    p.add_argument("--thread", help="only this thread's events")
    p.add_argument("--from-beginning", action="store_true", help="start at the topic's first event")
    p.add_argument("--max", type=_positive, help="stop after this many events")
    p.add_argument("--idle-ms", type=_positive, help="stop after this long without an event")
    p.add_argument("--meta", action="store_true", help="show each record's topic, partition, offset, key and headers too")
    p.set_defaults(parser=p, run=cmd_tail)

    p = sub.add_parser("history", help="show a stored thread, rebuild history from persist-messages, list or drop key prefixes")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="a stored thread: its conversation in save order, then its superseded rows, marked")
    show.add_argument("thread", help="thread id")
    show.add_argument("--json", action="store_true", help="each stored row as one line of JSON, as stored; a superseded one as {\"supersededBy\": REQUEST, \"row\": ROW}")
    rebuild = actions.add_parser(
        "rebuild", help="replace the history under a prefix with persist-messages applied as it was live (refused while workers run on it)"
    )
    listed = actions.add_parser("prefixes", help="the key prefixes holding a history in Redis (leftovers of rebuilds and replays too)")
    drop = actions.add_parser("drop", help="delete every key under a prefix (refused while workers run on it)")
    drop.add_argument("--prefix", required=True, help="the prefix to delete (never a default)")
    for q in (show, rebuild, listed, drop):
        q.add_argument("--redis-url", help="Redis to use (default REDIS_URL)")
        if q is not drop:
            q.add_argument("--prefix", help="key prefix (default MEMFILTER_REDIS_PREFIX or mf)")
        q.set_defaults(parser=q, run=cmd_history)

    p = sub.add_parser(
        "replay",
        help="audit: decide a range of chat-requests again on history rebuilt from persist-messages, compare with what was recorded",
    )
    p.add_argument(
        "--from",
        dest="start",
        help="first request: an offset of every partition (100: offset 100 of each), partition:offset,... or an ISO time (default: the beginning)",
    )
    p.add_argument("--to", dest="end", help="end of the range, exclusive, in the same forms (default: the end)")
    p.add_argument("--report", help="write the report as JSON to this file")
    p.add_argument("--strict", action="store_true", help="exit 1 when any request differs")
    p.add_argument("--redis-url", help="Redis for the isolated rebuild (default REDIS_URL; keys under a fresh replay-* prefix, deleted after)")
    p.set_defaults(parser=p, run=cmd_replay)

    p = sub.add_parser(
        "stack",
        help="a local Kafka (KRaft) and Redis for the product and its tests",
        description="Start, stop or show a local Kafka (one broker, or a cluster of 3) and Redis (one server, or a cluster "
        "of 3 masters with a replica each) on loopback ports. "
        "`up` starts what is not running (a service that died is started again on its data); `status` exits 3 "
        "unless everything runs. Settings: MEMFILTER_STACK_DIR (default .stack/ in the checkout), MEMFILTER_KAFKA_PORT (9092), "
        "MEMFILTER_CONTROLLER_PORT (9093), MEMFILTER_REDIS_PORT (6379), MEMFILTER_PARTITIONS (8), "
        "MEMFILTER_MAVEN_SETTINGS (a Maven settings.xml, optional).",
    )
    p.add_argument("action", choices=["up", "down", "status"], help='up prints `export` lines: eval "$(memfilter stack up)"')
    p.add_argument("--partitions", type=_positive, help="partitions of each topic `up` makes (default 8); must match existing topics")
    p.add_argument("--brokers", type=int, choices=[1, 3], default=1, help="`up`: Kafka brokers; 3 is a KRaft cluster with replication factor 3, min ISR 2 (ports +2 each)")
    p.add_argument("--redis-cluster", action="store_true", help="`up`: a Redis Cluster of 3 masters and 3 replicas on MEMFILTER_REDIS_PORT and the 5 ports after it")
    p.set_defaults(parser=p, run=cmd_stack)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand's own usage, not the top level's
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command != "worker":
        # A command says in one line when Kafka does not answer; aiokafka's own lines would
        # come first (the worker logs them: it keeps running through an outage).
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        return args.run(args)
    except SettingError as e:
        print(f"memfilter {args.command}: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`memfilter tail | head -1`): stop quietly, as Python's docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1

"""`memfilter history show|import|rebuild|prefixes|drop`: the stored history."""

from __future__ import annotations

import argparse
import sys

from memfilter.cli.common import history_store, no_secret, plural, progress_bar, read_input, refuse_live, run_or_explain
from memfilter.settings import Settings

EXTRA = "worker"


def run(args: argparse.Namespace) -> int:
    import msgspec

    from memfilter.audit.replay import rebuild
    from memfilter.store import reads

    settings = Settings.from_env()
    url, prefix = args.redis_url or settings.redis.url, getattr(args, "prefix", None) or settings.redis.prefix

    async def show() -> int:
        store = history_store(url, prefix, settings)
        rows, superseded = await reads.thread_rows(store, args.thread), await reads.superseded_rows(store, args.thread)
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
        if reason := await refuse_live(settings, url, prefix, "rebuild"):
            print(f"memfilter history rebuild: {reason}", file=sys.stderr)
            return 1
        print(f"memfilter history rebuild: replacing the history under prefix {prefix} with {settings.topics.persist}", file=sys.stderr)
        store = history_store(url, prefix, settings)
        done = await rebuild(settings.kafka.bootstrap, settings.topics, store, settings.secret, progress_bar("applied"), settings.working_memory)
        left_out = f"; {done.erased:,} of erased threads left out" if done.erased else ""
        events = done.applied + done.refused + done.erased
        print(f"rebuilt history under prefix {prefix} from {events:,} events of {settings.topics.persist} ({done.refused:,} refused{left_out})")
        for thread, why in sorted(done.refused_by_postgres.items()):
            print(f"memfilter history rebuild: thread {thread!r} is in Redis but not in PostgreSQL: {why}", file=sys.stderr)
        return 0

    async def list_prefixes() -> int:
        found = await reads.prefixes(history_store(url, prefix, settings).transport)
        for name, keys in sorted(found.items()):
            print(f"{name}  {plural(keys, 'key')}{'  (the workers’ prefix: MEMFILTER_REDIS_PREFIX)' if name == settings.redis.prefix else ''}")
        return 0

    async def drop() -> int:
        if reason := await refuse_live(settings, url, prefix, "drop"):
            print(f"memfilter history drop: {reason}", file=sys.stderr)
            return 1
        print(f"dropped prefix {prefix}: {plural(await reads.drop(history_store(url, prefix, settings)), 'key')} deleted")
        return 0

    async def import_export() -> int:
        from memfilter.admin.imports import import_threads
        from memfilter.core.exports import read_export

        threads = read_export(read_input(args.file).splitlines(), settings.working_memory.scope)
        summary = await import_threads(settings, history_store(url, prefix, settings), threads, args.wait, progress_bar("checked"))
        for thread, why in summary.refused:
            print(f"memfilter history import: thread {thread} not imported: {why}", file=sys.stderr)
        waiting = len(summary.published) - summary.applied
        print(
            f"imported {plural(len(summary.published), 'thread')} ({plural(summary.messages, 'message')}) through {settings.topics.persist}; "
            f"{summary.unchanged:,} stored already; {len(summary.refused):,} refused"
            + (
                f"; {waiting:,} not applied by the workers within {args.wait:g} s (are they running? refused ones are on {settings.topics.dlq})"
                if waiting
                else ""
            )
        )
        return 1 if summary.refused or waiting else 0

    if args.action in ("rebuild", "import") and (reason := no_secret(settings)):
        print(f"memfilter history {args.action}: {reason}", file=sys.stderr)
        return 2
    run = {"show": show, "import": import_export, "rebuild": rebuild_all, "prefixes": list_prefixes, "drop": drop}[args.action]
    return run_or_explain(f"history {args.action}", settings, run())


def add(sub) -> None:
    p = sub.add_parser("history", help="show a stored thread, rebuild history from persist-messages, list or drop key prefixes")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="a stored thread: its conversation in save order, then its superseded rows, marked")
    show.add_argument("thread", help="thread id")
    show.add_argument(
        "--json", action="store_true", help='each stored row as one line of JSON, as stored; a superseded one as {"supersededBy": REQUEST, "row": ROW}'
    )
    imported = actions.add_parser(
        "import",
        help="bring existing threads in through persist-messages: Mastra storage rows or AI SDK UI messages, JSON lines (docs/erasure.md)",
    )
    imported.add_argument("file", nargs="?", help="the export (default: stdin)")
    imported.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the workers to apply what was published (default 60)")
    rebuild = actions.add_parser(
        "rebuild", help="replace the history under a prefix with persist-messages applied as it was live (refused while workers run on it)"
    )
    listed = actions.add_parser("prefixes", help="the key prefixes holding a history in Redis (leftovers of rebuilds and replays too)")
    drop = actions.add_parser("drop", help="delete every key under a prefix (refused while workers run on it)")
    drop.add_argument("--prefix", required=True, help="the prefix to delete (never a default)")
    for q in (show, imported, rebuild, listed, drop):
        q.add_argument("--redis-url", help="Redis to use (default REDIS_URL)")
        if q is not drop:
            q.add_argument("--prefix", help="key prefix (default MEMFILTER_REDIS_PREFIX or mf)")
        q.set_defaults(parser=q, run=run)

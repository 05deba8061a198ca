"""`memfilter forget`: erase a resource's threads, or one thread, for good (docs/erasure.md)."""

from __future__ import annotations

import argparse
import getpass
import sys

from memfilter.cli.common import history_store, no_secret, plural, run_or_explain
from memfilter.settings import Settings

EXTRA = "worker"


def run(args: argparse.Namespace) -> int:
    from memfilter.admin.erasure import forget
    from memfilter.schemas.wire import id_problem
    from memfilter.store import reads

    settings = Settings.from_env()
    if reason := no_secret(settings):
        print(f"memfilter forget: {reason}", file=sys.stderr)
        return 2
    named, value = ("--resource", args.resource) if args.resource else ("--thread", args.thread)
    if problem := id_problem(value):  # no thread or resource is stored under it: the rule of every id (docs/security.md)
        print(f"memfilter forget: {named} {value!r} {problem}; nothing is stored under it", file=sys.stderr)
        return 2
    store = history_store(settings.redis.url, settings.redis.prefix, settings)

    async def erase() -> int:
        threads = await reads.threads_of(store, args.resource) if args.resource else [args.thread]
        if args.dry_run:
            for thread in threads:
                print(thread)
            print(f"would erase {plural(len(threads), 'thread')}", file=sys.stderr)
            return 0
        done = await forget(settings, store, threads, "resource" if args.resource else "thread", args.by or getpass.getuser(), args.reason, args.wait)
        named = f"resource {args.resource}" if args.resource else f"thread {args.thread}"
        if not done.threads and not done.already and not done.pending:
            print(f"memfilter forget: {named} has no stored history under prefix {store.prefix}; nothing erased", file=sys.stderr)
            return 1
        if args.thread and done.already:
            print(f"thread {args.thread} was erased before; nothing to do")
        elif args.thread and done.threads:
            print(f"erased thread {args.thread} ({plural(done.messages, 'message')}); erasure event on {settings.topics.persist}")
        elif args.resource:
            print(
                f"erased {plural(len(done.threads), 'thread')} of {named} ({plural(done.messages, 'message')}); "
                f"{len(done.already):,} erased before; erasure events on {settings.topics.persist}"
            )
        if done.pending:
            print(
                f"memfilter forget: {plural(len(done.pending), 'erasure')} published but not applied within {args.wait:g} s "
                f"(are the workers running?): {', '.join(done.pending[:5])}; they apply when the workers read them",
                file=sys.stderr,
            )
            return 1
        return 0

    return run_or_explain("forget", settings, erase())


def add(sub) -> None:
    p = sub.add_parser("forget", help="erase a resource's threads, or one thread, for good: Redis, and every rebuild and replay after (docs/erasure.md)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--resource", help="erase every thread this resource owns")
    who.add_argument("--thread", help="erase this thread")
    p.add_argument("--by", help="who asks, for the audit (default: your login)")
    p.add_argument("--reason", default="", help="why, for the audit (a ticket number; no personal data)")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the workers to apply the erasures (default 60)")
    p.add_argument("--dry-run", action="store_true", help="list the threads that would be erased; erase nothing")
    p.set_defaults(parser=p, run=run)

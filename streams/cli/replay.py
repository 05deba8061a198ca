"""`memfilter replay`: audit a range of chat-requests against what was recorded."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from memfilter.cli.common import history_store, no_secret, progress_bar, run_or_explain
from memfilter.settings import Settings

EXTRA = "worker"


def run(args: argparse.Namespace) -> int:
    from memfilter.audit.recorded import empty_range, parse_position
    from memfilter.audit.replay import replay

    settings = Settings.from_env()
    try:
        start, end = parse_position(args.start), parse_position(args.end)
        if reason := empty_range(start, end):
            raise ValueError(f"{reason}: the range holds no request")
    except ValueError as e:
        print(f"memfilter replay: {e}", file=sys.stderr)
        return 2
    if reason := no_secret(settings):
        print(f"memfilter replay: {reason}", file=sys.stderr)
        return 2
    if args.report and not os.access(Path(args.report).resolve().parent, os.W_OK):
        print(f"memfilter replay: cannot write the report {args.report}: its folder does not exist or is not writable", file=sys.stderr)
        return 2
    url = args.redis_url or settings.redis.url
    report = run_or_explain(
        "replay",
        settings,
        replay(
            settings.kafka.bootstrap,
            settings.topics,
            lambda prefix: history_store(url, prefix, settings),
            settings.secret,
            start,
            end,
            settings.policy,
            progress_bar("replayed"),
            args.why,
            settings.working_memory,
        ),
    )
    for d in report.differences:
        print(f"DIFFERENT {d.requestId} (thread {d.threadId}, {d.source})")
        for line in d.diff:
            print(f"    {line}")
    for w in report.windows:
        print(f"WINDOW {w.requestId} (thread {w.threadId}, {w.source}): " + ", ".join(f"{r.id} {r.tokens:g} {r.why}" for r in w.rows))
    erased = f", {report.erased:,} decided on history since erased (memfilter forget): not replayed" if report.erased else ""
    print(f"replayed {report.requests:,} requests: {report.identical:,} identical, {report.different:,} different{erased}")
    if args.report:
        with open(args.report, "wb") as f:
            f.write(report.to_json())
    return 1 if args.strict and report.different else 0


def add(sub) -> None:
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
    p.add_argument(
        "--why",
        action="store_true",
        help="with MEMFILTER_CONTEXT_TOKENS: each request's context window, row by row: its tokens and why it is in or out (in the report too)",
    )
    p.add_argument("--redis-url", help="Redis for the isolated rebuild (default REDIS_URL; keys under a fresh replay-* prefix, deleted after)")
    p.set_defaults(parser=p, run=run)

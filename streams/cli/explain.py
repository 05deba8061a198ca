"""`memfilter explain`: the filter's decision for a request and a history, without Kafka or Redis."""

from __future__ import annotations

import argparse
import os
import sys

from memfilter.cli.common import read_input


def run(args: argparse.Namespace) -> int:
    from memfilter.core.explain import UnusableInput, explain

    try:
        out = explain(read_input(args.file), os.environ.get("MEMFILTER_SECRET", "").encode())
    except (UnusableInput, OSError) as e:
        print(f"memfilter explain: {e}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(out + b"\n")
    return 0


def add(sub) -> None:
    p = sub.add_parser("explain", help="the filter's decision for a request and a history, without Kafka or Redis")
    p.add_argument("file", nargs="?", help="a case or JSON array of cases (default: stdin)")
    p.set_defaults(parser=p, run=run)

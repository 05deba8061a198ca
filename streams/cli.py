"""The `memfilter` command line: one entry point, a subcommand per thing a user does."""

from __future__ import annotations

import argparse
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfilter", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("explain", help="the filter's decision for a request and a history, without Kafka or Redis")
    p.add_argument("file", nargs="?", help="a case or JSON array of cases (default: stdin)")
    p.set_defaults(run=cmd_explain)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

"""The `memfilter` command line: one entry point, a subcommand per thing a user does, each in a
module of its own here (`add` makes its parser, `run` runs it, and `EXTRA`, where it has one,
names the install extra whose packages it needs: run without them, it says which to install)."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys

from memfilter.cli import agent, converse, embedder, explain, forget, gateway, history, publish, replay, sink, stack, tail, worker
from memfilter.settings import SettingError

COMMANDS = (explain, worker, sink, embedder, agent, gateway, converse, publish, tail, history, forget, replay, stack)
COMMANDS_BY_NAME = {command.__name__.rpartition(".")[2]: command for command in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfilter", description="Chat memory as a Kafka stream processor: requests filtered against stored history.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('memfilter')}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub)
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
    except ModuleNotFoundError as e:
        extra = getattr(COMMANDS_BY_NAME[args.command], "EXTRA", None)
        if extra is None or (e.name or "memfilter").partition(".")[0] == "memfilter":
            raise  # the package itself is broken: a traceback, not advice
        print(
            f"memfilter {args.command}: needs the Python package {e.name}, which the `{extra}` extra installs: pip install 'memfilter[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except BrokenPipeError:
        # The reader went away (`memfilter tail | head -1`): stop quietly, as Python's docs advise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1

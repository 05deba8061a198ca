"""`memfilter worker`: run a processor worker; several form one consumer group."""

from __future__ import annotations

import argparse
import gc
import sys

from memfilter.cli.common import data_dir_missing, no_secret, web_port_free
from memfilter.settings import Decisions, Kafka, Postgres, Redis, Settings, Topics, Worker, variables

EXTRA = "worker"


def run(args: argparse.Namespace) -> int:
    import msgspec

    from memfilter.runtime.process import Worker
    from memfilter.runtime.worker import create_app

    settings = Settings.from_env()
    if args.web_port is not None:
        settings = msgspec.structs.replace(settings, worker=msgspec.structs.replace(settings.worker, web_port=args.web_port))
    if reason := no_secret(settings) or data_dir_missing(settings):
        print(f"memfilter worker: {reason}", file=sys.stderr)
        return 2
    if reason := web_port_free(settings):
        print(f"memfilter worker: {reason}", file=sys.stderr)
        return 1
    app = create_app(settings)
    gc.freeze()  # what start-up made stays: the collector need not scan it on every batch
    worker = Worker(app, loglevel=args.loglevel, name="worker", shutdown_s=settings.worker.shutdown_s)
    worker.execute_from_commandline()
    return 0


def add(sub) -> None:
    p = sub.add_parser(
        "worker",
        help="run a processor worker (a Faust worker); several workers form one consumer group",
        description="Consume chat-requests and persist-messages; settings from the environment ("
        + ", ".join(v for part in (Kafka, Redis, Postgres, Topics, Decisions, Worker) for v in variables(part))
        + ", MEMFILTER_SECRET"
        + "; docs/settings.md says what each does).",
    )
    p.add_argument("--web-port", type=int, help="port of the worker's web server (default MEMFILTER_WEB_PORT or 6066)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(parser=p, run=run)

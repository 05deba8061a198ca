"""`memfilter agent`: run the reference agent runner."""

from __future__ import annotations

import argparse
import sys

from memfilter.cli.common import data_dir_missing, no_secret, web_port_free
from memfilter.settings import Agent, Settings, variables

EXTRA = "agent"


def run(args: argparse.Namespace) -> int:
    import msgspec

    from memfilter.runtime.agent import ToolsFileError, create_agent_app, read_tools
    from memfilter.runtime.process import Worker

    settings = Settings.from_env()
    if args.web_port is not None:
        settings = msgspec.structs.replace(settings, agent=msgspec.structs.replace(settings.agent, web_port=args.web_port))
    if args.backend is not None:
        settings = msgspec.structs.replace(settings, agent=msgspec.structs.replace(settings.agent, backend=args.backend))
    if settings.agent.backend == "openai" and not settings.agent.openai_api_key:
        print(
            "memfilter agent: MEMFILTER_AGENT_BACKEND=openai needs OPENAI_API_KEY, the endpoint's key (for an endpoint that takes none, set it to any text)",
            file=sys.stderr,
        )
        return 2
    try:
        read_tools(settings.agent.tools)
    except ToolsFileError as e:
        print(f"memfilter agent: {e}", file=sys.stderr)
        return 2
    if reason := no_secret(settings) or data_dir_missing(settings):
        print(f"memfilter agent: {reason}", file=sys.stderr)
        return 2
    reason = web_port_free(settings, settings.agent.web_port, "MEMFILTER_AGENT_WEB_PORT", "agent runner")
    if reason is not None:
        print(f"memfilter agent: {reason}", file=sys.stderr)
        return 1
    Worker(create_agent_app(settings), loglevel=args.loglevel, name="agent", shutdown_s=settings.worker.shutdown_s).execute_from_commandline()
    return 0


def add(sub) -> None:
    p = sub.add_parser(
        "agent",
        help="run the reference agent runner: answer filtered inputs with a model, save replies to persist-messages",
        description="Consume filtered-inputs, send each context that asks for an answer to the model, publish the reply "
        "as a PersistMessages event; settings from the environment ("
        + ", ".join(variables(Agent))
        + ", and KAFKA_BOOTSTRAP_SERVERS, MEMFILTER_SECRET, the topics, MEMFILTER_SESSION_TIMEOUT, MEMFILTER_BATCH_WITHIN).",
    )
    p.add_argument("--backend", choices=["echo", "openai"], help="the model (default MEMFILTER_AGENT_BACKEND or echo)")
    p.add_argument("--web-port", type=int, help="port of the runner's web server (default MEMFILTER_AGENT_WEB_PORT or 6067)")
    p.add_argument("--loglevel", default="warn", choices=["crit", "error", "warn", "info", "debug"])
    p.set_defaults(parser=p, run=run)

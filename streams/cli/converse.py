"""`memfilter converse`: a scripted useChat-like client through the whole loop."""

from __future__ import annotations

import argparse
import sys

from memfilter.cli.common import reachable
from memfilter.settings import Settings


def run(args: argparse.Namespace) -> int:
    import asyncio
    import time

    from memfilter.client import RequestRejected
    from memfilter.client.conversations import DEMO_SCRIPT, Conversation, Driver, describe

    settings = Settings.from_env()
    reason = reachable(settings)
    if reason is not None:
        print(f"memfilter converse: {reason}", file=sys.stderr)
        return 1
    conversation = Conversation(args.thread or f"demo-thread-{int(time.time())}", args.resource, args.texts or DEMO_SCRIPT)
    try:
        asyncio.run(Driver(settings.kafka.bootstrap, settings.topics, args.timeout).run([conversation]))
    except (TimeoutError, RequestRejected) as e:
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


def add(sub) -> None:
    p = sub.add_parser(
        "converse",
        help="a scripted useChat-like client: send each text as a turn (full echo, UI messages), wait for the saved reply, print what the model saw",
    )
    p.add_argument(
        "texts",
        nargs="*",
        help="the user's turns; '/tool NAME {json}' asks the echo model for a client tool call, '/regenerate' regenerates the last answer, '/edit TEXT' edits the last user message (default: a short demo of each)",
    )
    p.add_argument("--thread", help="thread id (default demo-thread-<time>)")
    p.add_argument("--resource", default="demo-user", help="resource id (default demo-user)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each filtered input and reply (default 60)")
    p.set_defaults(parser=p, run=run)

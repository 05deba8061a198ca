"""`memfilter stack up|down|status`: a local Kafka and Redis for the product and its tests."""

from __future__ import annotations

import argparse
import sys

from memfilter.cli.common import positive
from memfilter.settings import Settings


def run(args: argparse.Namespace) -> int:
    from memfilter import stack

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


def add(sub) -> None:
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
    p.add_argument("--partitions", type=positive, help="partitions of each topic `up` makes (default 8); must match existing topics")
    p.add_argument(
        "--brokers", type=int, choices=[1, 3], default=1, help="`up`: Kafka brokers; 3 is a KRaft cluster with replication factor 3, min ISR 2 (ports +2 each)"
    )
    p.add_argument(
        "--redis-cluster", action="store_true", help="`up`: a Redis Cluster of 3 masters and 3 replicas on MEMFILTER_REDIS_PORT and the 5 ports after it"
    )
    p.set_defaults(parser=p, run=run)

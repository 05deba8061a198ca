"""Benchmark: what a gateway costs as gateways are added under one load, sharing the outcome
topics (MEMFILTER_GATEWAY_ADDRESS) beside reading them whole (the baseline: no address).

On the stack's Kafka and Redis (`memfilter stack up`), for each count G of `--gateways`
(1,2,4) and each way (`whole`, then `shared`), on topics of the run's own (8 partitions): a
worker, the echo agent runner (it streams its replies on `reply-streams`, a chunk a word) and G
gateways (header identity, callers' limits well above the load). `--turns` turns arrive
open-loop, `--rate` a second, on `--threads` threads, each posted as the AI SDK's transport
posts it to the next gateway in turn (as a load balancer spreads them) and read to its end.
Printed for each run: the turns' first token p50, each gateway's CPU per turn sent to it (a
shared gateway's cost follows how many turns its partitions carry, not how many it is sent) and
all gateways' CPU per turn (idle CPU taken out), and the broker's bytes out per turn, for the
four topics gateways read and for all the run's topics (from the broker's own
`kafka.server:type=BrokerTopicMetrics,name=BytesOutPerSec` meters, read over JMX: its local
management agent started with `jcmd`, read with Kafka's `JmxTool`). Then, for each way, how
the figures at each G compare with G=1 (flat: 1.00), and shared/whole at each G.

    eval "$(memfilter stack up)"
    .venv/bin/python -m benchmarks.gateways [--gateways 1,2,4] [--rate 10] [--turns 300] [--threads 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from benchmarks.turn_cost import Thread, at
from benchmarks.worker_throughput import REPO, clean_up, cpu_seconds, free_port, own_env, own_topics
from memfilter.gateway.shards import HEARTBEAT_S

STARTED_S = 90.0
READ = ("filtered-inputs", "dlq", "persist-messages", "reply-streams")  # what every gateway read whole before it shared them


class Broker:
    """The broker's bytes out per topic so far, from its JMX meters."""

    def __init__(self) -> None:
        found = [(int(p.name), (p / "cmdline").read_bytes().split(b"\0")) for p in Path("/proc").iterdir() if p.name.isdigit() and _kafka(p)]
        if len(found) != 1:
            raise SystemExit(f"expected one Kafka broker on this machine (`memfilter stack up`), found {len(found)}")
        pid, cmdline = found[0]
        self.classpath = cmdline[cmdline.index(b"-cp") + 1].decode()
        subprocess.run(["jcmd", str(pid), "ManagementAgent.start_local"], check=True, capture_output=True)
        status = subprocess.run(["jcmd", str(pid), "ManagementAgent.status"], check=True, capture_output=True, text=True).stdout
        self.url = re.search(r"URL\s*:\s*(\S+)", status).group(1)

    def bytes_out(self) -> dict[str, float]:
        done = subprocess.run(
            ["java", "-cp", self.classpath, "org.apache.kafka.tools.JmxTool", "--jmx-url", self.url, "--one-time", "true", "--attributes", "Count"]
            + ["--object-name", "kafka.server:type=BrokerTopicMetrics,name=BytesOutPerSec,topic=*"],
            check=True,
            capture_output=True,
            text=True,
        )
        header, values = [line for line in done.stdout.splitlines() if line.startswith('"time"') or line[:1].isdigit()][-2:]
        names = [re.search(r"topic=([^:]+):Count", h).group(1) if "topic=" in h else "" for h in header.strip('"').split('","')]
        return {name: float(v) for name, v in zip(names, values.split(",")) if name}


def _kafka(proc: Path) -> bool:
    try:
        return b"kafka.Kafka" in (proc / "cmdline").read_bytes()
    except OSError:
        return False


async def run(args: argparse.Namespace, broker: Broker, count: int, shared: bool) -> dict[str, float]:
    bootstrap, redis_url = os.environ["KAFKA_BOOTSTRAP_SERVERS"], os.environ["REDIS_URL"]
    name, topics = await own_topics(bootstrap, "gateways")
    lenient = {"MEMFILTER_GATEWAY_CALLER_RATE": "1000", "MEMFILTER_GATEWAY_CALLER_BURST": "1000", "MEMFILTER_MAX_MESSAGES": "10000"}
    env = {**own_env(name, topics, os.environ.get("MEMFILTER_SECRET") or secrets.token_hex(32), MEMFILTER_GATEWAY_AUTH="header", **lenient), "PYTHONPATH": ""}
    ports = [free_port() for _ in range(count)]
    commands = [["worker", "--web-port", str(free_port())], ["agent", "--web-port", str(free_port())]]
    processes = [
        subprocess.Popen([sys.executable, "-m", "memfilter", *c], env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands
    ]
    gateways = []
    for port in ports:
        own = {"MEMFILTER_GATEWAY_ADDRESS": f"http://127.0.0.1:{port}"} if shared else {}
        gateways.append(
            subprocess.Popen(
                [sys.executable, "-m", "memfilter", "gateway", "--port", str(port)],
                env=env | own,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    threads = [Thread(f"gw-{name}-{n}", f"user-{n}") for n in range(args.threads)]
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            deadline = time.monotonic() + STARTED_S
            for url in urls:  # every gateway ready, and answering a turn: the whole loop runs
                while True:
                    try:
                        async with http.get(f"{url}/readyz") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{url} was not ready within {STARTED_S:.0f} s")
                    await asyncio.sleep(0.5)
            await asyncio.sleep(2 * HEARTBEAT_S + 0.5)  # the shared gateways' leases read by all
            for url in urls:
                await Thread(f"gw-{name}-warm-{url[-5:]}", "warm-up").turn(http, url)
            for n, t in enumerate(threads):  # each thread's first turn, unmeasured
                await t.turn(http, urls[n % count])
            pids = [g.pid for g in gateways]
            started, before = time.monotonic(), [cpu_seconds(pid) for pid in pids]
            await asyncio.sleep(args.idle_s)
            idle = [(cpu_seconds(pid) - b) / (time.monotonic() - started) for pid, b in zip(pids, before)]
            started, before, sent = time.monotonic(), [cpu_seconds(pid) for pid in pids], broker.bytes_out()

            async def turn(n: int) -> tuple[float, float]:
                await asyncio.sleep(max(0.0, started + n / args.rate - time.monotonic()))
                return await threads[n % len(threads)].turn(http, urls[n % count])

            timed = await asyncio.gather(*(turn(n) for n in range(args.turns)))
            span = time.monotonic() - started
            used = [cpu_seconds(pid) - b - i * span for pid, b, i in zip(pids, before, idle)]
            after = broker.bytes_out()
    finally:
        for p in [*processes, *gateways]:
            p.terminate()
        for p in [*processes, *gateways]:
            p.wait(30)
        await clean_up(bootstrap, redis_url, list(topics.values()), name)
    out = {default: after.get(own, 0.0) - sent.get(own, 0.0) for default, own in topics.items()}
    per_gateway = [u / (args.turns / count) for u in used]
    figures = {
        "first token p50": at([f for f, _ in timed], 0.5),
        "gateways' CPU per turn": sum(used) / args.turns,
        "the busiest gateway's CPU per turn sent to it": max(per_gateway),  # the shares are as even as the threads' partitions
        "bytes out per turn, the topics gateways read": sum(out[t] for t in READ) / args.turns,
        "bytes out per turn, all topics": sum(out.values()) / args.turns,
    }
    print(f"  {count} gateway(s), {'shared' if shared else 'whole'}: {args.turns} turns at {args.rate:g}/s over {span:.1f} s", flush=True)
    print(f"    first token p50 {figures['first token p50'] * 1000:.1f} ms", flush=True)
    print(
        f"    CPU per turn sent to each gateway: {', '.join(f'{c * 1000:.2f}' for c in per_gateway)} ms (idle {', '.join(f'{i * 1000:.1f}' for i in idle)} ms/s)"
    )
    print(f"    all gateways' CPU per turn: {sum(used) / args.turns * 1000:.2f} ms", flush=True)
    print(f"    broker bytes out per turn: {', '.join(f'{t} {out[t] / args.turns / 1024:.1f}' for t in out)} KiB", flush=True)
    return figures


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateways", default="1,2,4", help="gateway counts, comma-separated")
    parser.add_argument("--rate", type=float, default=10.0, help="turns a second, open-loop")
    parser.add_argument("--turns", type=int, default=300)
    parser.add_argument("--threads", type=int, default=40)
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds of idle CPU measured before the turns, taken out of theirs")
    args = parser.parse_args()
    for var in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL"):
        if var not in os.environ:
            raise SystemExit(f'{var} is not set: eval "$(memfilter stack up)" first')
    broker = Broker()
    counts = [int(c) for c in args.gateways.split(",")]
    results = {(count, shared): await run(args, broker, count, shared) for count in counts for shared in (False, True)}
    first = counts[0]
    for shared in (False, True):
        print(f"{'shared' if shared else 'whole'}: each figure at G gateways / at {first}", flush=True)
        for count in counts[1:]:
            ratios = ", ".join(f"{k} {v / results[(first, shared)][k]:.2f}" for k, v in results[(count, shared)].items())
            print(f"  G={count}: {ratios}", flush=True)
    print("shared / whole, at each G", flush=True)
    for count in counts:
        print(f"  G={count}: {', '.join(f'{k} {v / results[(count, False)][k]:.2f}' for k, v in results[(count, True)].items())}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())

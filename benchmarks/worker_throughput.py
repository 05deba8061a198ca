"""Benchmark: the worker against a plain aiokafka consume-then-produce loop, same broker, same records.

A realistic mix: threads whose stored history has 1 to 20 turns (2 to 40 messages, tool calls
with results, provider metadata), some with a client tool call still pending, some new. Each
request is a `useChat` full echo of its thread (answering the pending call where there is
one) plus the user's new message; a thread's later requests echo what its earlier ones sent.

In one run on the same Kafka and Redis (`memfilter stack up`; KAFKA_BOOTSTRAP_SERVERS and
REDIS_URL as it prints):
  (a) baseline: aiokafka consumes the requests and produces each value to another topic;
  (b) the processor: one `memfilter worker` consumes the same records from a backlog, once
      per context size asked for (`--history`, MEMFILTER_HISTORY_MESSAGES; each on its own
      copy of the stored history and its own output topics);
  (c) latency: with the last (b) worker caught up, requests published at a steady rate, the
      time from publish to the filtered input arriving at a consumer.
Both (b) and (c) read the filtered inputs as downstream does, `read_committed`: a record
counts once the worker's transaction that holds it is committed.
Given a replicated stack too (`--cluster KAFKA_BOOTSTRAP_SERVERS REDIS_URL`, as `memfilter stack
up --brokers 3 --redis-cluster` prints them), the same requests go through it in the same run:
(b) with writes on no replica before a commit (MEMFILTER_REDIS_REPLICAS=0), with two workers
and with one, both waiting for a replica (=1), then (c) on the last; each (b) is also given
against the single-node stack's last (b).
It prints requests/s of both and their ratio (and each (b) against the first), the mean bytes
of a filtered input, p50/p99 latency, Redis round trips per request
(from the worker's /metrics), the worker's CPU time per request and how busy it was during
(b) (throughput varies ±15% from run to run on this VM; CPU per request less), how busy the
whole machine was (the broker and Redis share its cores with the worker),
and the worker's RSS after the first batches and after each tenth of the requests.

    .venv/bin/python -m benchmarks.worker_throughput [--threads 10000] [--requests 100000] [--history 0,10] [--profile FILE]
        (--history 10,10@400: the row window, then the same within 400 tokens, side by side)
        [--cluster KAFKA_BOOTSTRAP_SERVERS REDIS_URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.sample_threads import echo_of, stored_thread
from memfilter.core.filter import parse_ms
from memfilter.core.tokens import ESTIMATE
from memfilter.store.history import HistoryStore, Save
from memfilter.store.redis_driver import connect

REPO = Path(__file__).resolve().parent.parent
T0 = 1772366400000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_workload(threads: int, requests: int, seed: int = 1, tag: str = "q"):
    """(history rows by thread, requests as (key, value)) for the mix described above."""
    rnd = random.Random(seed)
    history, plans = {}, []
    for i in range(threads):
        thread = f"bench-{i}"
        turns = rnd.randint(1, 20)
        kind = rnd.random()
        rows = stored_thread(thread, "r-bench", turns, pending=kind < 0.3)
        if kind >= 0.9:  # a new thread: nothing stored, the first request seeds it
            history[thread] = []
        else:
            history[thread] = rows
        plans.append((thread, rows))
    out = []
    per_thread = -(-requests // threads)  # rounds of one request per thread; the last may stop part-way
    for k in range(per_thread):
        for thread, rows in plans:
            if len(out) == requests:
                break
            messages = echo_of(rows, new_text="msg 0")[:-1]
            for j in range(k + 1):
                messages.append({"id": f"{thread}-n{j}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"msg {j}"}]}})
            request = {"requestId": f"{thread}-{tag}{k}", "threadId": thread, "resourceId": "r-bench", "messages": messages}
            out.append((thread.encode(), msgspec.json.encode(request)))
    return history, out


@contextlib.contextmanager
def kept_from_collector():
    """For objects made inside that live to the end of the run (the workload, millions of
    them): no collections while they are made, and none that traverse them afterwards. Left
    to the collector, its full collections took up to 1.7 s each, during which this process
    (the baseline, the readers, the paced publisher) stood still: (c)'s p99 outliers."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


async def create_topics(bootstrap: str, names: list[str], partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    replicas = min(3, len(bootstrap.split(",")))  # a replicated stack's brokers each hold a copy
    try:
        await admin.create_topics([NewTopic(n, partitions, replicas) for n in names])
    finally:
        await admin.close()


async def own_topics(bootstrap: str, tag: str) -> tuple[str, dict[str, str]]:
    """A run's name and the product's six topics of its own (made, 8 partitions each), by their default names."""
    run = f"{tag}-{uuid.uuid4().hex[:8]}"
    topics = {name: f"{name}-{run}" for name in ("chat-requests", "filtered-inputs", "persist-messages", "dlq", "reply-streams", "reply-stops")}
    await create_topics(bootstrap, list(topics.values()), 8)
    return run, topics


def own_env(run: str, topics: dict[str, str], secret: str, **extra: str) -> dict[str, str]:
    """The settings of the run's processes: its topics (`own_topics`), its group, prefix and data folder, the secret."""
    return {
        **os.environ,
        "MEMFILTER_GROUP": run,
        "MEMFILTER_AGENT_GROUP": f"{run}-agent",
        "MEMFILTER_REDIS_PREFIX": run,
        "MEMFILTER_DATA_DIR": f"/tmp/{run}",
        "MEMFILTER_SECRET": secret,
        "MEMFILTER_TOPIC_REQUESTS": topics["chat-requests"],
        "MEMFILTER_TOPIC_FILTERED": topics["filtered-inputs"],
        "MEMFILTER_TOPIC_PERSIST": topics["persist-messages"],
        "MEMFILTER_TOPIC_DLQ": topics["dlq"],
        "MEMFILTER_TOPIC_STREAMS": topics["reply-streams"],
        "MEMFILTER_TOPIC_STOPS": topics["reply-stops"],
        **extra,
    }


async def publish(bootstrap: str, topic: str, records, rate: float | None = None) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_batch_size=1 << 20, max_request_size=4 << 20)
    await producer.start()
    try:
        pending, start = [], time.monotonic()
        for n, (key, value) in enumerate(records):
            if rate is not None:
                await asyncio.sleep(max(0.0, start + n / rate - time.monotonic()))
                ts = int(time.time() * 1000)
            else:
                ts = T0
            pending.append(await producer.send(topic, value, key=key, timestamp_ms=ts))
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def seed(redis_url: str, prefix: str, history: dict, budget: int = 0) -> None:
    """The stored history under `prefix`; with a budget, each row's token count beside it, as a worker saves them."""
    client = connect(redis_url)
    store = HistoryStore(client, prefix, counter=ESTIMATE if budget else None)
    try:
        threads = [(thread, rows) for thread, rows in history.items() if rows]
        for start in range(0, len(threads), 500):
            chunk = threads[start : start + 500]
            await store.claim([(r["id"], thread) for thread, rows in chunk for r in rows])
            await store.apply(
                [
                    Save(
                        thread,
                        "r-bench",
                        max(parse_ms(r["createdAt"]) for r in rows),
                        [(r["id"], msgspec.json.encode(r)) for r in rows],
                        [r["role"] for r in rows],
                        b"",
                        writer="processor",
                    )
                    for thread, rows in chunk
                ]
            )
    finally:
        await client.aclose()


async def clean_up(bootstrap: str, redis_url: str, topics: list[str], prefix: str) -> None:
    """Delete the run's topics and Redis keys: runs left behind slow the next ones (a run
    writes ~1.5 GB to the broker and ~1.7 GB to Redis, whose append-only file grows with it)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(topics)
    finally:
        await admin.close()
    client = connect(redis_url)
    try:
        batch = []
        async for key in client.scan_iter(f"{prefix}*", count=1000):
            batch.append(key)
            if len(batch) == 1000:
                await client.unlink(*batch)
                batch = []
        if batch:
            await client.unlink(*batch)
    finally:
        await client.aclose()


async def baseline(bootstrap: str, source: str, sink: str, n: int) -> tuple[float, float]:
    """(a) plain aiokafka: consume every record and produce its value; (records/s, CPU seconds per record)."""
    consumer = AIOKafkaConsumer(
        source,
        bootstrap_servers=bootstrap,
        group_id=f"baseline-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8 << 20,
        fetch_max_bytes=64 << 20,
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, max_batch_size=1 << 20, max_request_size=4 << 20, acks=-1)
    await consumer.start()
    await producer.start()
    done, start = 0, None
    try:
        while done < n:
            batch = await consumer.getmany(timeout_ms=1000, max_records=2000)
            pending = []
            for _tp, records in batch.items():
                for r in records:
                    if start is None:
                        start, cpu = time.monotonic(), time.process_time()
                    pending.append(await producer.send(sink, r.value, key=r.key, timestamp_ms=r.timestamp))
            await asyncio.gather(*pending)
            done += len(pending)
            if pending:
                await consumer.commit()
        return n / (time.monotonic() - start), (time.process_time() - cpu) / n
    finally:
        await consumer.stop()
        await producer.stop()


async def count_until(bootstrap: str, topic: str, n: int, on_record=None, timeout: float = 900, from_end: asyncio.Event | None = None) -> tuple[float, float]:
    """Read `topic` until n records arrived; (first arrival, last arrival) monotonic times.
    From the topic's start, or, given `from_end`, from its end: the event is set once the
    reader holds its position there, so that what is published after arrives at a reader
    that is not still working through the backlog."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="latest" if from_end else "earliest",
        fetch_max_wait_ms=10,
        max_partition_fetch_bytes=8 << 20,
        isolation_level="read_committed",
    )  # as downstream reads: once committed
    await consumer.start()
    seen, first, deadline = 0, None, time.monotonic() + timeout
    try:
        if from_end is not None:
            while not consumer.assignment():
                await asyncio.sleep(0.05)
            for tp in consumer.assignment():
                await consumer.position(tp)
            from_end.set()
        while seen < n and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200, max_records=5000)
            now = time.monotonic()
            for records in batch.values():
                for r in records:
                    first = first or now
                    seen += 1
                    if on_record:
                        on_record(r)
        if seen < n:
            raise SystemExit(f"only {seen} of {n} records arrived on {topic}")
        return first, time.monotonic()
    finally:
        await consumer.stop()


def worker_env(
    bootstrap: str, redis_url: str, topics: dict[str, str], prefix: str, history: int, replicas: int = 0, budget: int = 0, key: str | None = None
) -> dict[str, str]:
    """A benchmark worker's settings: the run's topics of `key` (default: its context size), and
    its prefix as group and key prefix."""
    key = str(history) if key is None else key
    return {
        **os.environ,
        "MEMFILTER_REDIS_REPLICAS": str(replicas),
        "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "REDIS_URL": redis_url,
        "MEMFILTER_GROUP": prefix,
        "MEMFILTER_REDIS_PREFIX": prefix,
        "MEMFILTER_TOPIC_REQUESTS": topics["requests"],
        "MEMFILTER_TOPIC_FILTERED": topics[f"filtered{key}"],
        "MEMFILTER_TOPIC_PERSIST": topics[f"persist{key}"],
        "MEMFILTER_TOPIC_DLQ": topics[f"dlq{key}"],
        "MEMFILTER_DATA_DIR": f"/tmp/{prefix}",
        "MEMFILTER_HISTORY_MESSAGES": str(history),
        "MEMFILTER_CONTEXT_TOKENS": str(budget),
        "MEMFILTER_SECRET": os.environ.get("MEMFILTER_SECRET") or secrets.token_hex(32),
    }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine_busy_seconds() -> float:
    """CPU time all processes have used so far, summed over the cores (not idle, not iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def service_cpu_seconds() -> dict[str, float]:
    """CPU time used so far by the Kafka brokers, the Redis servers and PostgreSQL's processes on this machine, each summed."""
    out = {"Kafka": 0.0, "Redis": 0.0, "PostgreSQL": 0.0}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            name = "Kafka" if b"kafka.Kafka" in cmdline else "Redis" if b"redis-server" in cmdline else None
            if cmdline.startswith(b"postgres") or b"/bin/postgres\0" in cmdline:
                name = "PostgreSQL"
            if name:
                out[name] += cpu_seconds(int(proc.name))
        except (OSError, ValueError):
            continue
    return out


def worker_metrics(port: int) -> dict[str, float]:
    """Each sample of the worker's /metrics, summed over its labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


# Where a sample's innermost frame is, by its file (py-spy's paths): what each part of the worker costs.
PROFILE_GROUPS = (
    ("filter: decode, validate, decide, context", ("streams/core/", "schemas/")),
    ("processor: lanes, overlay, records", ("streams/runtime/processor.py",)),
    ("history store and Redis client", ("streams/store/", "redis/", "hiredis/")),
    ("task loop, worker and persister", ("streams/runtime/",)),
    ("Kafka client", ("aiokafka/",)),
    ("event loop and sockets", ("asyncio/", "selectors.py")),
)


def print_profile(path: str, top: int = 12) -> None:
    """The share of the worker's samples by part (PROFILE_GROUPS) and its busiest lines. A
    sample's innermost Python frame takes it, so C work counts for the line that caused it:
    msgspec's decoding for the decode call, freeing a lane's decoded requests for the line of
    `Processor._lane` that lets go of them."""
    by_line: dict[str, int] = {}
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():  # a frame's text with a line break in it (py-spy writes it as it is)
            continue
        leaf = stack.rsplit(";", 1)[-1]
        by_line[leaf] = by_line.get(leaf, 0) + int(n)
    total = sum(by_line.values()) or 1
    by_group: dict[str, int] = {}
    for leaf, n in by_line.items():
        where = leaf.rpartition(" (")[2]
        group = next((name for name, files in PROFILE_GROUPS if any(where.startswith(f) for f in files)), "other")
        by_group[group] = by_group.get(group, 0) + n
    print(f"    profile ({total:,} samples, {path}):")
    for group, n in sorted(by_group.items(), key=lambda kv: -kv[1]):
        print(f"      {n / total:5.1%}  {group}")
    print("    busiest lines:")
    for leaf, n in sorted(by_line.items(), key=lambda kv: -kv[1])[:top]:
        print(f"      {n / total:5.1%}  {leaf}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--latency-rate", type=float, default=1000, help="requests/s in the latency phase")
    parser.add_argument("--latency-seconds", type=float, default=10)
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument(
        "--history",
        default="0,10",
        help="context sizes to run (b) with, in order: N rows (MEMFILTER_HISTORY_MESSAGES), or N@B for N rows within B tokens (MEMFILTER_CONTEXT_TOKENS); "
        "repeat them to alternate (10,10@400,10,10@400)",
    )
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="sample the worker with py-spy during (b), write the samples to FILE and print where its time went (py-spy takes CPU too: the run's figures drop)",
    )
    parser.add_argument(
        "--cluster", nargs=2, metavar=("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL"), help="a replicated stack to run the same requests through as well"
    )
    args = parser.parse_args()
    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    run = uuid.uuid4().hex[:8]
    histories = [Size.parse(i, spec) for i, spec in enumerate(args.history.split(","))]
    topics = {k: f"bench-{k}-{run}" for k in ("requests", "baseline-out")}
    for n in histories:
        topics |= {f"{k}{n.key}": f"bench-{k}{n.key}-{run}" for k in ("filtered", "persist", "dlq")}
    for variant in CLUSTER_RUNS if args.cluster else ():
        topics |= {f"{k}{variant}": f"bench-{k}{variant}-{run}" for k in ("filtered", "persist", "dlq")}
    prefix = f"bench-{run}"
    stacks = [(bootstrap, redis_url), *([tuple(args.cluster)] if args.cluster else [])]
    for stack_bootstrap, _ in stacks:
        await create_topics(stack_bootstrap, list(topics.values()), args.partitions)
    try:
        await measure(args, stacks, topics, prefix, histories)
    finally:
        for stack_bootstrap, stack_redis in stacks:
            await clean_up(stack_bootstrap, stack_redis, list(topics.values()), prefix)


# The replicated stack's runs of (b), in order: (workers, MEMFILTER_REDIS_REPLICAS); (c) runs on the last.
CLUSTER_RUNS = {"c0": (1, 0), "c2w": (2, 1), "c1": (1, 1)}


class Size(msgspec.Struct, frozen=True):
    """A context size of (b): rows, within a token budget (0: none); `key` names its topics and prefix."""

    key: str
    rows: int
    budget: int = 0

    @classmethod
    def parse(cls, at: int, spec: str) -> Size:
        rows, _, budget = spec.partition("@")
        return cls(f"{at}-{rows}" + (f"b{budget}" if budget else ""), int(rows), int(budget or 0))

    def label(self) -> str:
        return f", MEMFILTER_HISTORY_MESSAGES={self.rows}" + (f", MEMFILTER_CONTEXT_TOKENS={self.budget}" if self.budget else "")


async def measure(args: argparse.Namespace, stacks: list[tuple[str, str]], topics: dict[str, str], prefix: str, histories: list[Size]) -> None:
    with kept_from_collector():
        history, requests = make_workload(args.threads, args.requests)
    sizes = sorted(len(v) for _, v in requests)
    print(
        f"workload: {len(requests):,} requests over {args.threads:,} threads, "
        f"{sum(sizes) / len(sizes) / 1024:.1f} KiB mean, {sizes[len(sizes) // 2] / 1024:.1f} KiB median"
    )
    (bootstrap, redis_url), cluster = stacks[0], stacks[1:]
    for n in histories:
        await seed(redis_url, f"{prefix}-h{n.key}", history, n.budget)
    await publish(bootstrap, topics["requests"], requests)

    rate_a, cpu_a = await baseline(bootstrap, topics["requests"], topics["baseline-out"], len(requests))
    print(f"(a) aiokafka consume+produce:  {rate_a:9,.0f} requests/s   CPU {cpu_a * 1e6:.0f} µs per request")
    rates = []
    for i, n in enumerate(histories):
        last_worker = i == len(histories) - 1
        workers = await run_worker(
            args, bootstrap, redis_url, topics, f"{prefix}-h{n.key}", n.rows, len(requests), rate_a, rates, variant=n.key, label=n.label(), budget=n.budget
        )
        try:
            if last_worker:
                await latency(args, bootstrap, topics[f"filtered{n.key}"], topics["requests"], workers)
        finally:
            stop(workers)
    if not cluster:
        return
    (bootstrap, redis_url), n, single = cluster[0], histories[-1].rows, rates[-1]
    print(f"replicated stack: Kafka {bootstrap}, Redis {redis_url}; MEMFILTER_HISTORY_MESSAGES={n}, against one broker, one Redis: {single:,.0f} requests/s")
    for variant in CLUSTER_RUNS:
        await seed(redis_url, f"{prefix}-{variant}", history)
    await publish(bootstrap, topics["requests"], requests)
    for i, (variant, (count, replicas)) in enumerate(CLUSTER_RUNS.items()):
        rates = [single]
        label = f"{'s' if count > 1 else ''} x{count}, MEMFILTER_REDIS_REPLICAS={replicas}"
        workers = await run_worker(
            args,
            bootstrap,
            redis_url,
            topics,
            f"{prefix}-{variant}",
            n,
            len(requests),
            rate_a,
            rates,
            variant=variant,
            label=label,
            count=count,
            replicas=replicas,
            against="one broker, one Redis",
        )
        try:
            if i == len(CLUSTER_RUNS) - 1:
                await latency(args, bootstrap, topics[f"filtered{variant}"], topics["requests"], workers)
        finally:
            stop(workers)


def stop(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        worker.terminate()
    for worker in workers:
        worker.wait(30)


async def run_worker(
    args,
    bootstrap,
    redis_url,
    topics,
    prefix,
    history,
    n_requests,
    rate_a,
    rates,
    variant: str | None = None,
    label: str = "",
    count: int = 1,
    replicas: int = 0,
    against: str = "the first (b)",
    budget: int = 0,
) -> list[subprocess.Popen]:
    """(b) with contexts of `history` rows, by `count` workers of one group: the workers, still
    running, once they have caught up. Their output topics are `variant`'s (default: the
    context size's)."""
    variant = variant if variant is not None else str(history)
    label = label or f", MEMFILTER_HISTORY_MESSAGES={history}"
    ports = [free_port() for _ in range(count)]
    env = worker_env(bootstrap, redis_url, topics, prefix, history, replicas, budget, variant)
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "memfilter", "worker", "--web-port", str(port)],
            env=env,
            cwd=REPO,
            stdout=open(f"/tmp/{prefix}-worker{i}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        for i, port in enumerate(ports)
    ]
    try:
        rss, tenths, cpu, machine, services, profiler, sizes, seen = [], [], [], [], [], [], [0], [0]
        worker = workers[0]

        def note_start(record):
            seen[0] += 1
            sizes[0] += len(record.value)
            if seen[0] == 1:
                cpu.append(sum(cpu_seconds(w.pid) for w in workers))
                machine.append(machine_busy_seconds())
                services.append(service_cpu_seconds())
                if args.profile:
                    profiler.append(
                        subprocess.Popen(
                            [
                                Path(sys.executable).parent / "py-spy",
                                "record",
                                "--pid",
                                str(worker.pid),
                                "--rate",
                                "200",
                                "--format",
                                "raw",
                                "--output",
                                f"{args.profile}.{variant}",
                                "--nonblocking",
                            ],
                            stdout=subprocess.DEVNULL,
                        )
                    )
            if seen[0] == 2000:
                rss.append(rss_mb(worker.pid))
            if seen[0] % max(1, n_requests // 10) == 0:
                tenths.append(rss_mb(worker.pid))

        first, last = await count_until(bootstrap, topics[f"filtered{variant}"], n_requests, on_record=note_start)
        rate_b = (n_requests - 1) / (last - first)
        rates.append(rate_b)
        cpu.append(sum(cpu_seconds(w.pid) for w in workers))
        machine.append(machine_busy_seconds())
        services.append(service_cpu_seconds())
        for p in profiler:
            p.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
            p.wait(30)
        m = [worker_metrics(port) for port in ports]
        print(
            f"(b) memfilter worker{label}: {rate_b:9,.0f} requests/s   (b)/(a) = {rate_b / rate_a:.2f}"
            + (f"   against {against}: {rate_b / rates[0]:.2f}" if len(rates) > 1 else "")
        )
        trips, handled = (sum(x[name] for x in m) for name in ("memfilter_redis_round_trips_total", "memfilter_requests_total"))
        print(f"    Redis round trips/request:  {trips / handled:.4f}")
        print(f"    filtered input: {sizes[0] / n_requests:,.0f} bytes mean")
        print(
            f"    worker CPU: {(cpu[1] - cpu[0]) / (n_requests - 1) * 1e6:.0f} µs per request, "
            f"busy {(cpu[1] - cpu[0]) / (last - first):.0%} of the time" + (f" (the {count} together)" if count > 1 else "")
        )
        print(
            f"    machine: {(machine[1] - machine[0]) / (last - first):.2f} of its {os.cpu_count()} cores busy, "
            f"{((machine[1] - machine[0]) - (cpu[1] - cpu[0])) / (n_requests - 1) * 1e6:.0f} µs per request "
            f"outside the worker (broker, Redis, this benchmark's reader): "
            + ", ".join(f"{name} {(services[1][name] - services[0][name]) / (n_requests - 1) * 1e6:.0f} µs" for name in services[0])
        )
        print(
            f"    worker RSS: {rss[0]:.0f} MiB after 2,000 requests, {tenths[-1]:.0f} MiB after {n_requests:,} "
            f"(after each tenth: {' '.join(f'{r:.0f}' for r in tenths)})"
        )
        if args.profile:
            print_profile(f"{args.profile}.{variant}")
        return workers
    except BaseException:
        stop(workers)
        raise


def batch_phases(ports: list[int]) -> dict[str, tuple[float, float]]:
    """`memfilter_batch_phase_seconds` of the workers, by phase: (seconds, batches) so far."""
    phases: dict[str, tuple[float, float]] = {}
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in ("memfilter_batch_phase_seconds_sum", "memfilter_batch_phase_seconds_count"):
                    total, count = phases.get(sample.labels["phase"], (0.0, 0.0))
                    summed = sample.name.endswith("_sum")
                    phases[sample.labels["phase"]] = (total + sample.value * summed, count + sample.value * (not summed))
    return phases


async def latency(args, bootstrap: str, filtered: str, requests: str, workers: list[subprocess.Popen]) -> None:
    """(c): requests at a steady rate to caught-up workers; publish-to-filtered-input times, and
    where a batch's time went meanwhile (the workers' `memfilter_batch_phase_seconds`)."""
    ports = [int(w.args[-1]) for w in workers]  # their --web-port
    before = batch_phases(ports)
    latencies = []
    n_latency = int(args.latency_rate * args.latency_seconds)
    with kept_from_collector():
        _, paced = make_workload(args.threads, n_latency, seed=2, tag="lat")
    positioned = asyncio.Event()
    reader = asyncio.create_task(
        count_until(bootstrap, filtered, n_latency, from_end=positioned, on_record=lambda r: latencies.append(time.time() * 1000 - r.timestamp))
    )
    await positioned.wait()
    await publish(bootstrap, requests, paced, rate=args.latency_rate)
    await reader
    after = batch_phases(ports)
    latencies.sort()
    print(
        f"(c) publish -> filtered input at {args.latency_rate:,.0f} requests/s: "
        f"p50 {latencies[len(latencies) // 2]:.0f} ms, p99 {latencies[int(len(latencies) * 0.99)]:.0f} ms"
    )
    batches = after["handling"][1] - before.get("handling", (0.0, 0.0))[1]
    means = {name: (total - before.get(name, (0.0, 0.0))[0]) / max(1.0, count - before.get(name, (0.0, 0.0))[1]) for name, (total, count) in after.items()}
    print(
        f"    a batch meanwhile ({batches:,.0f} batches, {n_latency / max(1.0, batches):,.0f} requests each), mean ms: "
        + ", ".join(f"{name} {means[name] * 1000:.1f}" for name in ("waiting", "previous-commit", "catch-up", "handling", "committing"))
    )


if __name__ == "__main__":
    asyncio.run(main())

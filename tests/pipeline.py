"""Helpers for tests of the running processor: its own topics, workers, publishing, reading.

Each test gets a `Pipeline`: four topics of its own (8 partitions), a consumer group and a
Redis key prefix of its own, so tests never see each other's records or rows. Workers are
real `memfilter worker` processes, or containers of the worker image on the container backend
(`tests/containers.py`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import ConsumerRecord

from memfilter.core.filter import parse_ms
from memfilter.settings import Topics
from memfilter.stack import topic_configs
from memfilter.store.history import HistoryStore, Save
from memfilter.store.redis_driver import connect

if TYPE_CHECKING:
    from containers import ContainerStack

REPO = Path(__file__).resolve().parent.parent
WORKER_LOGS = Path("/tmp")  # a worker's output: memfilter-test-<pipeline>-worker<n>.log


def free_port() -> int:
    """A port nothing listens on, for a service a test starts, from below the kernel's range for
    the ports of outgoing connections (`ip_local_port_range`): a port picked in that range (as
    binding port 0 does) can be taken by any connection before the service binds it, as a
    Kafka started after Maven had collected its jars found ("Address already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
            return port


def local_get(port: int, path: str) -> tuple[int, str]:
    """GET `path` of a part's web server on loopback: the status and the body, errors too."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def node_test(file: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A test file of `tests/node/` (the AI SDK's client, Chromium through puppeteer-core) run
    with node's test runner, with `env` alone (and a PATH); `args` go to the runner
    (`--test-name-pattern=...`)."""
    return subprocess.run(
        ["node", "--test", "--test-reporter=spec", *args, file],
        cwd=REPO / "tests" / "node",
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def redis_config(folder: Path, port: int | None = None) -> tuple[Path, str]:
    """A redis-server config of a test's own (a free port unless given, data in `folder`) and
    its URL, for tests that stop, hang or restart their Redis: `stacks.start_redis` starts it."""
    port = port or free_port()
    conf = folder / "redis.conf"
    conf.write_text(f'bind 127.0.0.1\nport {port}\ndir {folder}\nsave ""\n')
    return conf, f"redis://127.0.0.1:{port}/0"


def wait_for_line(path: Path, text: str, timeout: float = 60) -> str:
    """A log's text once it holds `text` (AssertionError with its end after `timeout` s)."""
    deadline = time.monotonic() + timeout
    log = ""
    while time.monotonic() < deadline:
        log = path.read_text(errors="replace") if path.exists() else ""
        if text in log:
            return log
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path}: {log[-2000:]}")


@dataclass
class Pipeline:
    bootstrap: str
    redis_url: str
    name: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    partitions: int = 8
    workers: list[subprocess.Popen] = field(default_factory=list)  # and agent runners
    secret: bytes = field(default_factory=lambda: uuid.uuid4().hex.encode())  # the pipeline's MEMFILTER_SECRET
    settings: dict[str, str] = field(default_factory=dict)  # further settings of its workers (the stack's)
    containers: ContainerStack | None = None  # on the container backend: workers are containers on it
    postgres_url: str = ""  # the history's PostgreSQL tier (POSTGRES_URL), for the tests that use it

    @property
    def topics(self) -> Topics:
        return Topics(*(f"{t}-{self.name}" for t in ("chat-requests", "filtered-inputs", "persist-messages", "dlq", "reply-streams", "reply-stops")))

    @property
    def prefix(self) -> str:
        return f"test-{self.name}"

    def env(self, **extra: str) -> dict[str, str]:
        """A worker process's or a command's environment: this one's, the pipeline's settings on top."""
        return {**os.environ, **self.settings_env(**extra)}

    def settings_env(self, **extra: str) -> dict[str, str]:
        t = self.topics
        return {
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "REDIS_URL": self.redis_url,
            "MEMFILTER_GROUP": f"memfilter-{self.name}",
            "MEMFILTER_REDIS_PREFIX": self.prefix,
            "MEMFILTER_TOPIC_REQUESTS": t.requests,
            "MEMFILTER_TOPIC_FILTERED": t.filtered,
            "MEMFILTER_TOPIC_PERSIST": t.persist,
            "MEMFILTER_TOPIC_DLQ": t.dlq,
            "MEMFILTER_TOPIC_STREAMS": t.streams,
            "MEMFILTER_TOPIC_STOPS": t.stops,
            "MEMFILTER_DATA_DIR": f"/tmp/memfilter-test-{self.name}",
            "MEMFILTER_SECRET": self.secret.decode(),
            **({"POSTGRES_URL": self.postgres_url} if self.postgres_url else {}),
            **self.settings,
            **extra,
        }

    async def create_topics(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        replicas = min(3, len(self.bootstrap.split(",")))  # each broker of a replicated stack holds a copy
        try:
            retention = self.topics.retention_ms()
            await admin.create_topics([NewTopic(t, self.partitions, replicas, topic_configs=topic_configs(retention[t])) for t in self.topics.all()])
        finally:
            await admin.close()

    async def delete_topics(self) -> None:
        """The pipeline's topics, deleted (what a test made and no longer needs)."""
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.delete_topics(list(self.topics.all()))
        finally:
            await admin.close()

    def memfilter(self, *argv: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
        """Run the command line with this pipeline's settings (and `env` on top); text output."""
        return subprocess.run([sys.executable, "-m", "memfilter", *argv], capture_output=True, text=True, env=self.env(**env), cwd=REPO, timeout=timeout)

    def log_path(self, n: int) -> Path:
        return WORKER_LOGS / f"memfilter-test-{self.name}-worker{n}.log"

    def start_worker(self, **extra_env: str) -> subprocess.Popen:
        """A worker process; its web server's port is `worker.web_port`, its output in `worker.log_path`."""
        return self._start("worker", self.log_path(len(self.workers)), extra_env)

    def start_agent(self, **extra_env: str) -> subprocess.Popen:
        """An agent runner process (`memfilter agent`, echo model unless told) on the
        pipeline's topics; stopped with the workers."""
        log = WORKER_LOGS / f"memfilter-test-{self.name}-agent{len(self.workers)}.log"
        # From the beginning: a test's inputs may be on the topic before the runner has its partitions.
        return self._start("agent", log, {"MEMFILTER_AGENT_GROUP": f"agent-{self.name}", "MEMFILTER_AGENT_START": "earliest", **extra_env})

    def start_sink(self, **extra_env: str) -> subprocess.Popen:
        """`memfilter sink` on the pipeline's topics, store and PostgreSQL; stopped with the workers."""
        log = WORKER_LOGS / f"memfilter-test-{self.name}-sink{len(self.workers)}.log"
        return self._start("sink", log, {"MEMFILTER_SINK_GROUP": f"sink-{self.name}", **extra_env})

    def start_embedder(self, **extra_env: str) -> subprocess.Popen:
        """`memfilter embedder` on the pipeline's topics and PostgreSQL, after its sink; stopped with the workers."""
        log = WORKER_LOGS / f"memfilter-test-{self.name}-embedder{len(self.workers)}.log"
        return self._start("embedder", log, {"MEMFILTER_SINK_GROUP": f"sink-{self.name}", "MEMFILTER_EMBEDDER_GROUP": f"embedder-{self.name}", **extra_env})

    def start_answering(self, **worker_env: str) -> subprocess.Popen:
        """A worker and the echo agent runner, once the worker holds its partitions: the loop a
        gateway's turns need behind it. The worker."""
        worker = self.start_worker(**worker_env)
        self.start_agent()
        wait_for_line(worker.log_path, "memfilter worker ready", timeout=90)
        return worker

    def start_gateway(self, name: str, shared: bool = False, **extra_env: str) -> int:
        """A gateway process (`memfilter gateway`) on the pipeline, named `name` in its log's
        name, once ready; its port. Stopped with the workers. `shared`: it shares the partitions
        with the pipeline's other shared gateways (MEMFILTER_GATEWAY_ADDRESS, its own URL)."""
        port = free_port()
        if shared:
            extra_env["MEMFILTER_GATEWAY_ADDRESS"] = f"http://127.0.0.1:{port}"
        log = WORKER_LOGS / f"memfilter-test-{self.name}-gateway-{name}.log"
        gateway = subprocess.Popen(
            [sys.executable, "-m", "memfilter", "gateway", "--port", str(port)],
            env=self.env(**extra_env),
            cwd=REPO,
            stdout=open(log, "ab"),
            stderr=subprocess.STDOUT,
        )
        gateway.web_port = port
        self.workers.append(gateway)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                    return port
            except (urllib.error.URLError, ConnectionError):
                assert gateway.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)

    def _start(self, command: str, log_path: Path, extra_env: dict[str, str]) -> subprocess.Popen:
        loglevel = os.environ.get("MEMFILTER_TEST_LOGLEVEL", "warn")
        if self.containers:
            worker = self.containers.worker([command, "--loglevel", loglevel], self.settings_env(MEMFILTER_DATA_DIR="/tmp/memfilter", **extra_env), log_path)
            self.workers.append(worker)
            return worker
        port = free_port()
        process = subprocess.Popen(
            [sys.executable, "-m", "memfilter", command, "--web-port", str(port), "--loglevel", loglevel],
            env=self.env(**extra_env),
            cwd=REPO,
            stdout=open(log_path, "ab"),
            stderr=subprocess.STDOUT,
        )
        process.web_port = port
        process.log_path = log_path
        self.workers.append(process)
        return process

    def kill(self, worker: subprocess.Popen) -> None:
        worker.send_signal(signal.SIGKILL)
        worker.wait(30)

    def stop_all(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                w.terminate()
        for w in self.workers:
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()

    def store(self) -> tuple[aioredis.Redis, HistoryStore]:
        client = connect(self.redis_url)
        return client, HistoryStore(client, self.prefix)


async def save_case_history(store: HistoryStore, case: dict) -> list[str]:
    """A conformance case's stored history (and the other threads' rows) saved as the worker
    would have saved them, a regenerate's superseded rows superseded; the threads it made."""
    thread = case["request"]["threadId"]
    groups = defaultdict(list)
    for row in case["stored"]:
        groups[thread].append(row)
    for row in case["storedElsewhere"]:
        groups[row["threadId"]].append(row)
    for t, rows in groups.items():
        owner = case.get("owner") if t == thread and case.get("owner") else rows[0]["resourceId"]
        newest = max((parse_ms(r.get("createdAt")) or -1 for r in rows), default=-1)
        await store.claim([(r["id"], t) for r in rows])
        saved = [(r["id"], msgspec.json.encode(r)) for r in rows]
        assert await store.apply([Save(t, owner, newest, saved, [r["role"] for r in rows], b"", writer="processor")]) == [1]
        if t == thread and case.get("superseded"):  # as an earlier regenerate left them
            await store.apply([Save(t, owner, newest, [], [], b"", superseded=case["superseded"], request_id="earlier")])
    if case.get("owner") and not case["stored"]:
        await store.redis.hset(store.keys(thread).meta, "owner", case["owner"])
    return list(groups)


async def publish(bootstrap: str, topic: str, records: Iterable[tuple]) -> int:
    """Publish (key, value, timestamp ms[, headers]) records in order; the number published."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=4 << 20)
    await producer.start()
    n = 0
    try:
        pending = []
        for key, value, ts, *headers in records:
            pending.append(await producer.send(topic, value, key=key, timestamp_ms=ts, headers=list(headers[0]) if headers else None))
            n += 1
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return n


async def read(bootstrap: str, topics: list[str], until, timeout: float = 120) -> list[ConsumerRecord]:
    """Read `topics` from the beginning until `until(records)` holds or `timeout` passes."""
    consumer = AIOKafkaConsumer(*topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    records: list[ConsumerRecord] = []
    deadline = time.monotonic() + timeout
    try:
        while not until(records) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500, max_records=5000)
            for recs in batch.values():
                records.extend(recs)
    finally:
        await consumer.stop()
    return records


async def end_offsets(bootstrap: str, topic: str) -> str:
    """`--from`/`--to` of `memfilter replay`: the topic's end offsets now."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        return ",".join(f"{tp.partition}:{o}" for tp, o in (await consumer.end_offsets(tps)).items())
    finally:
        await consumer.stop()


def header(record: ConsumerRecord, name: str) -> str | None:
    return next((v.decode() for k, v in record.headers if k == name), None)


class Collector:
    """Reads topics from the beginning in the background, while a test does other things."""

    def __init__(self, bootstrap: str, topics: list[str], isolation_level: str = "read_uncommitted"):
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None, isolation_level=isolation_level, metadata_max_age_ms=1000
        )
        self.topics = topics
        self.records: list[ConsumerRecord] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> Collector:
        # Subscribed once started, not named at start: a topic just made on three brokers is not
        # known to every one of them at once, and a consumer started with a topic its broker does
        # not list yet fails (UnknownTopicOrPartition) and leaves work behind that holds up the
        # event loop's end. Subscribed, it reads the topics from the beginning once they are listed
        # (metadata read again every second, not every five minutes).
        await self.consumer.start()
        self.consumer.subscribe(self.topics)
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        while True:
            batch = await self.consumer.getmany(timeout_ms=200, max_records=5000)
            for recs in batch.values():
                self.records.extend(recs)

    async def wait_for(self, predicate, timeout: float = 180) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate(self.records):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()


WORKING_META = {
    b"epoch",
    b"replying",
    b"replying_ms",
    b"waiting",
}  # a thread's meta that is not history: fencing, the reply being made, the requests waiting for it


async def dump(pipeline: Pipeline, prefix: str, url: str | None = None) -> dict:
    """Every thread's rows, order, meta and applied saves, and the id index, under `prefix`
    (not the processed-request records, retry windows and replying marks, working state a
    rebuild does not restore, nor the fencing epochs and replication markers)."""
    client = connect(url or pipeline.redis_url)
    out = {}
    async for key in client.scan_iter(match=f"{prefix}:*"):
        name = key.decode().removeprefix(prefix)
        kind = await client.type(key)
        if (
            ":pending:" in name or name.endswith(":recent") or name == ":epoch" or name.startswith(":sync")
        ):  # not history: retries, re-delivery, fencing, replication markers
            continue
        if kind == b"list":
            out[name] = await client.lrange(key, 0, -1)
        elif kind == b"string":
            out[name] = await client.get(key)
        else:
            out[name] = {k: v for k, v in (await client.hgetall(key)).items() if k not in WORKING_META}
    await client.aclose()
    return out

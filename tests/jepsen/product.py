"""The product on the harness's hosts (`net.py`), each process on a host of its own, as a
deployment runs them on machines of their own: the stack's (`memfilter.stack.up` with
`Settings.hosts`: Kafka, Redis and PostgreSQL; `replicated`: three brokers and a Redis Cluster
of three masters with a replica each), each on the host named as the process (`kafka`, `redis`,
`postgres`; `kafka-1`..`kafka-3`, `redis-6379`..`redis-6384`), the workers on `worker-1`,
`worker-2`, the sink (which writes all history into PostgreSQL) on `sink`, the agent runner
(its `echo` model) on `agent` and the gateway on `gateway` (its callers named by a header, as
behind a proxy that sets it).

The stack's folder is STACK_DIR, its data made anew each run and the broker's jars kept (Maven
collects them once). Some folders are small tmpfs the harness mounts, so that a test can fill
them (`fill`, `room`): a broker's log, a Redis node's append-only file, PostgreSQL's data
(`Product.disks`).
Workers and brokers run under Debian's libfaketime, each with a clock file (`clock`). The network's removal
kills every process on its hosts; `unmount()` then unmounts the disks.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

from net import Host, Net

from memfilter import settings as product_settings
from memfilter import stack

REPO = Path(__file__).resolve().parents[2]
STACK_DIR = REPO / ".stack" / "jepsen"
LOGS = Path(os.environ.get("MEMFILTER_TEST_LOGS", "/tmp")) / "memfilter-jepsen"
SESSION_TIMEOUT_S = 6  # a worker's Kafka session: what a cut or a pause must outlast to move its partitions
# Debian's libfaketime: the wall clock of a worker or a broker is the machine's plus the offset
# in its clock file (`clock`); its monotonic clock is left alone, as an NTP step leaves it. A
# worker reads the file at every call; a broker, which reads the time far more often, once a
# second. libfaketime's "monotonic fix" (its own pthread_cond_timedwait) is off: with it, a
# JVM's timed waits return at once and a broker spins.
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
# The small disks' size: room for what several ten-minute schedules on one deployment write
# (a broker holds about 200 MB a schedule, mostly filtered inputs), so that only `fill` fills
# one. At 256 MB a broker's own log filled it in the second schedule, and the broker stopped
# for good, as a real broker whose disk is full of its own data does. tmpfs takes memory only
# for what is written: a full one holds this much until `room`.
DISK_MB = 2048
STOPPING_S = 30  # how long a broker whose disk filled may take to halt
WEB_PORT = 6069  # the sink's, the agent runner's and the gateway's web servers (`/readyz`), each on its host
RESOURCE_HEADER = "X-Memfilter-Resource"  # the gateway's callers: MEMFILTER_GATEWAY_AUTH=header
# The gateway's callers: a turn every second or so, and a read of the thread after each, past
# the default fair share of one caller (MEMFILTER_GATEWAY_CALLER_RATE 0.5).
GATEWAY = {"MEMFILTER_GATEWAY_AUTH": "header", "MEMFILTER_GATEWAY_CALLER_RATE": "10", "MEMFILTER_GATEWAY_CALLER_BURST": "20"}


def stack_names(replicated: bool) -> list[str]:
    """The stack's processes, each the name of the host it runs on."""
    return stack.Settings(STACK_DIR, 9092, 9093, 6379, 5432, None, brokers=3 if replicated else 1, redis_cluster=replicated).names()


class Product:
    def __init__(self, net: Net, replicated: bool = False):
        self.net = net
        self.replicated = replicated
        self.names = stack_names(replicated)
        self.kafka = [n for n in self.names if n.startswith("kafka")]
        self.redis = [n for n in self.names if n.startswith("redis")]
        self.disks = [self.kafka[0], self.redis[0], "postgres"]  # the folders on a small disk of their own: `fill` fills one
        base = stack.Settings.of(product_settings.Settings.from_env(), None, len(self.kafka), replicated)
        self.settings = dataclasses.replace(base, dir=STACK_DIR, hosts=tuple((n, net[n].address) for n in self.names))
        self.secret = secrets.token_hex(32)
        self.env: dict[str, str] = {}
        self.workers: dict[str, subprocess.Popen] = {}
        self.parts: dict[str, subprocess.Popen] = {}  # the sink, the agent runner and the gateway, each on the host of its name

    def _clocked(self, name: str) -> list[str]:
        """The environment that runs a process under its clock file (`clock`), at the machine's time for now."""
        if not FAKETIME.exists():
            raise RuntimeError(f"no {FAKETIME}: the Jepsen tier moves clocks with Debian's faketime (apt-get install faketime)")
        self.clock(name, 0)
        read = "FAKETIME_CACHE_DURATION=1" if name in self.kafka else "FAKETIME_NO_CACHE=1"
        return [
            "env",
            f"LD_PRELOAD={FAKETIME}",
            f"FAKETIME_TIMESTAMP_FILE={self._clock_file(name)}",
            read,
            "FAKETIME_DONT_FAKE_MONOTONIC=1",
            "FAKETIME_FORCE_MONOTONIC_FIX=0",
        ]

    def _enter(self, name: str) -> list[str]:
        """How the stack's process `name` is started on its host (a broker, under its clock)."""
        return ["ip", "netns", "exec", self.net[name].ns, *(self._clocked(name) if name in self.kafka else ())]

    def up(self) -> None:
        """The stack, its data made anew; `env` then holds what a process needs to reach it."""
        self.unmount()
        for kept in STACK_DIR.glob("*") if STACK_DIR.exists() else ():
            if kept.name != "kafka-libs":
                shutil.rmtree(kept) if kept.is_dir() else kept.unlink()
        LOGS.mkdir(parents=True, exist_ok=True)
        for name in self.disks:
            (STACK_DIR / name).mkdir(parents=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", f"mfj-{name}", str(STACK_DIR / name)], check=True)
        running = stack.up(self.settings, timeout=180, enter=self._enter)
        exports = running.exports(self.settings, self.secret).splitlines()
        self.env = dict(line.removeprefix("export ").split("=", 1) for line in exports)
        self.env["MEMFILTER_SESSION_TIMEOUT"] = str(SESSION_TIMEOUT_S)

    def unmount(self) -> None:
        """The small disks unmounted (lazily: a process just killed may still hold a file there)."""
        for name in self.disks:
            subprocess.run(["umount", "-l", str(STACK_DIR / name)], capture_output=True)

    def pids(self) -> dict[str, int]:
        """The stack's processes by name (`kafka-2`, `redis-6379`, ...)."""
        running = stack.recorded(self.settings)
        assert running is not None, f"no stack recorded in {STACK_DIR}"
        return running.pids

    def restart(self) -> None:
        """What of the stack stopped, started again on its data (as an operator does: `memfilter stack up`)."""
        stack.up(self.settings, timeout=180, enter=self._enter)

    def pairs(self) -> list[tuple[str, str]]:
        """The Redis Cluster's masters as they are now, each with its replica: (master, replica)."""
        by_address = {f"{self.net[n].address}:{self.settings.redis_ports[i]}": n for i, n in enumerate(self.redis)}
        for name in self.redis:
            done = subprocess.run(
                ["redis-cli", "-h", self.net[name].address, "-p", name.split("-")[1], "cluster", "nodes"], capture_output=True, text=True, timeout=10
            )
            if done.returncode == 0 and done.stdout.strip():
                nodes = [line.split() for line in done.stdout.splitlines()]
                names = {node[0]: by_address[node[1].split("@")[0]] for node in nodes}
                replicas = {node[3]: names[node[0]] for node in nodes if "slave" in node[2]}
                return sorted((names[node[0]], replicas[node[0]]) for node in nodes if "master" in node[2] and len(node) > 8)
        raise RuntimeError("no Redis node answered CLUSTER NODES")

    def fill(self, name: str) -> None:
        """The disk under process `name`'s data (one of `disks`) full: a file takes what is left of it."""
        chunk = b"\0" * (1 << 20)
        with open(STACK_DIR / name / "filler", "wb", buffering=0) as f:
            while True:
                try:
                    f.write(chunk)
                except OSError:  # no space left: full
                    return

    def room(self, name: str) -> None:
        """The disk under `name`'s data given room again, and what of the stack stopped started
        again (`restart`), as an operator does. A broker whose only log folder failed halts
        (Kafka's rule) a moment after; it is let finish first, or the restart would find it
        still running, leave it, and the broker would then be gone for good. One still running
        after STOPPING_S never wrote to the full disk, and is left running."""
        if name in self.kafka:
            deadline = time.monotonic() + STOPPING_S
            while stack.alive(self.settings, stack.recorded(self.settings))[name] and time.monotonic() < deadline:
                time.sleep(0.2)
        (STACK_DIR / name / "filler").unlink(missing_ok=True)
        self.restart()

    def worker(self, host: Host) -> subprocess.Popen:
        """A worker on `host`, logging to LOGS, its wall clock the machine's until `clock` moves it."""
        process = host.popen(
            [*self._clocked(host.name), sys.executable, "-m", "memfilter", "worker", "--loglevel", "info"],
            env=os.environ | self.env | {"MEMFILTER_DATA_DIR": f"/tmp/memfilter-jepsen-{host.name}"},
            log=LOGS / f"{host.name}.log",
            cwd=REPO,
        )
        self.workers[host.name] = process
        return process

    def start(self, part: str, host: Host) -> subprocess.Popen:
        """The sink, the agent runner (`echo`: offline) or the gateway on `host`, logging to
        LOGS; its web server (`/readyz`; the gateway's API) on WEB_PORT of the host's address."""
        web = {
            "sink": {"MEMFILTER_WEB_BIND": host.address, "MEMFILTER_SINK_WEB_PORT": str(WEB_PORT)},
            "agent": {"MEMFILTER_WEB_BIND": host.address, "MEMFILTER_AGENT_WEB_PORT": str(WEB_PORT), "MEMFILTER_AGENT_BACKEND": "echo"},
            "gateway": {"MEMFILTER_GATEWAY_BIND": host.address, "MEMFILTER_GATEWAY_PORT": str(WEB_PORT), **GATEWAY},
        }[part]
        self.parts[part] = host.popen(
            [sys.executable, "-m", "memfilter", part, "--loglevel", "info"],
            env=os.environ | self.env | web | {"MEMFILTER_DATA_DIR": f"/tmp/memfilter-jepsen-{host.name}"},
            log=LOGS / f"{host.name}.log",
            cwd=REPO,
        )
        return self.parts[part]

    def transactions(self) -> str:
        """Kafka's open transactions, as its own tool tells them (`kafka-transactions.sh`): every
        transactional id with its state, and each `persist-messages` partition's producers with
        the offset their open transaction holds the partition's stable offset at. For a run that
        failed: a transaction that never ends stops its partitions' readers."""
        tool = ["java", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", f"{STACK_DIR / 'kafka-libs'}/*", "org.apache.kafka.tools.TransactionsCommand"]
        host, bootstrap = self.net["worker-1"], ["--bootstrap-server", self.env["KAFKA_BOOTSTRAP_SERVERS"]]

        def told(*args: str) -> str:
            try:
                done = host.run([*tool, *bootstrap, *args], timeout=60)
            except subprocess.TimeoutExpired:  # Kafka not answering: said, and the rest asked all the same
                return f"kafka-transactions.sh {' '.join(args)}: no answer within 60 s\n"
            return done.stdout + done.stderr

        listed = told("list")
        out = [listed]
        for line in listed.splitlines()[1:]:  # TransactionalId Coordinator ProducerId TransactionState: what each open one holds
            if len(fields := line.split()) == 4 and fields[3] not in ("Empty", "CompleteCommit", "CompleteAbort"):
                out.append(told("describe", "--transactional-id", fields[0]))
        for partition in range(self.settings.partitions or stack.DEFAULT_PARTITIONS):
            out.append(f"persist-messages-{partition}:\n" + told("describe-producers", "--topic", "persist-messages", "--partition", str(partition)))
        return "\n".join(out)

    def _clock_file(self, name: str) -> Path:
        return LOGS / f"{name}.clock"

    def clock(self, name: str, seconds: int) -> None:
        """The wall clock of the worker or the broker on host `name` jumps to the machine's plus `seconds`."""
        self._clock_file(name).write_text(f"{seconds:+d}\n")

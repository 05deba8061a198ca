"""The product on the harness's hosts (`net.py`), each process on a host of its own, as a
deployment runs them on machines of their own: the stack's (`memfilter.stack.up` with
`Settings.hosts`: Kafka, Redis and PostgreSQL; `replicated`: three brokers and a Redis Cluster
of three masters with a replica each), each on the host named as the process (`kafka`, `redis`,
`postgres`; `kafka-1`..`kafka-3`, `redis-6379`..`redis-6384`), the workers on `worker-1`,
`worker-2`, the sink (which writes all history into PostgreSQL) on `sink` and the agent runner
(its `echo` model) on `agent`.

The stack's folder is STACK_DIR, its data made anew each run and the broker's jars kept (Maven
collects them once). Some folders are small tmpfs the harness mounts, so that a test can fill
them (`fill`, `free`): a broker's log, a Redis node's append-only file, PostgreSQL's data
(`Product.disks`).
Workers run under Debian's libfaketime, each with a clock file (`clock`). The network's removal
kills every process on its hosts; `unmount()` then unmounts the disks.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from net import Host, Net

from memfilter import settings as product_settings
from memfilter import stack

REPO = Path(__file__).resolve().parents[2]
STACK_DIR = REPO / ".stack" / "jepsen"
LOGS = Path(os.environ.get("MEMFILTER_TEST_LOGS", "/tmp")) / "memfilter-jepsen"
SESSION_TIMEOUT_S = 6  # a worker's Kafka session: what a cut or a pause must outlast to move its partitions
# Debian's libfaketime: a worker's wall clock is the machine's plus the offset in its clock file
# (`clock`), read at every call; its monotonic clock is left alone, as an NTP step leaves it.
# Brokers do not run under it: libfaketime 0.9.10 wraps the timed waits a JVM parks its threads
# in, and a broker under it spins at full CPU and takes minutes to start.
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
DISK_MB = 256
WEB_PORT = 6069  # the sink's and the agent runner's web servers (`/readyz`), each on its host


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
        self.parts: dict[str, subprocess.Popen] = {}  # the sink and the agent runner, each on the host of its name

    def _clocked(self, name: str) -> list[str]:
        """The environment that runs a process under its clock file (`clock`), at the machine's time for now."""
        if not FAKETIME.exists():
            raise RuntimeError(f"no {FAKETIME}: the Jepsen tier moves clocks with Debian's faketime (apt-get install faketime)")
        self.clock(name, 0)
        return ["env", f"LD_PRELOAD={FAKETIME}", f"FAKETIME_TIMESTAMP_FILE={self._clock_file(name)}", "FAKETIME_NO_CACHE=1", "FAKETIME_DONT_FAKE_MONOTONIC=1"]

    def _enter(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.net[name].ns]

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

    def free(self, name: str) -> None:
        (STACK_DIR / name / "filler").unlink(missing_ok=True)

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
        """The sink or the agent runner (`echo`: offline) on `host`, logging to LOGS; its
        `/readyz` on WEB_PORT of the host's address."""
        port = {"sink": "MEMFILTER_SINK_WEB_PORT", "agent": "MEMFILTER_AGENT_WEB_PORT"}[part]
        self.parts[part] = host.popen(
            [sys.executable, "-m", "memfilter", part, "--loglevel", "info"],
            env=os.environ
            | self.env
            | {
                "MEMFILTER_WEB_BIND": host.address,
                port: str(WEB_PORT),
                "MEMFILTER_AGENT_BACKEND": "echo",
                "MEMFILTER_DATA_DIR": f"/tmp/memfilter-jepsen-{host.name}",
            },
            log=LOGS / f"{host.name}.log",
            cwd=REPO,
        )
        return self.parts[part]

    def _clock_file(self, name: str) -> Path:
        return LOGS / f"{name}.clock"

    def clock(self, name: str, seconds: int) -> None:
        """The wall clock of the worker on host `name` jumps to the machine's plus `seconds`."""
        self._clock_file(name).write_text(f"{seconds:+d}\n")

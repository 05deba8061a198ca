"""The product on the harness's hosts (`net.py`): `memfilter stack up` on the host `stack`
(Kafka, Redis and PostgreSQL on its address: MEMFILTER_STACK_HOST; `replicated`: three brokers
and a Redis Cluster), and workers on hosts of their own, as a deployment runs them on machines
of their own.

The stack's folder is STACK_DIR, its data made anew each run and the broker's jars kept (Maven
collects them once); Redis's folder is a small tmpfs the harness mounts, so that a test can
fill it. `down()` stops the stack and unmounts it; the network's removal kills whatever is left.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

from net import Host, Net

REPO = Path(__file__).resolve().parents[2]
STACK_DIR = REPO / ".stack" / "jepsen"
LOGS = Path(os.environ.get("MEMFILTER_TEST_LOGS", "/tmp")) / "memfilter-jepsen"
SESSION_TIMEOUT_S = 6  # a worker's Kafka session: what a cut or a pause must outlast to move its partitions
# Debian's libfaketime: each worker's wall clock is the machine's plus the offset in its clock
# file, read at every call (`clock`); its monotonic clock is left alone, as an NTP step leaves it.
REDIS_DISK = STACK_DIR / "redis"  # the stack's Redis keeps its append-only file here: a tmpfs the harness mounts
REDIS_DISK_MB = 256
FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


class Product:
    def __init__(self, net: Net, replicated: bool = False):
        self.net = net
        self.replicated = replicated  # three brokers and a Redis Cluster (three masters, a replica each), all on the host `stack`
        self.stack = net["stack"]
        self.secret = secrets.token_hex(32)
        self.env: dict[str, str] = {}
        self.workers: dict[str, subprocess.Popen] = {}

    def _stack(self, *argv: str) -> subprocess.CompletedProcess:
        env = os.environ | {"MEMFILTER_STACK_HOST": self.stack.address, "MEMFILTER_STACK_DIR": str(STACK_DIR)}
        return self.stack.run([sys.executable, "-m", "memfilter", "stack", *argv], env=env, cwd=REPO, timeout=600)

    def up(self) -> None:
        """The stack, its data made anew, Redis's on a small disk of its own (REDIS_DISK: `fill`
        fills it); `env` then holds what a process needs to reach it."""
        subprocess.run(["umount", str(REDIS_DISK)], capture_output=True)
        for kept in STACK_DIR.glob("*") if STACK_DIR.exists() else ():
            if kept.name != "kafka-libs":
                shutil.rmtree(kept) if kept.is_dir() else kept.unlink()
        LOGS.mkdir(parents=True, exist_ok=True)
        REDIS_DISK.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={REDIS_DISK_MB}m", "mfj-redis", str(REDIS_DISK)], check=True)
        done = self._stack("up", *(["--brokers", "3", "--redis-cluster"] if self.replicated else []))
        if done.returncode != 0:
            raise RuntimeError(f"memfilter stack up on {self.stack.address} failed: {done.stderr[-2000:]}")
        exports = dict(line.removeprefix("export ").split("=", 1) for line in done.stdout.splitlines() if line.startswith("export "))
        # PostgreSQL answers loopback alone (its stack's trust rule): the workers keep history in Redis
        exports.pop("POSTGRES_URL", None)
        self.env = {k: v.strip("'\"") for k, v in exports.items()} | {
            "MEMFILTER_SECRET": self.secret,
            "MEMFILTER_SESSION_TIMEOUT": str(SESSION_TIMEOUT_S),
        }

    def down(self) -> None:
        self._stack("down")
        subprocess.run(["umount", str(REDIS_DISK)], capture_output=True)

    def pids(self) -> dict[str, int]:
        """The stack's processes by name (`kafka-2`, `redis-6379`, ...), as `memfilter stack status` lists them."""
        lines = self._stack("status").stdout.splitlines()[1:]
        return {name: int(pid) for name, state, _, pid, *_ in (line.split() for line in lines) if state == "running"}

    def fill(self) -> None:
        """Redis's disk full: a file takes what is left of it."""
        chunk = b"\0" * (1 << 20)
        with open(REDIS_DISK / "filler", "wb", buffering=0) as f:
            while True:
                try:
                    f.write(chunk)
                except OSError:  # no space left: full
                    return

    def free(self) -> None:
        (REDIS_DISK / "filler").unlink(missing_ok=True)

    def worker(self, host: Host) -> subprocess.Popen:
        """A worker on `host`, logging to LOGS, its wall clock the machine's until `clock` moves it."""
        if not FAKETIME.exists():
            raise RuntimeError(f"no {FAKETIME}: the Jepsen tier moves workers' clocks with Debian's faketime (apt-get install faketime)")
        self.clock(host.name, 0)
        clock = {"LD_PRELOAD": str(FAKETIME), "FAKETIME_TIMESTAMP_FILE": str(self._clock_file(host.name)), "FAKETIME_NO_CACHE": "1", "DONT_FAKE_MONOTONIC": "1"}
        process = host.popen(
            [sys.executable, "-m", "memfilter", "worker", "--loglevel", "info"],
            env=os.environ | self.env | clock | {"MEMFILTER_DATA_DIR": f"/tmp/memfilter-jepsen-{host.name}"},
            log=LOGS / f"{host.name}.log",
            cwd=REPO,
        )
        self.workers[host.name] = process
        return process

    def _clock_file(self, name: str) -> Path:
        return LOGS / f"{name}.clock"

    def clock(self, name: str, seconds: int) -> None:
        """The wall clock of the worker on host `name` jumps to the machine's plus `seconds`."""
        self._clock_file(name).write_text(f"{seconds:+d}\n")

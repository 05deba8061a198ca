"""The product on the harness's hosts (`net.py`): `memfilter stack up` on the host `stack`
(Kafka, Redis and PostgreSQL on its address: MEMFILTER_STACK_HOST), and workers on hosts of
their own, as a deployment runs them on machines of their own.

The stack's folder is STACK_DIR, its data made anew each run and the broker's jars kept (Maven
collects them once). `down()` stops it; the network's removal kills whatever is left.
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


class Product:
    def __init__(self, net: Net):
        self.net = net
        self.stack = net["stack"]
        self.secret = secrets.token_hex(32)
        self.env: dict[str, str] = {}
        self.workers: dict[str, subprocess.Popen] = {}

    def _stack(self, *argv: str) -> subprocess.CompletedProcess:
        env = os.environ | {"MEMFILTER_STACK_HOST": self.stack.address, "MEMFILTER_STACK_DIR": str(STACK_DIR)}
        return self.stack.run([sys.executable, "-m", "memfilter", "stack", *argv], env=env, cwd=REPO, timeout=600)

    def up(self) -> None:
        """The stack, its data made anew; `env` then holds what a process needs to reach it."""
        for kept in STACK_DIR.glob("*") if STACK_DIR.exists() else ():
            if kept.name != "kafka-libs":
                shutil.rmtree(kept) if kept.is_dir() else kept.unlink()
        LOGS.mkdir(parents=True, exist_ok=True)
        done = self._stack("up")
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

    def worker(self, host: Host) -> subprocess.Popen:
        """A worker on `host`, logging to LOGS."""
        process = host.popen(
            [sys.executable, "-m", "memfilter", "worker", "--loglevel", "info"],
            env=os.environ | self.env | {"MEMFILTER_DATA_DIR": f"/tmp/memfilter-jepsen-{host.name}"},
            log=LOGS / f"{host.name}.log",
            cwd=REPO,
        )
        self.workers[host.name] = process
        return process

"""docs/gateway.md's quick start, run as written: its shell block, in a shell whose PATH has the
installed `memfilter` (the checkout's .venv) and whose MEMFILTER_STACK_DIR and ports name the
test stack (so its `memfilter stack up` finds it running and exports its addresses). The
worker, the agent runner and the gateway it starts listen on their default ports and use the
default topics, group and prefix, as run-local does: one test of them at a time."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess

import pytest
from pipeline import REPO

pytestmark = pytest.mark.xdist_group("default-topics")  # the default topics, groups, prefix and web ports


def quick_start() -> str:
    doc = (REPO / "docs" / "gateway.md").read_text()
    section = doc.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```sh\n(.*?)```", section, re.S)
    return block


def test_the_gateway_quick_start_runs_as_written_and_streams_the_answer(services, tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("MEMFILTER_", "KAFKA_", "REDIS_", "POSTGRES_"))},
        "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}",
        "MEMFILTER_STACK_DIR": str(services.stack_dir),
        "MEMFILTER_KAFKA_PORT": services.bootstrap.rsplit(":", 1)[1],
        "MEMFILTER_REDIS_PORT": services.redis_url.rsplit(":", 1)[1].split("/")[0],
        "MEMFILTER_CONTROLLER_PORT": os.environ.get("MEMFILTER_CONTROLLER_PORT", "19093"),
        "MEMFILTER_POSTGRES_PORT": services.postgres_url.rsplit(":", 1)[1].split("/")[0],
    }
    shell = subprocess.Popen(["bash", "-e", "-c", quick_start()], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = shell.communicate(timeout=180)
    finally:
        os.killpg(shell.pid, signal.SIGTERM)  # the worker, the agent runner and the gateway it left running
    logs = {name: (tmp_path / f"{name}.log").read_text()[-2000:] for name in ("worker", "agent", "gateway") if (tmp_path / f"{name}.log").exists()}
    assert shell.returncode == 0, (err.decode()[-3000:], logs)
    events = [line.removeprefix("data: ") for line in out.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", out.decode()
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["type"] == "start" and chunks[-1]["type"] == "finish"
    assert "".join(c["delta"] for c in chunks if c["type"] == "text-delta") == "echo: Hello!"

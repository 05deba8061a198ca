"""The worker benchmark's workload still fits the processor: its seeded history and its
requests, decided by the processor against a real Redis, give filtered inputs and no errors;
and the processor benchmark runs on it. (The benchmarks run by hand, with a stack; this keeps
a renamed field or a changed rule from breaking them unseen.) The benchmarks are no import
name of the package: run from the checkout."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import asyncio, json, sys
from benchmarks.worker_throughput import make_workload, seed
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store.history import HistoryStore
from memfilter.store.redis_driver import connect

async def main(url, prefix):
    history, requests = make_workload(40, 120)
    await seed(url, prefix, history)
    client = connect(url)
    store = HistoryStore(client, prefix)
    try:
        records = [Record(Topics().requests, 0, n, 1772366400000 + n, key, value) for n, (key, value) in enumerate(requests)]
        outs = await Processor(store).process(records)
        print(json.dumps({t: sum(o.topic == t for o in outs) for t in {o.topic for o in outs}}))
        print(json.dumps([dict(o.headers).get("error.type", b"").decode() for o in outs if o.topic == Topics().dlq]))
    finally:
        await store.drop()
        await client.aclose()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_the_benchmarks_workload_is_decided_without_an_error(redis_url):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, redis_url, f"bench-{uuid.uuid4().hex[:8]}"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    counts, errors = (json.loads(line) for line in done.stdout.splitlines())
    assert counts["filtered-inputs"] == 120 and errors == []


def test_the_processor_benchmark_decides_the_workload_and_prints_its_cpu_per_request(redis_url):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.processor_cpu", "--threads", "40", "--requests", "120"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"processor CPU: \d+ µs per request \(120 requests in batches of 1,500\)\n", done.stdout)

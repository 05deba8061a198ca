"""The worker benchmark's workload still fits the processor: its seeded history and its
requests, decided by the processor against a real Redis (`benchmarks.processor_cpu`), give a
filtered input each and no errors, and the benchmark prints its figure. (The benchmarks run by
hand, with a stack; this keeps a renamed field or a changed rule from breaking them unseen.)
The benchmarks are no import name of the package: run from the checkout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_benchmarks_workload_is_decided_without_an_error_and_the_processor_benchmark_prints_its_cpu(redis_url):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.processor_cpu", "--threads", "40", "--requests", "120"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr  # a dead letter fails the run, naming its error type
    assert re.fullmatch(r"processor CPU: \d+ µs per request \(120 requests in batches of 1,500: 120 filtered inputs, no dead letters\)\n", done.stdout)


def test_two_processors_in_lockstep_take_turns_a_batch_at_a_time_and_print_their_ratio(redis_url):
    done = subprocess.run(
        # this checkout against itself (no worktree to set up); 3,100 requests are three batches of the worker's size
        [sys.executable, "-m", "benchmarks.alternate", "--benchmark", "processor_cpu", "--lockstep", "--old", ".", "--new", ".", "--pairs", "1"]
        + ["--", "--threads", "1000", "--requests", "3100"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "REDIS_URL": redis_url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    run, summary = done.stdout.splitlines()
    ratio = re.fullmatch(r"run 1: processor CPU new/old (\d\.\d{3}) \(batches' median \d\.\d{3}\)", run)
    assert ratio and 0.5 < float(ratio[1]) < 2  # one commit against itself
    assert re.fullmatch(r"new \(\.\) / old \(\.\), processor CPU, by run: \d\.\d{3}   median \d\.\d{3}", summary)

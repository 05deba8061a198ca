"""`benchmarks.alternate` reads the figures a benchmark prints, in the words of today's
`benchmarks.worker_throughput` and `benchmarks.processor_cpu` and of d428f30's worker benchmark
(the baseline issue 35 measures against): a reworded line would otherwise drop a figure from
the side-by-side table unseen. The benchmarks are no import name of the package: run from the
checkout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TODAY = """workload: 50,000 requests over 5,000 threads, 7.7 KiB mean, 7.7 KiB median
(a) aiokafka consume+produce:     13,574 requests/s   CPU 45 µs per request
(b) memfilter worker, MEMFILTER_HISTORY_MESSAGES=0:     3,900 requests/s   (b)/(a) = 0.29
    filtered input: 2,736 bytes mean
    worker CPU: 200 µs per request, busy 78% of the time
(b) memfilter worker, MEMFILTER_HISTORY_MESSAGES=10:     3,024 requests/s   (b)/(a) = 0.22
    Redis round trips/request:  0.0192
    filtered input: 5,360 bytes mean
    worker CPU: 258 µs per request, busy 78% of the time
(c) publish -> filtered input at 1,500 requests/s: p50 138 ms, p99 1,257 ms
"""
D428F30 = """(a) aiokafka consume+produce:     15,805 requests/s   CPU 45 µs per request
(b) memfilter worker:               4,301 requests/s   (b)/(a) = 0.27
    worker CPU: 180 µs per request, busy 77% of the time
(c) publish -> filtered input at 800 requests/s: p50 103 ms, p99 218 ms
"""
PROCESSOR = "processor CPU: 192 µs per request (15,000 requests in batches of 1,500: 15,000 filtered inputs, no dead letters)\n"

READ = """
import json, sys
from benchmarks.alternate import FIGURES
out = {}
for name, text in json.load(sys.stdin).items():
    out[name] = {figure: pattern.findall(text)[-1] for figure, pattern in FIGURES.items() if pattern.findall(text)}
print(json.dumps(out))
"""


def test_the_figures_of_todays_benchmarks_and_of_d428f30s_are_read_from_the_last_worker():
    done = subprocess.run(
        [sys.executable, "-c", READ],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO)},
        input=json.dumps({"today": TODAY, "d428f30": D428F30, "processor": PROCESSOR}),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    read = json.loads(done.stdout)
    assert read["today"] == {"requests/s": "3,024", "CPU µs/request": "258", "filtered bytes": "5,360", "p50 ms": "138", "p99 ms": "1,257"}
    assert read["d428f30"] == {"requests/s": "4,301", "CPU µs/request": "180", "p50 ms": "103", "p99 ms": "218"}
    assert read["processor"] == {"processor CPU µs/request": "192"}

"""`memfilter replay` streams what it reads: its memory does not grow with the topics or the
range. 30,000 requests (3,000 threads of ten turns) are processed by two workers; the
first 5,000 and then all of them are replayed, each in a process that reports its peak
resident memory (printed with `pytest -s`)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time

from pipeline import REPO, end_offsets, publish

THREADS, TURNS = 3_000, 10
PEAK = "import resource, sys; from memfilter.cli import main; rc = main(sys.argv[1:]); print(f'peak_kb={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}', file=sys.stderr); sys.exit(rc)"


def requests():
    """Turn by turn over all threads: a sixth of each partition is the first 5,000."""
    for turn in range(TURNS):
        for t in range(THREADS):
            thread = f"mem-{t}"
            messages = [
                {"id": f"{thread}-u{k}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"turn {k} of a conversation"}]}}
                for k in range(turn + 1)
            ]
            body = {"requestId": f"{thread}-r{turn}", "threadId": thread, "resourceId": "user-mem", "messages": messages}
            yield thread.encode(), json.dumps(body).encode(), 1_700_000_000_000 + turn


def offsets(text: str) -> dict[int, int]:
    return {int(p): int(o) for p, o in (part.split(":") for part in text.split(","))}


def replay_peak(pipeline, *argv: str) -> tuple[int, str]:
    result = subprocess.run(
        [sys.executable, "-c", PEAK, "replay", "--strict", *argv], capture_output=True, text=True, env=pipeline.env(), cwd=REPO, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return int(re.search(r"peak_kb=(\d+)", result.stderr).group(1)) // 1024, result.stdout.strip().splitlines()[-1]


def test_replay_memory_stays_flat_from_5k_to_30k_requests(pipeline):
    t = pipeline.topics
    asyncio.run(publish(pipeline.bootstrap, t.requests, requests()))
    pipeline.start_worker()
    pipeline.start_worker()
    total = THREADS * TURNS
    deadline = time.monotonic() + 600
    while sum(offsets(asyncio.run(end_offsets(pipeline.bootstrap, t.filtered))).values()) < total:
        assert time.monotonic() < deadline and all(w.poll() is None for w in pipeline.workers), "the workers did not process the requests"
        time.sleep(2)
    pipeline.stop_all()

    ends = offsets(asyncio.run(end_offsets(pipeline.bootstrap, t.requests)))
    first_sixth = ",".join(f"{p}:{o // 6}" for p, o in ends.items())
    small_mb, small = replay_peak(pipeline, "--to", first_sixth)
    large_mb, large = replay_peak(pipeline)
    print(f"\nreplay peak memory: {small_mb} MB for `{small}`; {large_mb} MB for `{large}`")
    for line in (small, large):
        assert re.fullmatch(r"replayed ([\d,]+) requests: \1 identical, 0 different", line), line
    assert large == "replayed 30,000 requests: 30,000 identical, 0 different"
    assert large_mb < small_mb * 1.25, f"{small_mb} MB for 5,000 requests, {large_mb} MB for 30,000"

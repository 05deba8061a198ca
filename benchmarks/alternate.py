"""Benchmark: two commits' workers side by side, runs alternated on one stack, as ratios.

This machine's speed swings up to 2x from one day to the next and 10-20% from one run to the
next, so a change is measured against the commit before it in the same sitting, old and new
alternated (old, new, new, old, old, new, ...), and judged by the ratio of each adjacent pair.
Each commit runs its own `benchmarks.worker_throughput` from a git worktree (made once under
the temporary folder, set up with its own `deploy/setup.sh`), so an old commit is measured as
it was, whatever its benchmark's options were then. `--new .` measures this checkout as it is,
uncommitted changes too.

    eval "$(memfilter stack up)"
    python -m benchmarks.alternate --old d428f30 --new . --pairs 3 \\
        --new-args "--history 10" -- --threads 5000 --requests 50000 --latency-rate 1500

It prints, for each run, the worker's requests/s, CPU per request, the filtered input's mean
bytes and p50/p99 latency (what the run printed), then each pair's new/old ratio and their median.
`--benchmark processor_cpu` runs `benchmarks.processor_cpu` instead (the processor alone, on
Redis, no Kafka: seconds a run, so more pairs), for a change of the processor, the filter or
the history store; both commits need that benchmark (since it was added).

`--lockstep` (with `--benchmark processor_cpu`) alternates batches rather than runs: both
commits' processors run at once, each in its own process, and take turns a batch at a time
(~0.5 s each), so that both see the machine as it is in the same second and its swings cancel
out of the ratio. A process's own layout moves its speed by a few percent too (where its
memory lands, its hash seed), so both run without address randomization and with one hash
seed. Both run this checkout's `benchmarks.processor_cpu` with their own package (each
worktree's), so the old commit needs only the processor's interface as it is now. Measured
here, one commit against itself: 0.983-0.998 over four runs of 15,000 requests, 0.955-1.004
over five of 30,000 (median 0.998); runs alternated gave 0.92-1.17 over eight pairs for a
change worth about 1%.

    python -m benchmarks.alternate --benchmark processor_cpu --lockstep --old HEAD --pairs 6 \
        -- --threads 5000 --requests 30000
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What a run's output says, as worker_throughput has printed it since d428f30; the last match
# counts (the last (b) is the worker the latency phase ran on).
FIGURES = {
    "requests/s": re.compile(r"^\(b\) memfilter worker.*?([\d,]+) requests/s", re.M),
    "CPU µs/request": re.compile(r"worker CPU: (\d+) µs per request"),
    "filtered bytes": re.compile(r"filtered input: ([\d,]+) bytes mean"),
    "p50 ms": re.compile(r"p50 ([\d,]+) ms"),
    "p99 ms": re.compile(r"p99 ([\d,]+) ms"),
    "processor CPU µs/request": re.compile(r"processor CPU: (\d+) µs per request"),
}


def checkout(rev: str) -> Path:
    """A set-up worktree of `rev` (`.`: this checkout as it is)."""
    if rev == ".":
        return ROOT
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short=12", rev], check=True, capture_output=True, text=True).stdout.strip()
    path = Path(tempfile.gettempdir()) / "memfilter-bench" / commit
    if not (path / ".venv").exists():
        if not path.exists():
            subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-f", path, commit], check=True, capture_output=True)
        print(f"setting up {rev} ({commit}) in {path}", flush=True)
        subprocess.run(["./deploy/setup.sh"], cwd=path, check=True, stdout=subprocess.DEVNULL)
    return path


def run(path: Path, benchmark: str, args: list[str]) -> dict[str, float]:
    """One run of that checkout's benchmark: its figures (a missing one is left out)."""
    env = {**os.environ, "PYTHONPATH": "."}
    done = subprocess.run([".venv/bin/python", "-m", f"benchmarks.{benchmark}", *args], cwd=path, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the benchmark failed in {path} (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    figures = {}
    for name, pattern in FIGURES.items():
        if found := pattern.findall(done.stdout):
            figures[name] = float(found[-1].replace(",", ""))
    return figures


def lockstep(sides: dict[str, tuple[Path, list[str]]]) -> tuple[float, float]:
    """One run of both commits' processors in lockstep (the module's header): the new/old ratio
    of their CPU in all, and the median of the ratios of their batches, taken in turns."""
    procs, errors = {}, {}
    for side, (path, options) in sides.items():
        errors[side] = tempfile.TemporaryFile()
        procs[side] = subprocess.Popen(
            ["setarch", "-R", path / ".venv/bin/python", "-m", "benchmarks.processor_cpu", "--lockstep", *options],
            cwd=ROOT,  # this checkout's benchmark; the package is the worktree's, installed in its .venv
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors[side],
            text=True,
        )

    def stop(p: subprocess.Popen) -> None:  # stdin closed: a processor stops at its next batch, dropping its keys from Redis
        p.stdin.close()  # type: ignore[union-attr]
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def said(side: str, expected: str) -> str:
        line = procs[side].stdout.readline()  # type: ignore[union-attr]
        if not line.startswith(expected):
            stop(procs[side])
            errors[side].seek(0)
            sys.exit(f"the {side} processor stopped (exit {procs[side].returncode}): {line}{errors[side].read()[-2000:].decode(errors='replace')}")
        return line.removeprefix(expected)

    cpu: dict[str, list[float]] = {"old": [], "new": []}
    try:
        counts = {side: int(said(side, "ready ")) for side in procs}
        if counts["old"] != counts["new"]:
            sys.exit(f"the two processors have different workloads: {counts['old']} and {counts['new']} batches")
        for turn in range(counts["old"]):
            for side in ("old", "new") if turn % 2 == 0 else ("new", "old"):
                procs[side].stdin.write("\n")  # type: ignore[union-attr]
                procs[side].stdin.flush()  # type: ignore[union-attr]
                cpu[side].append(float(said(side, "batch ")))
        for side in procs:
            said(side, "processor CPU: ")  # the run's own line: every request decided as a worker decides it
    finally:
        for p in procs.values():
            stop(p)
    return sum(cpu["new"]) / sum(cpu["old"]), statistics.median(n / o for o, n in zip(cpu["old"], cpu["new"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the baseline commit (any git revision)")
    parser.add_argument("--new", default=".", help="the commit measured against it (default: this checkout as it is)")
    parser.add_argument("--pairs", type=int, default=3, help="old/new pairs, alternated (default 3: six runs)")
    parser.add_argument(
        "--benchmark", default="worker_throughput", choices=["worker_throughput", "processor_cpu"], help="what each run is (default: the worker)"
    )
    parser.add_argument("--lockstep", action="store_true", help="with --benchmark processor_cpu: alternate batches, not runs (the module's header)")
    parser.add_argument("--old-args", default="", help="options for the old commit's benchmark only")
    parser.add_argument("--new-args", default="", help="options for the new commit's benchmark only")
    parser.add_argument("common", nargs="*", help="options for both benchmarks (after --)")
    args = parser.parse_args()
    sides = {"old": (checkout(args.old), [*args.common, *shlex.split(args.old_args)]), "new": (checkout(args.new), [*args.common, *shlex.split(args.new_args)])}
    if args.lockstep:
        if args.benchmark != "processor_cpu":
            sys.exit("--lockstep runs benchmarks.processor_cpu: add --benchmark processor_cpu")
        totals = []
        for pair in range(args.pairs):
            total, by_batch = lockstep(sides)
            totals.append(total)
            print(f"run {pair + 1}: processor CPU new/old {total:.3f} (batches' median {by_batch:.3f})", flush=True)
        print(f"new ({args.new}) / old ({args.old}), processor CPU, by run: {'  '.join(f'{r:.3f}' for r in totals)}   median {statistics.median(totals):.3f}")
        return
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for pair in range(args.pairs):
        for side in ("old", "new") if pair % 2 == 0 else ("new", "old"):
            path, options = sides[side]
            figures = run(path, args.benchmark, options)
            results[side].append(figures)
            shown = "  ".join(f"{name} {value:,.0f}" for name, value in figures.items())
            print(f"pair {pair + 1} {side}: {shown}", flush=True)
    print(f"new ({args.new}) / old ({args.old}), by pair, and the median:")
    for name in FIGURES:
        ratios = [n[name] / o[name] for o, n in zip(results["old"], results["new"]) if n.get(name) and o.get(name)]
        if ratios:
            print(f"  {name:16s} {'  '.join(f'{r:.2f}' for r in ratios)}   median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()

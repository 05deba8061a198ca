"""Benchmark: the processor alone, its CPU per request, on the stack's Redis and no Kafka.

The worker benchmark's requests (`worker_throughput.make_workload`: useChat echoes of threads
of 1 to 20 turns, some with a tool call to answer, some new) go through `Processor.outputs`
in this process, in batches of the worker's size (MEMFILTER_BATCH_MAX's default), against the
stack's Redis (REDIS_URL, as `memfilter stack up` prints): decoding, reading the threads,
deciding, claiming ids, committing and making the records to emit, then dropping the batch's
records as the worker does once its transaction commits; the collector paused during a batch,
as in the worker. A request dead-lettered would be a cheaper one measured: the run then fails,
naming why, rather than print a figure. Left out: the worker's Kafka client and task loop, and the broker beside it
on the same cores. A run takes seconds rather than minutes, so a change of the processor, the
filter or the history store is measured with many pairs in one sitting, side by side with the
commit before it (it swings as the machine does: 8 pairs are not too many here):

    eval "$(memfilter stack up)"
    python -m benchmarks.alternate --benchmark processor_cpu --old HEAD --new . --pairs 8

    .venv/bin/python -m benchmarks.processor_cpu [--threads 3000] [--requests 15000] [--history 10]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import secrets
import sys
import time
import zlib
from collections import Counter

from benchmarks.worker_throughput import T0, make_workload, seed
from memfilter.core.filter import Policy
from memfilter.runtime.processor import Processor
from memfilter.runtime.records import Record
from memfilter.settings import Kafka, Topics
from memfilter.store import reads
from memfilter.store.history import HistoryStore
from memfilter.store.redis_driver import connect

PARTITIONS = 8


def records(work: list[tuple[bytes, bytes]]) -> list[Record]:
    """The requests as the worker consumes them: each thread on one partition, offsets in order."""
    offsets = [0] * PARTITIONS
    out = []
    for i, (key, value) in enumerate(work):
        partition = zlib.crc32(key) % PARTITIONS
        out.append(Record("chat-requests", partition, offsets[partition], T0 + i, key, value))
        offsets[partition] += 1
    return out


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=3000)
    parser.add_argument("--requests", type=int, default=15000)
    parser.add_argument("--history", type=int, default=10, help="the context's rows (MEMFILTER_HISTORY_MESSAGES)")
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="wait for a line on stdin before each batch and print the batch's CPU after it (`benchmarks.alternate --lockstep` drives two of these)",
    )
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    prefix = f"bench-processor-{secrets.token_hex(4)}"
    history, work = make_workload(args.threads, args.requests)
    batch = Kafka().batch_max
    await seed(redis_url, prefix, history)
    client = connect(redis_url)
    store = HistoryStore(client, prefix)
    try:
        processor = Processor(store, Topics(), Policy(history=args.history), secret=secrets.token_bytes(32))
        consumed = records(work)
        gc.freeze()  # as the worker does after start-up
        cpu = 0.0
        emitted: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        if args.lockstep:
            print(f"ready {-(-len(consumed) // batch)}", flush=True)  # how many batches
        for start in range(0, len(consumed), batch):
            if args.lockstep and not sys.stdin.readline():
                return
            began = time.process_time()
            gc.disable()
            decided = await processor.decide_batch(consumed[start : start + batch])
            gc.enable()
            await store.drop_records(decided.recorded)
            spent = time.process_time() - began
            cpu += spent
            if args.lockstep:
                print(f"batch {spent:.6f}", flush=True)
            outs = [o for per_record in decided.outs for o in per_record]
            emitted.update(o.topic for o in outs)
            errors.update(dict(o.headers)["error.type"].decode() for o in outs if o.topic == processor.topics.dlq)
        if errors:
            sys.exit(f"the workload was not decided as a worker decides it: dead letters {dict(errors)}")
        filtered = emitted[processor.topics.filtered]
        print(
            f"processor CPU: {1e6 * cpu / len(consumed):.0f} µs per request "
            f"({len(consumed):,} requests in batches of {batch:,}: {filtered:,} filtered inputs, no dead letters)"
        )
    finally:
        await reads.drop(store)
        await client.aclose()


if __name__ == "__main__":
    asyncio.run(main())

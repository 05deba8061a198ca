"""Benchmark: semantic recall's search in PostgreSQL without pgvector (`memfilter.store.vectors`),
beside the exact scan it stands for, in the same run.

On the stack's PostgreSQL (`memfilter stack up`; POSTGRES_URL as it prints), `--messages`
vectors of `--dims` dimensions in one resource, as many in another, on a schema of the run's
own (dropped after). Like embeddings of real conversations they cluster: each is one of
`--topics` random directions plus noise. Then `--searches` questions, each near one of the
resource's vectors (that vector plus noise), answered two ways: the store's search (the
nearest by sign bits, the best of them scored exactly) and the exact scan (every vector of the
resource scored in SQL). Printed: each way's time per search (p50, p90, max), the ratio, how
many of the exact scan's best `--k` the store found, and how often it found the planted
vector first.

    .venv/bin/python -m benchmarks.recall_search [--messages 10000] [--dims 1536] [--k 4] [--searches 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
import uuid

import asyncpg

from memfilter.store.vectors import MessageVectors, Vector, unit


async def main(args: argparse.Namespace) -> None:
    url = os.environ["POSTGRES_URL"]
    store = MessageVectors(url, f"bench-{uuid.uuid4().hex[:8]}", timeout=120)
    rng = random.Random(args.seed)
    topics = [[rng.gauss(0, 1) for _ in range(args.dims)] for _ in range(args.topics)]

    def message() -> list[float]:
        return [x + rng.gauss(0, args.spread) for x in rng.choice(topics)]

    connection = None
    try:
        mine = [message() for _ in range(args.messages)]
        for resource, vectors in (("r1", mine), ("r2", [message() for _ in range(args.messages)])):
            for start in range(0, len(vectors), 1000):
                await store.put([Vector("m", resource, f"t{i % 100}", f"{resource}-{i}", v) for i, v in enumerate(vectors[start : start + 1000], start)])
        connection = await asyncpg.connect(url)
        exact = f"""SELECT message_id, (SELECT sum(a::float8 * b) FROM unnest(vector, $3::real[]) AS t(a, b)) AS score
                    FROM {store.schema}.message_vectors WHERE model = $1 AND "resourceId" = $2 ORDER BY score DESC, message_id LIMIT $4"""
        fast_s, exact_s, found_of_best, first = [], [], 0, 0
        for _ in range(args.searches):
            planted = rng.randrange(args.messages)
            question = [x + rng.gauss(0, args.noise) for x in mine[planted]]
            started = time.perf_counter()
            found = await store.search("m", "r1", question, args.k)
            fast_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            best = await connection.fetch(exact, "m", "r1", unit(question), args.k)
            exact_s.append(time.perf_counter() - started)
            found_of_best += len({m.message_id for m in found} & {r["message_id"] for r in best})
            first += found[0].message_id == f"r1-{planted}"
        q = lambda xs: f"p50 {statistics.median(xs) * 1000:.1f} / p90 {sorted(xs)[int(0.9 * len(xs))] * 1000:.1f} / max {max(xs) * 1000:.1f} ms"  # noqa: E731
        print(
            f"{args.messages} vectors of {args.dims} dimensions in {args.topics} topics in the resource (and as many in another); {args.searches} searches, k {args.k}"
        )
        print(f"  store's search (sign bits, the best rescored): {q(fast_s)}")
        print(f"  exact scan in SQL (baseline):                  {q(exact_s)}")
        print(f"  store/exact time p50: {statistics.median(fast_s) / statistics.median(exact_s):.3f}")
        print(
            f"  of the exact scan's best {args.k}, the store found {found_of_best / (args.k * args.searches):.0%}; the planted vector first in {first}/{args.searches}"
        )
    finally:
        if connection is not None:
            await connection.close()
        await store.drop()
        await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--dims", type=int, default=1536)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--searches", type=int, default=30)
    parser.add_argument("--topics", type=int, default=200)
    parser.add_argument("--spread", type=float, default=0.8, help="a message: its topic's direction plus Gaussian noise of this deviation")
    parser.add_argument("--noise", type=float, default=0.5, help="a question: a message plus Gaussian noise of this deviation")
    parser.add_argument("--seed", type=int, default=59)
    asyncio.run(main(parser.parse_args()))

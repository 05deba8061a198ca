"""End to end: every conformance case through a real worker, Kafka and Redis (those of the UI
cases that `tests/test_conformance.py` runs too: requests in AI SDK UI messages).

For each case the thread's history (and the other threads' rows) is saved to Redis first,
the request is published to the requests topic, and what the worker emits must be exactly
what `memfilter explain` gives for the same case: the filtered input with its context, the rows
to persist, or the dead letter with the same error type. Cases that set the context's size
(`historyMessages`) go to a worker with that MEMFILTER_HISTORY_MESSAGES, and so for `edits`
(MEMFILTER_EDITS); a case's `superseded` rows are superseded in Redis first, as a regenerate
would have left them. Each case gets thread and message ids of its own (`c<i>-<id>`). All of it twice: on the
single-node stack and on three brokers with a Redis Cluster (`cluster_services`); on the
container backend, once, with Kafka, Redis and the worker in containers.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
from factories import CASES
from pipeline import Pipeline, header, publish, read, save_case_history
from stacks import BACKEND

from memfilter.core.explain import explain
from memfilter.core.filter import HISTORY_MESSAGES
from memfilter.core.filtered import whole

pytestmark = pytest.mark.containers
# The replicated half first, right after the cluster tests in their group, so the replicated stack stops before the other half.
REPLICATED = pytest.param("3-brokers-redis-cluster", marks=[pytest.mark.replicated, pytest.mark.xdist_group("replicated")])
STACKS = [REPLICATED, "one-broker-one-redis"] if BACKEND == "processes" else ["containers"]


def renamed(value, prefix: str):
    """The case with every thread and message id prefixed, so each case has its own."""
    if isinstance(value, dict):
        return {
            k: (
                f"{prefix}{v}"
                if k in ("threadId", "id", "messageId") and isinstance(v, str)
                else [f"{prefix}{i}" for i in v]
                if k == "superseded"
                else renamed(v, prefix)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [renamed(v, prefix) for v in value]
    return value


async def save_history(pipeline: Pipeline, case: dict) -> None:
    client, store = pipeline.store()
    try:
        await save_case_history(store, case)
    finally:
        await client.aclose()


def run_cases(services, cases: list[dict], history: int, edits: str) -> tuple:
    """Publish cases against a worker deciding with contexts of `history` rows and edits on
    or off; its topics and records."""
    pipeline = services.pipeline()
    expected = json.loads(explain(json.dumps(cases).encode(), pipeline.secret))

    async def run():
        await pipeline.create_topics()
        for case in cases:
            await save_history(pipeline, case)
        pipeline.start_worker(MEMFILTER_HISTORY_MESSAGES=str(history), MEMFILTER_EDITS=edits)
        await publish(
            services.bootstrap,
            pipeline.topics.requests,
            [(c["request"]["threadId"].encode(), json.dumps(c["request"]).encode(), c["timestamp"]) for c in cases],
        )
        t = pipeline.topics
        saving = sum(1 for e in expected if e.get("persist") or e.get("superseded"))  # outputs on three topics: wait for all of them
        return await read(
            services.bootstrap,
            [t.filtered, t.persist, t.dlq],
            until=lambda recs: sum(r.topic in (t.filtered, t.dlq) for r in recs) >= len(cases) and sum(r.topic == t.persist for r in recs) >= saving,
        )

    try:
        return pipeline.topics, expected, asyncio.run(run())
    finally:
        pipeline.stop_all()


@pytest.fixture(scope="module", params=STACKS)
def outputs(request):
    """Every case against a worker, one worker per context size and edits setting the cases
    ask for; the worker's records and explain's answers. On the single-node stack, and on the
    replicated one (three brokers, a Redis Cluster, writes on a replica before each commit)."""
    services = request.getfixturevalue("cluster_services" if request.param == REPLICATED.values[0] else "services")
    cases = [renamed(c["case"], f"c{i}-") for i, c in enumerate(CASES)]
    expected: list = [None] * len(cases)
    by_key = defaultdict(dict)
    topics = {}
    settings = lambda c: (c.get("historyMessages", HISTORY_MESSAGES), c.get("edits", "on"))  # noqa: E731
    for history, edits in sorted({settings(c) for c in cases}):
        group = [i for i, c in enumerate(cases) if settings(c) == (history, edits)]
        t, answers, records = run_cases(services, [cases[i] for i in group], history, edits)
        for i, answer in zip(group, answers):
            expected[i], topics[i] = answer, t
        for r in records:
            by_key[r.key.decode()].setdefault(r.topic, []).append(r)
    return topics, cases, expected, by_key


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_the_worker_emits_what_explain_decides(index, outputs):
    all_topics, cases, expected, by_key = outputs
    topics, want = all_topics[index], expected[index]
    got = by_key[cases[index]["request"]["threadId"]]
    if want["outcome"] == "rejected":
        assert [header(r, "error.type") for r in got.get(topics.dlq, [])] == [want["error"]["type"]]
        assert got.get(topics.dlq)[0].value == json.dumps(cases[index]["request"]).encode()
        assert topics.filtered not in got and topics.persist not in got
        return
    [filtered] = got[topics.filtered]
    event = json.loads(filtered.value)
    assert event["format"] == 2  # the default: each message once, `messages` referring into the context
    event = whole(event)
    assert (event["outcome"], event["messages"], event["dropped"]) == (want["outcome"], want["messages"], want["dropped"])
    assert (event["context"], event["superseded"]) == (want["context"], want["superseded"])
    assert event["requestId"] == cases[index]["request"]["requestId"]
    persisted = [json.loads(r.value) for r in got.get(topics.persist, [])]
    saves = want["persist"] or want["superseded"]  # an event that saves nothing but supersedes is emitted too
    assert [(e["messages"], e.get("superseded", [])) for e in persisted] == ([(want["persist"], want["superseded"])] if saves else [])

"""Bad records: each goes to the dead-letter topic with the right `error.type`, bytes unchanged,
and the good records around them are handled as if the bad ones were not there."""

from __future__ import annotations

import asyncio
import json
import random

import msgspec
import pytest
from factories import T0, msg
from pipeline import Pipeline, header, publish, read

from memfilter.core.filtered import whole
from memfilter.store.history import Save

pytestmark = pytest.mark.xdist_group("dead-letters")  # the module's workers and records are shared (`--dist loadgroup`)


def req(thread: str, messages: list, **fields) -> dict:
    return {"requestId": f"req-{thread}", "threadId": thread, "resourceId": "r1", "messages": messages, **fields}


def bad_corpus() -> list[tuple[str, bytes, bytes]]:
    """(expected error.type, key, value) for 205 bad records of every kind."""
    rnd = random.Random(7)
    out = []

    def add(kind, key, value):
        out.append((kind, key.encode(), value if isinstance(value, bytes) else json.dumps(value).encode()))

    for i in range(30):
        good = json.dumps(req(f"bad-d{i}", [msg("m")]))
        broken = [good[: rnd.randrange(1, len(good) - 1)], "{not json", "", "\xff\xfe", "[1,2", "tru", '{"a":}'][i % 7]
        add("decode", f"bad-d{i}", broken.encode("utf-8", "surrogateescape") if i % 7 != 3 else b"\xff\xfe")
    wrong_types = [
        lambda t: req(t, [msg("m")]) | {"threadId": 5},
        lambda t: req(t, "hello"),
        lambda t: req(t, [msg("m", role=3)]),
        lambda t: req(t, [msg("m", role="tool")]),
        lambda t: req(t, [{"id": "m", "role": "user", "content": {"format": 1, "parts": []}}]),
        lambda t: req(t, [{"id": "m", "role": "user", "content": {"format": 2, "parts": "x"}}]),
        lambda t: req(t, [msg("m")], retainFullInput="yes"),
        lambda t: req(t, [msg("m")], requestId=5),
        lambda t: req(t, [msg("")]),
        lambda t: req(t, [msg("m"), msg("m")]),
        lambda t: [1, 2, 3],
        lambda t: None,
    ]
    for i in range(40):
        add("schema", f"bad-s{i}", wrong_types[i % len(wrong_types)](f"bad-s{i}"))
    missing = ["threadId", "resourceId", "messages"]
    for i in range(30):
        if i < 15:
            value = req(f"bad-m{i}", [msg("m")])
            del value[missing[i % 3]]
        else:
            m = msg("m")
            del m[["role", "content"][i % 2]]
            value = req(f"bad-m{i}", [m])
        add("schema", f"bad-m{i}", value)
    for i in range(30):
        add("key-mismatch", f"bad-k{i}", req(f"bad-k{i}-other", [msg(f"k{i}")]))
    for i in range(20):
        field = {"threadId": "elsewhere"} if i % 2 else {"resourceId": "someone-else"}
        add("thread-mismatch", f"bad-t{i}", req(f"bad-t{i}", [msg(f"t{i}", **field)]))
    for i in range(20):
        add("ownership", f"owned{i}", req(f"owned{i}", [msg(f"o{i}-new")]) | {"resourceId": "intruder"})
    for i in range(20):
        add("foreign-message-id", f"bad-f{i}", req(f"bad-f{i}", [msg(f"owned{i}-row")]))
    for i in range(15):
        if i % 2:
            value = req(f"bad-l{i}", [msg(f"l{i}-{j}") for j in range(51)])
        else:
            value = req(f"bad-l{i}", [msg(f"l{i}", text="x" * 21000)])
        add("too-large", f"bad-l{i}", value)
    return out


def test_the_corpus_has_every_kind_and_at_least_200_records():
    kinds = {kind for kind, _, _ in bad_corpus()}
    assert len(bad_corpus()) >= 200
    assert kinds == {"decode", "schema", "key-mismatch", "thread-mismatch", "ownership", "foreign-message-id", "too-large"}


@pytest.fixture(scope="module")
def run(services):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    bad = bad_corpus()
    good = [(f"good{i}".encode(), json.dumps(req(f"good{i}", [msg(f"g{i}")])).encode()) for i in range(200)]
    stream = []
    for i in range(max(len(bad), len(good))):  # interleaved: good, bad, good, bad, ...
        if i < len(good):
            stream.append(("good", *good[i]))
        if i < len(bad):
            stream.append(bad[i])

    async def go():
        await pipeline.create_topics()
        client, store = pipeline.store()
        for i in range(20):  # threads of another resource, and their rows
            row = msg(f"owned{i}-row", threadId=f"owned{i}", resourceId="owner", createdAt="2026-01-01T00:00:00Z")
            await store.claim([(row["id"], f"owned{i}")])
            await store.apply([Save(f"owned{i}", "owner", 0, [(row["id"], msgspec.json.encode(row))], ["user"], b"", writer="processor")])
        await client.aclose()
        pipeline.start_worker(MEMFILTER_MAX_BYTES="20000", MEMFILTER_MAX_MESSAGES="50")
        await publish(pipeline.bootstrap, pipeline.topics.requests, [(k, v, T0) for _, k, v in stream])
        t = pipeline.topics
        return await read(pipeline.bootstrap, [t.filtered, t.dlq], until=lambda recs: len(recs) >= len(stream))

    try:
        records = asyncio.run(go())
    finally:
        pipeline.stop_all()
    return pipeline.topics, stream, records


def test_every_bad_record_is_a_dead_letter_with_its_error_type_and_its_bytes(run):
    topics, stream, records = run
    letters = [r for r in records if r.topic == topics.dlq]
    sent = [(k, v, kind) for kind, k, v in stream if kind != "good"]
    assert sorted((r.key, r.value, header(r, "error.type")) for r in letters) == sorted(sent)
    for r in letters:
        assert header(r, "error.message")
        assert header(r, "source.topic") == topics.requests
        assert int(header(r, "source.offset")) >= 0 and header(r, "source.partition") is not None


def test_good_records_around_them_are_filtered_as_usual(run):
    topics, stream, records = run
    filtered = {r.key: whole(json.loads(r.value)) for r in records if r.topic == topics.filtered}
    good_keys = [k for kind, k, _ in stream if kind == "good"]
    assert sorted(filtered) == sorted(good_keys)
    for key in good_keys:
        event = filtered[key]
        assert event["outcome"] == "unchanged"
        assert [m["id"] for m in event["messages"]] == [f"g{key.decode()[4:]}"]

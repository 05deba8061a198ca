"""On the real stack: no record stops the worker, and no resource reaches another's data.

One worker takes a stream where every hostile record of the abuse harness (issue 11) stands
between good ones: malformed requests and persist events, and one resource (`resB`) trying
to read, block or change the threads of another (`resA`). Afterwards the worker still runs,
every hostile record is a dead letter with its reason, every good request was processed, and
`resB` got nothing of `resA`'s.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from aiokafka.partitioner import murmur2
from factories import T0, msg
from pipeline import Pipeline, dump, header, publish, read
from redis.crc import key_slot

from memfilter.core import origin
from memfilter.core.filtered import whole
from memfilter.store import reads

pytestmark = pytest.mark.xdist_group("hostile-records")  # the module's workers and records are shared (`--dist loadgroup`)

SECRET_A = "resA's words, which resB must never see"


def req(thread: str, resource: str, messages: list, request_id: str | None = None) -> dict:
    value = {"threadId": thread, "resourceId": resource, "messages": messages}
    return value if request_id is None else {"requestId": request_id, **value}


def event(thread: str, resource: str, messages: list) -> dict:
    return {"requestId": f"ev-{thread}", "threadId": thread, "resourceId": resource, "messages": messages}


def raw(value) -> bytes:
    return json.dumps(value).encode()


def deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def bad_requests() -> list[tuple[str, str, bytes | None, bytes | None]]:
    """(name, expected error.type, key, value) of each hostile chat-requests record; thread
    `h-<name>` gets a good request after its bad one."""
    text = raw(req("h-ff", "r", [msg("ff")])).replace(b'"hi"', b'"a\xffb"')
    surrogate = raw(req("h-surrogate", "r", [msg("su")])).replace(b'"hi"', b'"a\xed\xa0\x80b"')
    system = raw(req("h-system", "r", [msg(None, role="system", text="X"), msg("sy")])).replace(b'"X"', b'"\xfe\xff"')
    top = b'{"threadId": "h-deep-top", "resourceId": "r", "messages": [], "x": ' + deep(10_000) + b"}"
    part = raw(req("h-deep-part", "r", [msg("dp")])).replace(b'"hi"', b'"hi", "x": ' + deep(10_000))
    metadata = raw(req("h-deep-meta", "r", [msg("dm")])).replace(b'"format": 2', b'"format": 2, "metadata": {"a": ' + deep(2_000) + b"}")

    def wrong(name, field, value):
        return raw(req(f"h-{name}", "r", [{"id": name, "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "x", field: value}]}}]))  # noqa: E731

    return [
        ("ff", "decode", b"h-ff", text),
        ("surrogate", "decode", b"h-surrogate", surrogate),
        ("system", "decode", b"h-system", system),
        ("deep-top", "decode", b"h-deep-top", top),
        ("deep-part", "decode", b"h-deep-part", part),
        ("deep-meta", "decode", b"h-deep-meta", metadata),
        ("null-value", "decode", b"h-null-value", None),
        ("provider-metadata", "schema", b"h-provider-metadata", wrong("provider-metadata", "providerMetadata", "x")),
        ("provider-options", "schema", b"h-provider-options", wrong("provider-options", "providerOptions", [1])),
        (
            "text-number",
            "schema",
            b"h-text-number",
            raw(req("h-text-number", "r", [msg("tn") | {"content": {"format": 2, "parts": [{"type": "text", "text": 5}]}}])),
        ),
        ("null-key", "key-mismatch", None, raw(req("h-null-key", "r", [msg("nk")]))),
        ("key-not-utf8", "key-mismatch", b"h-key-not-utf8\xff", raw(req("h-key-not-utf8", "r", [msg("ku")]))),
    ]


def bad_events() -> list[tuple[str, str, bytes | None, bytes | None, tuple]]:
    """(name, expected error.type, key, value, headers) of each hostile persist-messages record."""
    forged = raw(event("own-A", "resA", [msg("A-u1", threadId="own-A", text="rewritten by a forger")]))
    return [
        ("null-value", "decode", b"own-A", None, ()),
        ("deep", "decode", b"own-A", b'{"x": ' + deep(10_000) + b"}", ()),
        ("ff", "decode", b"own-A", raw(event("own-A", "resA", [msg("A-x", threadId="own-A")])).replace(b'"hi"', b'"\xff"'), ()),
        ("another-resource", "ownership", b"own-A", raw(event("own-A", "resB", [msg("B-in-A", threadId="own-A")])), ()),
        ("role-change", "role", b"own-A", raw(event("own-A", "resA", [msg("A-u1", role="assistant", threadId="own-A", text="pwned")])), ()),
        ("unowned-thread", "ownership", b"fresh", raw(event("fresh", "resB", [msg("B-squat", threadId="fresh")])), ()),
        ("forged-origin", "origin", b"own-A", forged, (origin.ORIGIN, (origin.SIGNATURE, b"00" * 32))),
        ("wrong-key", "key-mismatch", b"own-B", raw(event("own-A", "resA", [msg("A-k", threadId="own-A")])), ()),
    ]


def partition_of(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


@pytest.fixture(scope="module")
def run(services):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    t = pipeline.topics
    a_partition = partition_of(b"own-A", pipeline.partitions)
    a_next = [msg("A-u1"), msg("A-a1", role="assistant"), msg("A-u3"), msg(None, text="id-less")]

    async def go():
        await pipeline.create_topics()
        pipeline.start_worker()
        sent = 0

        async def requests(records, outputs_before: int = 0):
            nonlocal sent
            sent += await publish(pipeline.bootstrap, t.requests, records)
            if outputs_before:
                await read(pipeline.bootstrap, [t.filtered, t.dlq], until=lambda recs: len(recs) >= sent)

        # resA starts its thread, resB its own.
        await requests(
            [(b"own-A", raw(req("own-A", "resA", [msg("A-u1", text=SECRET_A)], "A-r1")), T0), (b"own-B", raw(req("own-B", "resB", [msg("B-u1")], "B-r1")), T0)],
            outputs_before=True,
        )
        # Where resA's next requests will land: resB's three come first on that partition.
        on_a = await read(pipeline.bootstrap, [t.requests], until=lambda recs: len(recs) >= sent)
        first = 1 + max(r.offset for r in on_a if r.partition == a_partition)
        derived = f"{t.requests}-{a_partition}-{first + 4}"  # resA's id-less request's id
        # resB stores the id resA's id-less message would get were ids not keyed by the secret.
        from memfilter.core.filter import decode_request

        guessed = decode_request(raw(req("own-A", "resA", a_next, derived)), "x").ids[3]
        await requests([(b"own-B", raw(req("own-B", "resB", [msg("B-u1"), msg("B-a1", role="assistant"), msg(guessed)], "B-r2")), T0 + 1)], outputs_before=True)
        # resB replays resA's request id, then poisons resA's next ones (given and derived);
        # then resA goes on, with its own A-r3 and an id-less request at the derived position.
        await requests(
            [
                (b"own-A", raw(req("own-A", "resB", [msg("A-u1")], "A-r1")), T0 + 1),
                (b"own-A", raw(req("own-A", "resB", [msg("B-x1")], "A-r3")), T0 + 1),
                (b"own-A", raw(req("own-A", "resB", [msg("B-x2")], derived)), T0 + 1),
                (b"own-A", raw(req("own-A", "resA", [msg("A-u1", text=SECRET_A), msg("A-a1", role="assistant"), msg("A-u3")], "A-r3")), T0 + 2),
                (b"own-A", raw(req("own-A", "resA", a_next)), T0 + 3),
            ],
            outputs_before=True,
        )
        # resB's rejections in threads that have nothing, the hostile records, and after them
        # the same threads' good requests.
        await requests(
            [
                (b"empty-1", raw(req("empty-1", "resB", [msg("x", threadId="elsewhere")])), T0),  # thread-mismatch
                (b"empty-2", raw(req("empty-2", "resB", [msg("A-u1")])), T0),  # foreign-message-id
                *[(key, value, T0) for _, _, key, value in bad_requests()],
                *[(f"h-{name}".encode(), raw(req(f"h-{name}", "r", [msg(f"{name}-good")], f"{name}-good")), T0 + 1) for name, *_ in bad_requests()],
                (b"}brace{", raw(req("}brace{", "resC", [msg("br-1")])), T0),
            ]
        )
        await publish(pipeline.bootstrap, t.persist, [(key, value, T0, headers) for _, _, key, value, headers in bad_events()])
        await requests(
            [(b"own-A", raw(req("own-A", "resA", [msg("A-u5")], "A-r5")), T0 + 5), (b"fresh", raw(req("fresh", "resA", [msg("F-u1")], "F-r1")), T0 + 5)]
        )
        expected = sent + len(bad_events())  # a filtered input or a dead letter for each
        records = await read(pipeline.bootstrap, [t.filtered, t.dlq, t.persist], until=lambda recs: sum(r.topic != t.persist for r in recs) >= expected)
        await asyncio.sleep(1)  # a worker that dies on one of them would be gone by now
        alive = pipeline.workers[0].poll() is None
        client, store = pipeline.store()
        try:
            keys = [k.decode() async for k in client.scan_iter(match=f"{pipeline.prefix}:t:*", count=1000)]
            rows_a = [json.loads(r) for r in await reads.thread_rows(store, "own-A")]
        finally:
            await client.aclose()
        return records, alive, keys, rows_a, guessed, derived

    try:
        return (pipeline, *asyncio.run(go()))
    finally:
        pipeline.stop_all()


def letters(records, topic, source):
    return [r for r in records if r.topic == topic and header(r, "source.topic") == source]


def filtered(run, thread: str) -> list[dict]:
    pipeline, records, *_ = run
    return [whole(json.loads(r.value)) for r in records if r.topic == pipeline.topics.filtered and json.loads(r.value)["threadId"] == thread]


def test_the_worker_is_still_running_after_every_hostile_record(run):
    assert run[2], "the worker exited"


@pytest.mark.parametrize("name, error", [(name, error) for name, error, _, _ in bad_requests()])
def test_a_hostile_request_is_a_dead_letter_with_its_reason_and_its_thread_goes_on(run, name, error):
    pipeline, records, *_ = run
    t = pipeline.topics
    [letter] = [
        r
        for r in letters(records, t.dlq, t.requests)
        if r.value == dict((n, v) for n, _, _, v in bad_requests())[name] and r.key == dict((n, k) for n, _, k, _ in bad_requests())[name]
    ]
    assert header(letter, "error.type") == error and header(letter, "error.message")
    [good] = filtered(run, f"h-{name}")
    assert good["requestId"] == f"{name}-good" and [m["id"] for m in good["messages"]] == [f"{name}-good"]


@pytest.mark.parametrize("name, error", [(name, error) for name, error, *_ in bad_events()])
def test_a_hostile_persist_event_is_a_dead_letter_with_its_reason(run, name, error):
    pipeline, records, *_ = run
    t = pipeline.topics
    value = next(v for n, _, _, v, _ in bad_events() if n == name)
    found = [header(r, "error.type") for r in letters(records, t.dlq, t.persist) if r.value == value]
    assert error in found


def test_resB_never_receives_resAs_data(run):
    pipeline, records, *_ = run
    for r in records:
        if r.topic == pipeline.topics.filtered or (r.topic == pipeline.topics.persist and header(r, "memfilter.origin")):
            assert json.loads(r.value)["resourceId"] != "resB" or SECRET_A.encode() not in r.value
    assert [e["requestId"] for e in filtered(run, "own-A") if e["resourceId"] == "resB"] == []


def test_resAs_requests_go_through_whatever_ids_resB_used_first(run):
    by_request = {e["requestId"]: e for e in filtered(run, "own-A")}
    assert by_request["A-r3"]["outcome"] == "user-tail" and [m["id"] for m in by_request["A-r3"]["messages"]] == ["A-u3"]
    idless = by_request[run[6]]
    assert idless["outcome"] == "user-tail" and [m["id"] for m in idless["messages"]][0] == "A-u3"
    assert idless["messages"][-1]["id"] != run[5]
    assert by_request["A-r5"]["outcome"] in ("user-tail", "unchanged")


def test_resAs_stored_messages_keep_their_role_and_text(run):
    rows = {r["id"]: r for r in run[4]}
    assert rows["A-u1"]["role"] == "user" and rows["A-u1"]["content"]["parts"][0]["text"] == SECRET_A
    assert "B-in-A" not in rows


def test_a_rejection_writes_nothing_under_a_thread_that_has_nothing(run):
    keys = run[3]
    assert not [k for k in keys if "{empty-" in k]


def test_a_thread_unused_when_another_resource_wrote_to_it_is_its_first_requesters(run):
    [first] = filtered(run, "fresh")
    assert first["resourceId"] == "resA" and first["outcome"] == "unchanged"


def test_a_thread_id_with_braces_has_all_its_keys_in_one_slot(run):
    [event] = filtered(run, "}brace{")
    assert event["outcome"] == "unchanged"
    braces = [k for k in run[3] if "%7Dbrace%7B" in k]
    assert len(braces) >= 3 and len({key_slot(k.encode()) for k in braces}) == 1


def test_a_rebuild_from_the_log_gives_the_live_history_forged_origin_and_all(run):
    """The log holds an event claiming the processor's origin without its signature, and
    events the live persister refused: a rebuild refuses the same ones."""
    pipeline = run[0]
    other_db = pipeline.redis_url.rsplit("/", 1)[0] + "/2"
    result = pipeline.memfilter("history", "rebuild", "--redis-url", other_db)
    assert result.returncode == 0, result.stderr
    live, rebuilt = asyncio.run(dump(pipeline, pipeline.prefix)), asyncio.run(dump(pipeline, pipeline.prefix, other_db))
    assert any("own-A" in name for name in live) and rebuilt == live

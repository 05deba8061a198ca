"""Rebuild and replay take any log.

A rebuild takes any `persist-messages` log: the processor's events, other writers' saves,
events refused live, repeats, events naming another resource's thread, forged origins and
records that do not decode, in any interleaving, give a history and a count of what was
refused, never a traceback; the same log gives the same history twice; a thread's owner is
never changed by another resource's events.

A replay takes any recorded topics besides: requests that do not decode, filtered inputs and
dead letters written by hand (a version that is not a number, ids elsewhere that are not a
JSON object, bytes that are not UTF-8, positions of other requests) give a report, each request
identical or a difference, never a traceback; the same topics give the same report twice."""

from __future__ import annotations

import asyncio
import json
import uuid

import redis.asyncio as aioredis
from factories import SECRET, T0, msg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfilter.audit.recorded import Recorded
from memfilter.audit.replay import Report, apply_log, replay_log
from memfilter.core import origin
from memfilter.runtime.processor import ELSEWHERE_HEADER, VERSION_HEADER
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store import reads
from memfilter.store.history import HistoryStore

TOPICS = Topics()
GENERATED = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
THREADS = ("ta", "tb")  # ta belongs to resource A (its first save is the processor's), tb to B


def event(thread: str, resource: str, request_id: str, messages: list, version: int | None = None) -> bytes:
    value = {"requestId": request_id, "threadId": thread, "resourceId": resource, "messages": messages}
    if version is not None:
        value["historyVersion"] = version
    return json.dumps(value).encode()


@st.composite
def log_entry(draw, n: int):
    """One record of the log, and whether the live persister refused it (a dead letter names it)."""
    thread = draw(st.sampled_from(THREADS))
    owner = "A" if thread == "ta" else "B"
    kind = draw(st.sampled_from(["processor", "service", "foreign", "forged", "undecodable", "wrong-key", "tombstone", "import", "erasure"]))
    mid = f"{thread}-m{draw(st.integers(0, 4))}"
    rows = [msg(mid, role=draw(st.sampled_from(["user", "assistant"])), text=draw(st.sampled_from(["a", "b"])), threadId=thread)]
    key, headers = thread.encode(), ()
    if kind == "processor":
        value = event(thread, owner, f"q{n}", rows, version=draw(st.integers(0, 6)))
        headers = origin.headers(value, SECRET)
    elif kind == "service":
        value = event(thread, owner, f"reply-{draw(st.integers(0, 3))}", rows)  # repeats share a request id
    elif kind == "import":  # an operator's import (`memfilter history import`)
        value = event(thread, owner, f"import-{draw(st.integers(0, 2))}", rows)
        headers = origin.operator_headers(value, SECRET)
    elif kind == "erasure":  # an operator's erasure (`memfilter forget`), at some version
        erased = {"at": "2026-03-01T12:00:00.000Z", "by": "dpo", "scope": "thread"}
        value = json.dumps(
            {"requestId": f"erase-{n}", "threadId": thread, "resourceId": owner, "messages": [], "historyVersion": draw(st.integers(0, 6)), "erasure": erased}
        ).encode()
        headers = origin.operator_headers(value, SECRET)
    elif kind == "foreign":
        value = event(thread, "A" if owner == "B" else "B", f"x{n}", rows)  # another resource names this thread
    elif kind == "forged":
        value = event(thread, owner, f"f{n}", rows, version=0)
        headers = (origin.ORIGIN, (origin.SIGNATURE, b"0" * 64))
    elif kind == "undecodable":
        value = draw(st.sampled_from([b"\xff\xfe", b"[1, 2", b'{"threadId": 3}', b"null", b"[" * 3000]))
    elif kind == "wrong-key":
        value, key = event(thread, owner, f"k{n}", rows), b"elsewhere"
    else:
        value = None
    return Record(TOPICS.persist, 0, n, T0 + n, key, value, headers), draw(st.booleans())


@st.composite
def logs(draw):
    size = draw(st.integers(1, 14))
    entries = [draw(log_entry(n)) for n in range(size)]
    repeats = draw(st.lists(st.integers(0, size - 1), max_size=3))  # a record published again later
    for at, i in enumerate(repeats):
        record, _ = entries[i]
        entries.append((Record(record.topic, 0, size + at, record.timestamp_ms, record.key, record.value, record.headers), False))
    return entries


def dead_letter_of(record: Record) -> Record:
    headers = (
        ("error.type", b"ownership"),
        ("source.topic", TOPICS.persist.encode()),
        ("source.partition", b"0"),
        ("source.offset", str(record.offset).encode()),
    )
    return Record(TOPICS.dlq, 0, record.offset, record.timestamp_ms, record.key, record.value, headers)


async def rebuilt(redis_url: str, entries: list[tuple[Record, bool]]) -> tuple[tuple[int, int, int], dict]:
    client = aioredis.from_url(redis_url)
    store = HistoryStore(client, f"rebuild-{uuid.uuid4().hex[:8]}")
    try:
        with Recorded.temporary(TOPICS, SECRET) as recorded:
            recorded.add_persisted([record for record, _ in entries])
            recorded.add_dead([dead_letter_of(record) for record, refused in entries if refused])
            counts = await apply_log(recorded, store)
            assert sum(counts) == recorded.persisted()  # each event kept (a copy of the processor's once) is applied, refused or erased
        history = {}
        for thread in THREADS:
            state = (await store.read({thread: []}))[thread]
            history[thread] = (state.owner, state.version, [json.loads(row) for row in await reads.thread_rows(store, thread)])
        return counts, history
    finally:
        await reads.drop(store)
        await client.aclose()


@GENERATED
@given(entries=logs())
def test_any_log_rebuilds_the_same_history_twice_and_no_resource_takes_anothers_thread(redis_url, entries):
    counts, history = asyncio.run(rebuilt(redis_url, entries))
    assert counts[1] >= len({record.offset for record, refused_live in entries if refused_live})
    again = asyncio.run(rebuilt(redis_url, entries))
    assert again == (counts, history)
    assert history["ta"][0] in (None, "A") and history["tb"][0] in (None, "B")


def test_a_log_written_before_the_id_rule_rebuilds_with_its_events_of_bad_ids_refused(redis_url):
    """The processor's own saves of threads whose ids PostgreSQL cannot hold, logged before ids
    were held to `wire.Id` (U+0000, a message id of 6,000 characters), are counted refused, and
    the thread logged after them is rebuilt: a rebuild finishes on such a log."""
    logged = []
    for n, (thread, mid) in enumerate([("t\u0000x", "m0"), ("tc", "m" * 6000), ("ta", "ta-m0")]):
        value = event(thread, "A", f"q{n}", [msg(mid, threadId=thread)], version=0)
        logged.append((Record(TOPICS.persist, 0, n, T0 + n, thread.encode(), value, origin.headers(value, SECRET)), False))
    (applied, refused, _), history = asyncio.run(rebuilt(redis_url, logged))
    assert (applied, refused) == (1, 2) and [row["id"] for row in history["ta"][2]] == ["ta-m0"]


def test_a_thread_whose_every_event_was_refused_live_is_no_crash(redis_url):
    """The tenant case: resource B's events naming A's thread, refused live (`ownership`), and
    nothing else on their key."""
    value = event("ta", "B", "b-1", [msg("b-m", role="assistant")])
    refused = Record(TOPICS.persist, 0, 0, T0, b"ta", value)
    (applied, refused_count, _), history = asyncio.run(rebuilt(redis_url, [(refused, True)]))
    assert (applied, refused_count) == (0, 1) and history["ta"] == (None, 0, [])


# ---- replay ------------------------------------------------------------------------------


@st.composite
def a_request(draw, n: int) -> Record:
    thread = draw(st.sampled_from(THREADS))
    body = {"requestId": f"q{draw(st.integers(0, n))}", "threadId": thread, "resourceId": draw(st.sampled_from(["A", "B"]))}
    body["messages"] = [msg(f"{thread}-m{draw(st.integers(0, 4))}", text=draw(st.sampled_from(["a", "b"])))]
    value = draw(st.sampled_from([json.dumps(body).encode(), b"\xff", b'{"requestId": 1}', b"null"]))
    return Record(TOPICS.requests, 0, n, T0 + n, draw(st.sampled_from([thread.encode(), None])), value)


@st.composite
def recorded_outcome(draw, request: Record) -> Record | None:
    """What was recorded for the request: nothing, a filtered input or a dead letter, each
    as the processor writes it or as a hand could (at this request's position or another's)."""
    kind = draw(st.sampled_from(["nothing", "filtered", "dead"]))
    at = draw(st.sampled_from([request.offset, request.offset, request.offset + 1]))
    if kind == "filtered":
        thread = draw(st.sampled_from(THREADS))
        value = {"requestId": f"q{request.offset}", "threadId": thread, "resourceId": draw(st.sampled_from(["A", "B"])), "outcome": "seeded"}
        value |= {"messages": [], "context": [], "dropped": [], "source": {"topic": TOPICS.requests, "partition": 0, "offset": at}}
        value["historyVersion"] = draw(st.sampled_from([0, 1, 3, -1, 10**12]))
        return Record(TOPICS.filtered, 0, request.offset, T0, thread.encode(), json.dumps(value).encode())
    if kind == "dead":
        headers = [("source.topic", TOPICS.requests.encode()), ("source.partition", b"0"), ("source.offset", str(at).encode())]
        headers.append(("error.type", draw(st.sampled_from([b"ownership", b"duplicate", b"\xff\xfe"]))))
        for name, values in ((VERSION_HEADER, [b"0", b"2", b"x", b"-1", b"\xff"]), (ELSEWHERE_HEADER, [b"{}", b'{"ta-m1": "t9"}', b"[", b'{"a": 1}'])):
            if draw(st.booleans()):
                headers.append((name, draw(st.sampled_from(values))))
        return Record(TOPICS.dlq, 0, request.offset, T0, request.key, request.value, tuple(headers))
    return None


@st.composite
def topics(draw):
    requests = [draw(a_request(n)) for n in range(draw(st.integers(1, 8)))]
    outcomes = [draw(recorded_outcome(request)) for request in requests]
    persisted = [draw(log_entry(n)) for n in range(draw(st.integers(0, 8)))]
    return requests, [o for o in outcomes if o is not None], persisted


async def replayed(redis_url: str, requests: list[Record], outcomes: list[Record], persisted: list[tuple[Record, bool]]) -> Report:
    client = aioredis.from_url(redis_url)
    store = HistoryStore(client, f"replay-{uuid.uuid4().hex[:8]}")

    async def one_batch():
        yield requests

    try:
        with Recorded.temporary(TOPICS, SECRET) as recorded:
            recorded.add_filtered([o for o in outcomes if o.topic == TOPICS.filtered])
            recorded.add_dead([o for o in outcomes if o.topic == TOPICS.dlq] + [dead_letter_of(record) for record, refused in persisted if refused])
            recorded.add_persisted([record for record, _ in persisted])
            return await replay_log(recorded, store, one_batch())
    finally:
        await reads.drop(store)
        await client.aclose()


@GENERATED
@given(recorded=topics())
def test_any_recorded_topics_replay_to_a_report_the_same_twice(redis_url, recorded):
    report = asyncio.run(replayed(redis_url, *recorded))
    requests, outcomes, _ = recorded
    assert report.requests == len(requests)
    assert {d.source for d in report.differences} <= {f"{TOPICS.requests}-0-{r.offset}" for r in requests}
    assert all(d.diff for d in report.differences)
    positions = {json.loads(o.value)["source"]["offset"] if o.topic == TOPICS.filtered else int(dict(o.headers)["source.offset"]) for o in outcomes}
    unrecorded = [r for r in requests if r.offset not in positions]
    assert report.different >= len(unrecorded)  # nothing recorded for them: named, not skipped
    assert asyncio.run(replayed(redis_url, *recorded)).to_json() == report.to_json()

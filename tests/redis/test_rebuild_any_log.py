"""A rebuild takes any `persist-messages` log: the processor's events, other writers' saves,
events refused live, repeats, events naming another resource's thread, forged origins and
records that do not decode, in any interleaving, give a history and a count of what was
refused, never a traceback; the same log gives the same history twice; a thread's owner is
never changed by another resource's events."""

from __future__ import annotations

import asyncio
import json
import uuid

import redis.asyncio as aioredis
from factories import SECRET, T0, msg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfilter.audit.recorded import Recorded
from memfilter.audit.replay import apply_log
from memfilter.core import origin
from memfilter.runtime.records import Record
from memfilter.settings import Topics
from memfilter.store.history import HistoryStore

TOPICS = Topics()
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
    kind = draw(st.sampled_from(["processor", "service", "foreign", "forged", "undecodable", "wrong-key", "tombstone"]))
    mid = f"{thread}-m{draw(st.integers(0, 4))}"
    rows = [msg(mid, role=draw(st.sampled_from(["user", "assistant"])), text=draw(st.sampled_from(["a", "b"])), threadId=thread)]
    key, headers = thread.encode(), ()
    if kind == "processor":
        value = event(thread, owner, f"q{n}", rows, version=draw(st.integers(0, 6)))
        headers = origin.headers(value, SECRET)
    elif kind == "service":
        value = event(thread, owner, f"reply-{draw(st.integers(0, 3))}", rows)  # repeats share a request id
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


async def rebuilt(redis_url: str, entries: list[tuple[Record, bool]]) -> tuple[tuple[int, int], dict]:
    client = aioredis.from_url(redis_url)
    store = HistoryStore(client, f"rebuild-{uuid.uuid4().hex[:8]}")
    try:
        with Recorded.temporary(TOPICS, SECRET) as recorded:
            recorded.add_persisted([record for record, _ in entries])
            recorded.add_dead([dead_letter_of(record) for record, refused in entries if refused])
            counts = await apply_log(recorded, store)
            assert sum(counts) == recorded.persisted()  # each event kept (a copy of the processor's once) is applied or refused
        history = {}
        for thread in THREADS:
            state = (await store.read({thread: []}))[thread]
            history[thread] = (state.owner, state.version, [json.loads(row) for row in await store.thread_rows(thread)])
        return counts, history
    finally:
        await store.drop()
        await client.aclose()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(entries=logs())
def test_any_log_rebuilds_the_same_history_twice_and_no_resource_takes_anothers_thread(redis_url, entries):
    (applied, refused), history = asyncio.run(rebuilt(redis_url, entries))
    assert refused >= len({record.offset for record, refused_live in entries if refused_live})
    again = asyncio.run(rebuilt(redis_url, entries))
    assert again == ((applied, refused), history)
    assert history["ta"][0] in (None, "A") and history["tb"][0] in (None, "B")


def test_a_thread_whose_every_event_was_refused_live_is_no_crash(redis_url):
    """The tenant case: resource B's events naming A's thread, refused live (`ownership`), and
    nothing else on their key."""
    value = event("ta", "B", "b-1", [msg("b-m", role="assistant")])
    refused = Record(TOPICS.persist, 0, 0, T0, b"ta", value)
    (applied, refused_count), history = asyncio.run(rebuilt(redis_url, [(refused, True)]))
    assert (applied, refused_count) == (0, 1) and history["ta"] == (None, 0, [])

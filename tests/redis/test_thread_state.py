"""What a committed write does to a thread, written twice (in Python, `memfilter.core.thread`'s
`after_commit`, for the batch's next decision; in Lua, COMMIT, for Redis), held equal.

Random sequences of commits (new rows and rows saved again, rows taken out of the
conversation, token counts, createdAt, the retry window filling past its size, the same
request committed again, decisions made on a version that has moved, decisions that ask for an
answer and so mark the thread replying), of other services' saves (some of them the reply it
is marked for) and of erasures run on a real Redis; before each commit the thread is read as the
processor reads it, and after it the thread read again must be what `after_commit` said.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import redis.asyncio as aioredis
from factories import msg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfilter.core.thread import Recorded, ThreadState, Write, after_commit
from memfilter.core.tokens import ESTIMATE
from memfilter.store import reads
from memfilter.store.history import HistoryStore, Save
from memfilter.store.layout import WINDOW_ENTRY, save_identity, window_key

GENERATED = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
IDS = [f"m{i}" for i in range(6)]
KEYS = [window_key(f"request-{i}") for i in range(4)]  # few: the same request committed again
EVERYTHING = 10_000  # a tail that reaches the whole order


def row(mid: str, role: str, text: str) -> bytes:
    return msgspec.json.encode(msg(mid, role=role, text=text))


@st.composite
def commits(draw, n: int):
    ids = draw(st.lists(st.sampled_from(IDS), max_size=3))
    rows = [(mid, row(mid, draw(st.sampled_from(["user", "assistant"])), draw(st.sampled_from(["a", "b"])))) for mid in ids]
    counted = draw(st.booleans())
    return (
        "commit",
        {
            "owner": draw(st.sampled_from(["A", "B"])),
            "rows": rows,
            "superseded": draw(st.lists(st.sampled_from(IDS), max_size=2, unique=True)),
            "newest_ms": draw(st.sampled_from([-1, 5, 10, 20])),
            "counts": [float(draw(st.integers(1, 50))) for _ in rows] if counted else [],
            "key": draw(st.sampled_from(KEYS)),
            "moved": draw(st.integers(0, 4)) == 0,  # decided on a version that has moved since
            "answered": draw(st.booleans()),  # asks the model for an answer: the thread is replying to it
            # waits for its turn (kept, nothing else written), or is the first waiting one decided now
            "turn": draw(st.sampled_from(["", "", "wait", "woken"])),
            "n": n,
        },
    )


@st.composite
def saves(draw, n: int):
    mid = draw(st.sampled_from(IDS))
    reply_to = draw(st.integers(0, max(n - 1, 0)))  # a reply to an earlier request, the one replied to or not
    return (
        "save",
        {"owner": draw(st.sampled_from(["A", "B"])), "mid": mid, "row": row(mid, "assistant", draw(st.sampled_from(["a", "c"]))), "n": n, "reply_to": reply_to},
    )


@st.composite
def steps(draw):
    size = draw(st.integers(1, 10))
    return [draw(st.one_of(commits(n), saves(n), st.just(("erase", {"n": n})))) for n in range(size)]


async def state_of(store: HistoryStore, committed: set[bytes]) -> ThreadState:
    """The thread as the processor reads it (every id, the whole order), with its records."""
    state = (await store.read({"t": IDS}, EVERYTHING))["t"]
    keys = sorted(committed)
    found = await store.read_pending([("t", k) for k in keys])
    return msgspec.structs.replace(state, pending={k: r for k, r in zip(keys, found) if r is not None})


async def run(redis_url: str, sequence: list) -> None:
    client = aioredis.from_url(redis_url)
    store = HistoryStore(client, f"state-{uuid.uuid4().hex[:8]}", retry_window=3, counter=ESTIMATE)
    committed: set[bytes] = set()
    try:
        for kind, step in sequence:
            before = await state_of(store, committed)
            if kind == "save":
                identity = save_identity(step["owner"], f"s{step['n']}")
                await store.apply(
                    [Save("t", step["owner"], -1, [(step["mid"], step["row"])], ["assistant"], identity, request_id=f"q{step['reply_to']}/reply")]
                )
                continue
            if kind == "erase":
                await store.erase("t", before.version, save_identity("operator", f"e{step['n']}"), 1)
                continue
            entry = WINDOW_ENTRY.pack(step["key"], 0, step["n"], step["n"])
            if step["turn"] == "wait":  # only while a reply is being made or others wait: else decided again
                write = Write(
                    "t",
                    before.version - 1 if step["moved"] else before.version,
                    b"",
                    step["owner"],
                    -1,
                    [],
                    Recorded(),
                    [],
                    entry,
                    [],
                    f"q{step['n']}",
                    wait=b"w%d" % step["n"],
                )
                refused = step["moved"] or (before.replying is None and not before.waiting)
            else:
                write = Write(
                    "t",
                    before.version - 1 if step["moved"] else before.version,
                    b"",
                    step["owner"],
                    step["newest_ms"],
                    step["rows"],
                    Recorded(filtered=msgspec.Raw(msgspec.json.encode({"n": step["n"]}))),
                    [mid for mid, _ in step["rows"] if mid not in before.rows],
                    entry,
                    step["superseded"],
                    f"q{step['n']}",
                    step["counts"],
                    step["n"] if step["answered"] else -1,
                    woken=step["turn"] == "woken" and before.waiting > 0,  # the processor wakes only a request that waits
                )
                refused = step["moved"]
            [(status, _)] = await store.commit([write])
            if status == "ok" and not write.wait:
                committed.add(step["key"])
            expected = after_commit(before, write, store.window_bytes) if status == "ok" else before
            assert status == ("stale" if refused else "ok")
            assert await state_of(store, committed) == expected, (kind, step)
    finally:
        await reads.drop(store)
        await client.aclose()


@GENERATED
@given(sequence=steps())
def test_after_commit_leaves_the_thread_as_commit_lua_leaves_it_in_redis(redis_url, sequence):
    asyncio.run(run(redis_url, sequence))


def test_a_commit_that_saves_nothing_keeps_its_record_and_moves_only_the_window(redis_url):
    key = KEYS[0]
    sequence = [
        (
            "commit",
            {"owner": "A", "rows": [], "superseded": [], "newest_ms": -1, "counts": [], "key": key, "moved": False, "answered": False, "turn": "", "n": 0},
        )
    ]
    asyncio.run(run(redis_url, sequence))
    state = after_commit(ThreadState(None, 0, None, 0, {}, {}), Write("t", 0, b"", "A", -1, [], Recorded(), [], key + bytes(24), [], "q", []), 32)
    assert (state.version, state.owner, state.window, list(state.pending)) == (0, None, key + bytes(24), [key])

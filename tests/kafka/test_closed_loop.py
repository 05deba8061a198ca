"""The loop the product sits in, closed: scripted `useChat`-like clients, workers, the agent
runner (echo model), Kafka and Redis, all real.

Clients send full echoes as UI messages and append each saved reply before their next turn
(`streams/conversations.py`); one turn per thread asks for a client tool call and answers it.
Afterwards every thread's stored history must be exactly the client's conversation, in order,
each message once, and every filtered input's `context` the client's view when it sent the
request (no system messages here), within the window: the last MEMFILTER_HISTORY_MESSAGES rows
before the request, less those it supersedes, and what the request adds.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis.asyncio as aioredis
from pipeline import Pipeline

from memfilter.client.conversations import Conversation, Driver
from memfilter.core.tokens import ESTIMATE
from memfilter.store import reads
from memfilter.store.history import HistoryStore

HISTORY = 10
THREADS, TURNS = 200, 10


def scripts(threads: int, turns: int) -> list[Conversation]:
    out = []
    for i in range(threads):
        script = [f"thread {i} turn {k}" for k in range(turns)]
        script[3] = f'/tool lookup {{"thread": {i}}}'
        out.append(Conversation(f"loop-{i}", f"r{i % 7}", script))
    return out


def essentials(message: dict) -> tuple:
    """What the client and the store must agree on (the store adds createdAt, threadId, ...)."""
    return message["id"], message["role"], json.dumps(message["content"], sort_keys=True)


async def stored(pipeline: Pipeline, threads: list[str], prefix: str | None = None) -> dict[str, list[dict]]:
    client = aioredis.from_url(pipeline.redis_url)
    try:
        store = HistoryStore(client, prefix or pipeline.prefix)
        return {t: [json.loads(r) for r in await reads.thread_rows(store, t)] for t in threads}
    finally:
        await client.aclose()


def check(pipeline: Pipeline, conversations: list[Conversation]) -> None:
    """The stored threads (once the worker has applied the last replies, which the clients
    may have read on persist-messages first) and the contexts, against the clients."""
    deadline = time.monotonic() + 30
    while True:
        rows = asyncio.run(stored(pipeline, [c.thread for c in conversations]))
        if all(len(rows[c.thread]) == len(c.messages) for c in conversations) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for c in conversations:
        assert [essentials(m) for m in rows[c.thread]] == [essentials(m) for m in c.messages], c.thread
        turns = sum(1 for text in c.script if not text.startswith(("/regenerate", "/edit ")))
        assert len(c.messages) == 2 * turns  # a reply per turn; the answer to the tool's result continues the call's message
        for turn in c.turns:
            # the window is the last rows before the request, less what it supersedes (after its last message)
            gone = len(turn.superseded)
            assert len(turn.context) == min(len(turn.view) + gone, HISTORY + turn.new) - gone, turn.request_id
            assert [essentials(m) for m in turn.context] == [essentials(m) for m in turn.view[-len(turn.context) :]], turn.request_id


def converse(pipeline: Pipeline, conversations: list[Conversation], during=None) -> None:
    async def go():
        driving = asyncio.create_task(Driver(pipeline.bootstrap, pipeline.topics, timeout=90, run_id="r").run(conversations))
        if during is not None:
            await during(conversations)
        await driving

    asyncio.run(go())


def test_every_thread_stores_the_clients_conversation_each_context_is_its_view_and_a_replay_agrees(pipeline):
    pipeline.start_worker()
    pipeline.start_agent()
    conversations = scripts(THREADS, TURNS)
    converse(pipeline, conversations)
    check(pipeline, conversations)
    replayed = pipeline.memfilter("replay", timeout=600)  # the contexts, replies among them, decided again
    assert replayed.returncode == 0 and "identical, 0 different" in replayed.stdout, replayed.stdout + replayed.stderr


def test_with_a_worker_and_an_agent_killed_mid_run_the_result_is_the_same(pipeline):
    settings = {"MEMFILTER_SESSION_TIMEOUT": "3"}
    workers = [pipeline.start_worker(**settings) for _ in range(2)]
    agents = [pipeline.start_agent(**settings) for _ in range(2)]
    conversations = scripts(THREADS, TURNS)
    total = sum(len(c.script) + 1 for c in conversations)

    async def kill_midway(conversations):
        deadline = time.monotonic() + 300
        while sum(len(c.turns) for c in conversations) < total * 0.4 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        pipeline.kill(workers[0])
        pipeline.kill(agents[0])

    converse(pipeline, conversations, during=kill_midway)
    assert workers[0].returncode is not None and agents[0].returncode is not None
    check(pipeline, conversations)


def test_regenerates_and_edits_leave_the_clients_conversation_stored_and_a_rebuild_and_replay_agree(pipeline):
    """Each thread regenerates an answer and edits a message on the way; what they replaced is
    superseded: out of the stored conversation and of every later context, kept stored, and the
    same after a rebuild from persist-messages into a new prefix."""
    pipeline.start_worker()
    pipeline.start_agent()
    conversations = scripts(50, 8)
    for c in conversations:
        c.script[5], c.script[7] = "/regenerate", f"/edit thread {c.thread} edited"
    converse(pipeline, conversations)
    check(pipeline, conversations)
    live = asyncio.run(superseded(pipeline, pipeline.prefix, conversations))
    for c in conversations:
        regenerate, edit = c.turns[-3], c.turns[-1]  # the tool turn adds one
        assert len(regenerate.superseded) == 1 and len(edit.superseded) == 1
        assert set(live[c.thread]) == set(regenerate.superseded + edit.superseded)
        assert not set(live[c.thread]) & {m["id"] for m in c.messages}  # the new answers have ids of their own
    rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt", timeout=600)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert asyncio.run(superseded(pipeline, f"{pipeline.prefix}-rebuilt", conversations)) == live
    assert asyncio.run(stored(pipeline, [c.thread for c in conversations], f"{pipeline.prefix}-rebuilt")) == asyncio.run(
        stored(pipeline, [c.thread for c in conversations])
    )
    replayed = pipeline.memfilter("replay", timeout=600)
    assert replayed.returncode == 0 and "identical, 0 different" in replayed.stdout, replayed.stdout + replayed.stderr
    shown = pipeline.memfilter("history", "show", "loop-0")
    assert shown.stdout.count("(superseded by request loop-0-r-q5)") == 1 and shown.stdout.count("(superseded by request loop-0-r-q7)") == 1
    as_json = [json.loads(line) for line in pipeline.memfilter("history", "show", "loop-0", "--json").stdout.splitlines()]
    assert sorted(line["supersededBy"] for line in as_json if "supersededBy" in line) == ["loop-0-r-q5", "loop-0-r-q7"]


async def superseded(pipeline: Pipeline, prefix: str, conversations: list[Conversation]) -> dict[str, dict[str, tuple[str, dict]]]:
    """Each thread's superseded rows: id -> (the request that superseded it, the row)."""
    client = aioredis.from_url(pipeline.redis_url)
    try:
        store = HistoryStore(client, prefix)
        out = {}
        for c in conversations:
            out[c.thread] = {json.loads(row)["id"]: (by, json.loads(row)) for by, row in await reads.superseded_rows(store, c.thread)}
        return out
    finally:
        await client.aclose()


BUDGET = 150


def test_within_a_token_budget_each_context_is_the_most_recent_whole_turns_that_fit_and_a_rebuild_counts_the_same(pipeline, tmp_path):
    """MEMFILTER_CONTEXT_TOKENS on the worker: every context weighs at most the budget (as the
    filtered input says, and as Mastra's estimate counts it), starts on a user row, is the end of
    the client's view, and the turn before it would not have fit; a rebuild from the log stores
    the same count beside every row, and a replay decides the same and says why each row is in."""
    settings = {"MEMFILTER_CONTEXT_TOKENS": str(BUDGET), "MEMFILTER_HISTORY_MESSAGES": "100"}
    pipeline.start_worker(**settings)
    pipeline.start_agent()
    conversations = scripts(40, 8)
    converse(pipeline, conversations)
    cut = 0
    for c in conversations:
        for turn in c.turns:
            context, view = turn.context, turn.view
            assert turn.tokens is not None and turn.tokens <= BUDGET and context[0]["role"] == "user", turn.request_id
            assert turn.tokens == pytest.approx(24 + sum(ESTIMATE.message(m) for m in context))
            assert [essentials(m) for m in context] == [essentials(m) for m in view[-len(context) :]], turn.request_id
            older = view[: -len(context)]
            if older:  # the whole turn before the window would not have fit
                start = max(i for i, m in enumerate(older) if m["role"] == "user")
                assert turn.tokens + sum(ESTIMATE.message(m) for m in older[start:]) > BUDGET - 1e-9, turn.request_id
                cut += 1
    assert cut > len(conversations)  # late turns were cut by the budget
    rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt", timeout=600, **settings)
    assert rebuilt.returncode == 0, rebuilt.stderr
    live, again = (asyncio.run(counts(pipeline, prefix, conversations)) for prefix in (pipeline.prefix, f"{pipeline.prefix}-rebuilt"))
    assert live == again and all(len(live[c.thread]) == len(c.messages) for c in conversations)
    report = tmp_path / "replay.json"
    replayed = pipeline.memfilter("replay", "--why", "--report", str(report), timeout=600, **settings)
    assert replayed.returncode == 0 and "identical, 0 different" in replayed.stdout, replayed.stdout + replayed.stderr
    windows = {w["requestId"]: w["rows"] for w in json.loads(report.read_text())["windows"]}
    for turn in conversations[0].turns:  # why each row is in or out, as the replay decided it again
        rows = windows[turn.request_id]
        stored = {m["id"] for m in turn.view[:-1]} if turn.new else {m["id"] for m in turn.view}
        assert [r["id"] for r in rows if r["why"] == "in"] == [m["id"] for m in turn.context if m["id"] in stored]
        assert {r["why"] for r in rows} <= {"in", "budget", "turn"}
        shown = [line for line in replayed.stdout.splitlines() if line.startswith(f"WINDOW {turn.request_id} ")]
        assert len(shown) == 1 and all(f"{r['id']} {r['tokens']:g} {r['why']}" in shown[0] for r in rows)


async def counts(pipeline: Pipeline, prefix: str, conversations: list[Conversation]) -> dict[str, dict[bytes, bytes]]:
    """Each thread's stored token counts."""
    client = aioredis.from_url(pipeline.redis_url)
    try:
        store = HistoryStore(client, prefix)
        return {c.thread: await client.hgetall(store.keys(c.thread).tokens) for c in conversations}
    finally:
        await client.aclose()

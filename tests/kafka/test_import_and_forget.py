"""History that comes in (`memfilter history import`) and leaves (`memfilter forget`), on a
real worker, Kafka and Redis; the exports are made by Mastra's own storage (tests/node/export.mjs).

An imported thread is then decided as if it had been stored live: a useChat echo of it is
`unchanged`, a new message is the only thing saved; importing again changes nothing, and a
thread of another resource is refused. An erased resource leaves nothing in Redis but a
tombstone per thread, and nothing of it comes back: not from a stale tab's full echo, a stray
or replayed persist event, a rebuild from the log or a replay; other resources' keys are
untouched. With MEMFILTER_REOPEN_ERASED=on a new conversation may start an erased thread again,
and a rebuild still agrees with the live store.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
from pipeline import Pipeline, dump, end_offsets, publish, read

from memfilter.client import Client, RequestRejected
from memfilter.core import origin
from memfilter.store import reads

NODE = Path(__file__).parents[1] / "node"
pytestmark = pytest.mark.timeout(600)


def mastra_and_ui_exports(threads: list[dict]) -> dict:
    """The threads saved by Mastra's storage: its table rows, and its AI SDK UI messages."""
    done = subprocess.run(["node", "export.mjs"], cwd=NODE, input=json.dumps({"threads": threads}).encode(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def conversation(thread: str, resource: str, turns: int) -> dict:
    messages = []
    for k in range(turns):
        messages.append({"id": f"{thread}-u{k}", "role": "user", "createdAt": f"2026-01-05T10:{k:02d}:01.000Z", "content": _text(f"question {k} of {thread}")})
        reply = _text(f"answer {k}")
        if k == 1:  # a tool call and its result, in one row
            inv = {"state": "result", "toolCallId": f"{thread}-c1", "toolName": "lookup", "args": {"q": k}, "result": {"found": True}}
            reply["parts"].insert(0, {"type": "tool-invocation", "toolInvocation": inv})
        messages.append({"id": f"{thread}-a{k}", "role": "assistant", "createdAt": f"2026-01-05T10:{k:02d}:02.000Z", "content": reply})
    return {"id": thread, "resourceId": resource, "title": f"about {thread}", "messages": messages}


def _text(words: str) -> dict:
    return {"format": 2, "parts": [{"type": "text", "text": words}]}


def lines(rows: list) -> bytes:
    return b"\n".join(json.dumps(r).encode() for r in rows) + b"\n"


def ask(pipeline: Pipeline, request: dict) -> object:
    async def go():
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            try:
                return await client.ask(request, timeout=60)
            except RequestRejected as e:
                return e

    return asyncio.run(go())


def rows_of(pipeline: Pipeline, thread: str, prefix: str | None = None) -> list[dict]:
    async def go():
        client, store = pipeline.store()
        store.prefix = prefix or store.prefix
        try:
            return [json.loads(r) for r in await reads.thread_rows(store, thread)]
        finally:
            await client.aclose()

    return asyncio.run(go())


def import_file(pipeline: Pipeline, tmp_path: Path, name: str, content: bytes, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / name
    path.write_bytes(content)
    return pipeline.memfilter("history", "import", str(path), "--wait", "60", **env)


class TestImport:
    def test_imported_threads_are_decided_as_if_stored_live_and_importing_again_changes_nothing(self, pipeline, tmp_path):
        pipeline.start_worker()
        exports = mastra_and_ui_exports([conversation(f"m{i}", f"r{i % 2}", 3) for i in range(3)])
        ui = mastra_and_ui_exports([conversation(f"ui{i}", "r-ui", 2) for i in range(2)])["ui"]
        done = import_file(pipeline, tmp_path, "mastra.jsonl", lines(exports["mastra"]))
        assert done.returncode == 0 and "imported 3 threads (18 messages)" in done.stdout, done.stdout + done.stderr
        done = import_file(pipeline, tmp_path, "ui.jsonl", lines(ui))
        assert done.returncode == 0 and "imported 2 threads (8 messages)" in done.stdout, done.stdout + done.stderr

        stored = rows_of(pipeline, "m1")  # the rows as Mastra keeps them, in their order, owned by the export's resource
        assert [(m["id"], m["role"], m["content"], m["createdAt"], m["resourceId"]) for m in stored] == [
            (m["id"], m["role"], m["content"], m["createdAt"], "r1") for m in conversation("m1", "r1", 3)["messages"]
        ]
        assert [m["id"] for m in rows_of(pipeline, "ui1")] == ["ui1-u0", "ui1-a0", "ui1-u1", "ui1-a1"]

        before = asyncio.run(dump(pipeline, pipeline.prefix))
        again = import_file(pipeline, tmp_path, "mastra.jsonl", lines(exports["mastra"]))
        assert again.returncode == 0 and "imported 0 threads" in again.stdout and "3 stored already" in again.stdout, again.stdout
        again = import_file(pipeline, tmp_path, "ui.jsonl", lines(ui))
        assert again.returncode == 0 and "2 stored already" in again.stdout, again.stdout
        assert asyncio.run(dump(pipeline, pipeline.prefix)) == before

        # the useChat client of an imported thread echoes it whole, then adds a message: decided
        # as on a twin thread whose history was stored live (seeded by its first request)
        new = {"id": "ui1-u2", "role": "user", "parts": [{"type": "text", "text": "and now?"}]}
        twin = [{**m, "id": f"twin-{m['id']}"} for m in ui[1]["messages"]]
        assert ask(pipeline, {"threadId": "twin", "resourceId": "r-ui", "messages": twin}).outcome == "seeded"
        for n, messages in enumerate((ui[1]["messages"], ui[1]["messages"] + [new])):
            imported = ask(pipeline, {"threadId": "ui1", "resourceId": "r-ui", "messages": messages, "requestId": f"echo-{n}"})
            live = ask(
                pipeline, {"threadId": "twin", "resourceId": "r-ui", "messages": [{**m, "id": f"twin-{m['id']}"} for m in messages], "requestId": f"twin-{n}"}
            )
            assert (imported.outcome, len(imported.messages), len(imported.dropped)) == (live.outcome, len(live.messages), len(live.dropped))
            assert [m["id"] for m in imported.context] == [m["id"].removeprefix("twin-") for m in live.context]
        assert (imported.outcome, [m["id"] for m in imported.messages if "id" in m]) == ("user-tail", ["ui1-u2"])
        assert [m["id"] for m in rows_of(pipeline, "ui1")] == ["ui1-u0", "ui1-a0", "ui1-u1", "ui1-a1", "ui1-u2"]  # the new message, only

        rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt", timeout=300)
        assert rebuilt.returncode == 0, rebuilt.stderr
        assert asyncio.run(dump(pipeline, f"{pipeline.prefix}-rebuilt")) == asyncio.run(dump(pipeline, pipeline.prefix))

    def test_a_thread_of_another_resource_or_with_clashing_rows_is_refused_and_not_written(self, pipeline, tmp_path):
        pipeline.start_worker()
        live = ask(
            pipeline, {"threadId": "taken", "resourceId": "owner", "messages": [{"id": "x1", "role": "user", "parts": [{"type": "text", "text": "mine"}]}]}
        )
        assert live.outcome == "unchanged"  # a first message: saved as it is
        theirs = mastra_and_ui_exports([conversation("taken", "intruder", 1), conversation("fine", "owner", 1)])["ui"]
        before = asyncio.run(dump(pipeline, pipeline.prefix))
        done = import_file(pipeline, tmp_path, "taken.jsonl", lines(theirs[:1]))
        assert done.returncode == 1 and "thread taken not imported: belongs to resource owner" in done.stderr, done.stderr
        assert asyncio.run(dump(pipeline, pipeline.prefix)) == before
        clash = [{"threadId": "taken", "resourceId": "owner", "messages": [{"id": "x1", "role": "user", "parts": [{"type": "text", "text": "not mine"}]}]}]
        done = import_file(pipeline, tmp_path, "clash.jsonl", lines(clash + theirs[1:]))
        assert done.returncode == 1 and "message x1 is stored with other content" in done.stderr, done.stderr
        assert "imported 1 thread (2 messages)" in done.stdout  # the other thread of the file goes in
        assert [m["content"]["parts"][0]["text"] for m in rows_of(pipeline, "taken")] == ["mine"]


def test_a_forgotten_resource_leaves_a_tombstone_per_thread_and_nothing_brings_it_back(pipeline):
    pipeline.start_worker()
    history = {}
    for thread, resource in (("gone-1", "erased-user"), ("gone-2", "erased-user"), ("kept", "other-user")):
        messages = [{"id": f"{thread}-u0", "role": "user", "parts": [{"type": "text", "text": f"hello from {thread}"}]}]
        assert ask(pipeline, {"threadId": thread, "resourceId": resource, "messages": messages, "requestId": f"{thread}-q0"}).outcome == "unchanged"
        messages.append({"id": f"{thread}-a0", "role": "assistant", "parts": [{"type": "text", "text": "hi"}]})
        messages.append({"id": f"{thread}-u1", "role": "user", "parts": [{"type": "text", "text": "more"}]})
        assert ask(pipeline, {"threadId": thread, "resourceId": resource, "messages": messages, "requestId": f"{thread}-q1"}).outcome == "user-tail"
        history[thread] = messages
    erased_ids = [m["id"] for t in ("gone-1", "gone-2") for m in history[t]]
    others_before = _all_but(pipeline, ("gone-1", "gone-2"), erased_ids)
    persisted = asyncio.run(read(pipeline.bootstrap, [pipeline.topics.persist], lambda got: len(got) >= 6))
    old_event = next(r for r in persisted if r.key == b"gone-1")

    listed = pipeline.memfilter("forget", "--resource", "erased-user", "--dry-run")
    assert listed.stdout.split() == ["gone-1", "gone-2"], listed.stdout + listed.stderr
    done = pipeline.memfilter("forget", "--resource", "erased-user", "--by", "dpo@example.com", "--reason", "ticket 42")
    assert done.returncode == 0 and "erased 2 threads of resource erased-user (4 messages)" in done.stdout, done.stdout + done.stderr

    for thread in ("gone-1", "gone-2"):  # a tombstone: no content, no owner
        keys = _keys_of(pipeline, thread)
        assert list(keys) == [f"t:{{{thread}}}:meta"], keys
        assert set(keys[f"t:{{{thread}}}:meta"]) == {b"version", b"erased", b"erasures"}  # and the owner epoch, which `dump` leaves out
    assert not _indexed(pipeline, erased_ids)
    assert _all_but(pipeline, ("gone-1", "gone-2"), erased_ids) == others_before  # every other key, the index's other entries too
    erasure = asyncio.run(read(pipeline.bootstrap, [pipeline.topics.persist], lambda got: sum(b"erasure" in r.value for r in got) >= 2))
    event = json.loads(next(r.value for r in erasure if r.key == b"gone-1" and b"erasure" in r.value))
    assert event["messages"] == [] and event["erasure"]["by"] == "dpo@example.com" and event["erasure"]["reason"] == "ticket 42"

    # the stale tab sends the whole conversation again; a new message alone does not reopen it either
    stale = ask(pipeline, {"threadId": "gone-1", "resourceId": "erased-user", "messages": history["gone-1"], "requestId": "stale"})
    assert isinstance(stale, RequestRejected) and stale.type == "erased", stale
    fresh = [{"id": "new-1", "role": "user", "parts": [{"type": "text", "text": "start over"}]}]
    assert ask(pipeline, {"threadId": "gone-1", "resourceId": "erased-user", "messages": fresh}).type == "erased"
    # a stray save of another service, and the processor's own old event published again
    stray = msgspec.json.encode({"requestId": "late", "threadId": "gone-2", "resourceId": "erased-user", "messages": [{**_stored(history["gone-2"][0])}]})
    now = int(time.time() * 1000)
    asyncio.run(publish(pipeline.bootstrap, pipeline.topics.persist, [(b"gone-2", stray, now), (b"gone-1", old_event.value, now, old_event.headers)]))
    dead = asyncio.run(read(pipeline.bootstrap, [pipeline.topics.dlq], lambda got: any(r.key == b"gone-2" for r in got)))
    assert [dict(r.headers)["error.type"] for r in dead if r.key == b"gone-2"] == [b"erased"]
    assert {r.value for r in dead if dict(r.headers)["error.type"] == b"erased"} == {b""}  # what they re-sent is not copied again
    assert list(_keys_of(pipeline, "gone-1")) == ["t:{gone-1}:meta"] and list(_keys_of(pipeline, "gone-2")) == ["t:{gone-2}:meta"]

    # a rebuild from the log, and a replay of every request, bring nothing of it back
    rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt", timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert asyncio.run(dump(pipeline, f"{pipeline.prefix}-rebuilt")) == asyncio.run(dump(pipeline, pipeline.prefix))
    replayed = pipeline.memfilter("replay", "--strict", timeout=300)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "replayed 8 requests: 4 identical, 0 different, 4 decided on history since erased" in replayed.stdout, replayed.stdout

    # the operator may let a new conversation start an erased thread again; the stale tab still may not
    pipeline.stop_all()
    pipeline.start_worker(MEMFILTER_REOPEN_ERASED="on")
    since = asyncio.run(end_offsets(pipeline.bootstrap, pipeline.topics.requests))
    again = ask(pipeline, {"threadId": "gone-1", "resourceId": "erased-user", "messages": fresh, "requestId": "restart"})
    assert again.outcome == "unchanged" and [m["id"] for m in again.context] == ["new-1"]
    assert ask(pipeline, {"threadId": "gone-2", "resourceId": "erased-user", "messages": history["gone-2"], "requestId": "stale-2"}).type == "erased"
    assert [m["id"] for m in rows_of(pipeline, "gone-1")] == ["new-1"]
    rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt2", timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert asyncio.run(dump(pipeline, f"{pipeline.prefix}-rebuilt2")) == asyncio.run(dump(pipeline, pipeline.prefix))
    # (a replay decides with today's settings: from the change on, where they were the same)
    replayed = pipeline.memfilter("replay", "--strict", "--from", since, timeout=300, MEMFILTER_REOPEN_ERASED="on")
    assert replayed.returncode == 0 and "replayed 2 requests: 2 identical, 0 different" in replayed.stdout, replayed.stdout + replayed.stderr

    # erased again, the restarted thread: a rebuild begins it at its last erasure
    done = pipeline.memfilter("forget", "--thread", "gone-1")
    assert done.returncode == 0 and done.stdout.startswith("erased thread gone-1 (1 message)"), done.stdout + done.stderr
    assert pipeline.memfilter("forget", "--thread", "gone-1").stdout.startswith("thread gone-1 was erased before")
    rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt3", timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert asyncio.run(dump(pipeline, f"{pipeline.prefix}-rebuilt3")) == asyncio.run(dump(pipeline, pipeline.prefix))
    assert list(_keys_of(pipeline, "gone-1")) == ["t:{gone-1}:meta"]


def _stored(ui_message: dict) -> dict:
    return {"id": ui_message["id"], "role": ui_message["role"], "content": {"format": 2, "parts": ui_message["parts"]}}


def _keys_of(pipeline: Pipeline, thread: str) -> dict:
    """Every key of a thread under the pipeline's prefix, with what it holds (hashes without their epoch)."""
    everything = asyncio.run(dump(pipeline, pipeline.prefix))
    return {name.removeprefix(":"): value for name, value in everything.items() if name.startswith(f":t:{{{thread}}}:")}


def _all_but(pipeline: Pipeline, threads: tuple[str, ...], ids: list[str]) -> dict:
    """Every key under the pipeline's prefix but those of these threads, and the message-id
    index without the entries of these ids."""
    _, store = pipeline.store()
    fields = {store.id_key(mid) for mid in ids}
    out = {}
    for name, value in asyncio.run(dump(pipeline, pipeline.prefix)).items():
        if any(name.startswith(f":t:{{{t}}}:") for t in threads):
            continue
        if name.startswith(":idx:"):
            value = {k: v for k, v in value.items() if (f"{pipeline.prefix}{name}", k) not in fields}
            if not value:  # a bucket left empty is no key in Redis
                continue
        out[name] = value
    return out


def _indexed(pipeline: Pipeline, ids: list[str]) -> list[str]:
    """Those of these message ids the message-id index still holds."""

    async def go():
        client, store = pipeline.store()
        try:
            held, _, _ = await store.owners(ids)
            return sorted(held)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_an_erasure_needs_the_operators_signature(pipeline):
    """Anyone who can write persist-messages could erase others' threads: an erasure without
    the operator's signature is refused, and one signed as the processor's too."""
    pipeline.start_worker()
    assert ask(pipeline, {"threadId": "safe", "resourceId": "r1", "messages": [{"id": "s1", "role": "user", "content": _text("hi")}]}).outcome == "unchanged"
    before = _keys_of(pipeline, "safe")
    erasure = {
        "requestId": "evil",
        "threadId": "safe",
        "resourceId": "r1",
        "messages": [],
        "historyVersion": 1,
        "erasure": {"at": "2026-01-01T00:00:00Z", "by": "x", "scope": "thread"},
    }
    value = msgspec.json.encode(erasure)
    now = int(time.time() * 1000)
    forged = [
        (b"safe", value, now),
        (b"safe", value, now, list(origin.headers(value, pipeline.secret))),
        (b"safe", value, now, [origin.OPERATOR, (origin.SIGNATURE, b"00" * 32)]),
    ]
    asyncio.run(publish(pipeline.bootstrap, pipeline.topics.persist, forged))
    dead = asyncio.run(read(pipeline.bootstrap, [pipeline.topics.dlq], lambda got: sum(r.key == b"safe" for r in got) >= 2))
    assert sorted(dict(r.headers)["error.type"] for r in dead if r.key == b"safe") == [b"origin", b"origin"]
    assert _keys_of(pipeline, "safe") == before  # the processor-signed copy is skipped live as the processor's own

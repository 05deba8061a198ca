"""Semantic recall's choice of rows (`memfilter.core.recall`) against Mastra's own
SemanticRecall processor (@mastra/core 1.71.0, in Node: tests/node/recall.mjs): the question
it embeds, the rows it adds to the thread's history, and the system message of other threads'
rows, to the byte, on examples and on random threads and scores."""

from __future__ import annotations

import json
import random
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from memfilter.core.recall import Match, embedded_text, question, recall, remembered, with_recalled

NODE = Path(__file__).parents[1] / "node"
START = datetime(2026, 1, 1, 11, 40, tzinfo=UTC)


def mastra(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What tests/node/recall.mjs answers, from Mastra's code."""
    done = subprocess.run(["node", "recall.mjs"], cwd=NODE, input=json.dumps({"cases": cases}).encode(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def row(id: str, thread: str, at: datetime, role: str, texts: list[str], as_string: bool = False, parts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    given = [{"type": "text", "text": t} for t in texts] if parts is None else parts
    content: dict[str, Any] = {"format": 2, "parts": given}
    if as_string:
        content["content"] = " ".join(p["text"] for p in given if p["type"] == "text")
    return {
        "id": id,
        "threadId": thread,
        "resourceId": "r1",
        "role": role,
        "type": "v2",
        "createdAt": at.isoformat().replace("+00:00", "Z"),
        "content": content,
    }


def parts(rng: random.Random, role: str) -> list[dict[str, Any]]:
    """A stored message's parts: text, and for an assistant tool calls (pending or answered,
    in steps; the working memory's own among them), reasoning and files."""
    kinds = ["text", "text", "file"] + (["call", "call", "reasoning", "step-start"] if role == "assistant" else [])
    out: list[dict[str, Any]] = []
    for _ in range(rng.randint(0, 4)):
        kind = rng.choice(kinds)
        if kind == "text":
            out.append({"type": "text", "text": f"w{rng.randint(0, 9)}"})
        elif kind == "file":
            out.append({"type": "file", "mimeType": "text/plain", "data": "aGk="})
        elif kind == "reasoning":
            out.append({"type": "reasoning", "reasoning": "", "details": [{"type": "text", "text": "hm"}]})
        elif kind == "step-start":
            out.append({"type": "step-start"})
        else:
            state = rng.choice(["call", "result"])
            call = {
                "state": state,
                "toolCallId": f"c{rng.randint(0, 99)}",
                "toolName": rng.choice(["weather", "updateWorkingMemory"]),
                "args": {},
                "step": rng.randint(0, 1),
            }
            out.append({"type": "tool-invocation", "toolInvocation": call | ({"result": "sunny"} if state == "result" else {})})
    return out


def case(rng: random.Random) -> dict[str, Any]:
    """Three threads of one resource at random times (across noon and midnight), the current
    one's last rows in the context, and scored matches among all their rows."""
    times = iter(sorted(rng.sample(range(0, 60 * 30), 40)))
    threads: dict[str, list[dict[str, Any]]] = {}
    for thread in ("t1", "t2", "t3"):
        roles = [rng.choice(["user", "assistant"]) for _ in range(rng.randint(0, 10))]
        threads[thread] = [
            row(f"{thread}-m{i}", thread, START + timedelta(minutes=next(times)), role, [], rng.random() < 0.2, parts(rng, role))
            for i, role in enumerate(roles)
        ]
    stored = [r for rows in threads.values() for r in rows]
    scope = rng.choice(["resource", "thread"])
    picked = rng.sample(stored, min(len(stored), rng.randint(0, 6)))
    scores = sorted(rng.sample(range(1, 1000), len(picked)), reverse=True)
    matches = [{"message_id": r["id"], "thread_id": r["threadId"], "score": s / 1000} for r, s in zip(picked, scores, strict=True)]
    return {
        "threads": threads,
        "context": threads["t1"][len(threads["t1"]) - rng.randint(0, 4) :] if threads["t1"] else [],
        "input": row("q", "t1", START + timedelta(days=2), "user", rng.choice([["what was w3"], ["a", "b"], []])),
        "matches": matches,
        "topK": rng.randint(1, 5),
        "before": rng.randint(0, 2),
        "after": rng.randint(0, 2),
        "threshold": rng.choice([None, 0.5]),
        "scope": scope,
        "thread": "t1",
    }


def ours(c: dict[str, Any]) -> dict[str, Any]:
    """What memfilter recalls for the case, in the shape recall.mjs answers."""
    asked = question([c["input"]])
    embedded = [embedded_text(m) for m in [*c["context"], c["input"]]]
    if asked is None:
        return {"question": None, "embedded": embedded, "history": [m["id"] for m in [*c["context"], c["input"]]], "system": []}
    matches = [Match(m["message_id"], m["thread_id"], m["score"]) for m in c["matches"] if c["scope"] == "resource" or m["thread_id"] == c["thread"]]
    held = {m["id"] for m in [*c["context"], c["input"]]}
    got = recall(matches, c["threads"], held, c["thread"], c["topK"], c["before"], c["after"], c["threshold"])
    given = with_recalled([*c["context"], c["input"]], got, c["thread"])
    history = [m["id"] for m in given if m["role"] != "system"]
    system = [m["content"]["content"] for m in given if m["role"] == "system"]
    return {"question": asked, "embedded": embedded, "history": history, "system": system}


class TestTheQuestion:
    def test_is_the_last_user_messages_text_its_parts_joined_by_spaces(self):
        at = START
        assert question([row("a", "t", at, "user", ["one", "two"]), row("b", "t", at, "assistant", ["x"])]) == "one two"
        assert question([row("a", "t", at, "user", ["one"], as_string=True), row("b", "t", at, "user", [])]) == "one"
        assert question([row("a", "t", at, "assistant", ["x"])]) is None


class TestTheTextEmbedded:
    def test_is_the_content_string_else_the_text_parts_by_lines_and_nothing_of_a_system_message(self):
        at = START
        assert embedded_text(row("a", "t", at, "assistant", ["one", "two"])) == "one\ntwo"
        assert embedded_text(row("a", "t", at, "user", ["one", "two"], as_string=True)) == "one two"
        assert embedded_text(row("a", "t", at, "user", [], parts=[{"type": "file", "url": "x"}])) is None
        assert embedded_text(row("a", "t", at, "system", ["be brief"])) is None
        # and on random messages as Mastra's SemanticRecall embeds them: TestTheRowsRecalled's parity test


class TestTheRowsRecalled:
    def test_each_match_with_its_neighbours_but_none_the_input_holds(self):
        rows = [row(f"m{i}", "t1", START + timedelta(minutes=i), "user", [str(i)]) for i in range(8)]
        got = recall([Match("m2", "t1", 0.9), Match("m6", "t1", 0.8)], {"t1": rows}, {"m6", "m7"}, "t1", top_k=2, before=1, after=1)
        assert [r["id"] for r in got.own] == ["m1", "m2", "m3", "m5"] and got.other == []

    def test_only_the_best_top_k_and_none_below_the_threshold(self):
        rows = [row(f"m{i}", "t1", START + timedelta(minutes=i), "user", [str(i)]) for i in range(8)]
        matches = [Match("m1", "t1", 0.9), Match("m4", "t1", 0.4), Match("m7", "t1", 0.3)]
        assert [r["id"] for r in recall(matches, {"t1": rows}, set(), "t1", top_k=2, before=0, after=0, threshold=0.5).own] == ["m1"]

    def test_another_threads_rows_are_remembered_apart_with_their_day_and_time(self):
        rows = [row("o1", "t2", START, "user", ["my name is Sam"]), row("o2", "t2", START + timedelta(hours=1), "assistant", ["hi Sam"])]
        got = recall([Match("o1", "t2", 0.9)], {"t2": rows}, set(), "t1")
        assert got.own == [] and [r["id"] for r in got.other] == ["o1", "o2"]
        assert remembered(got.other, "t1") == (
            "The following messages were remembered from a different conversation:\n<remembered_from_other_conversation>\n\n"
            "the following messages are from 2026, Jan, 1\n"
            "Message from previous conversation at 11:40 AM: User: my name is SamMessage from previous conversation at 12:40 PM: Assistant: hi Sam"
            "\n<end_remembered_from_other_conversation>"
        )

    def test_as_mastras_processor_chooses_them_on_random_threads_and_scores(self):
        rng = random.Random(59)
        cases = [case(rng) for _ in range(200)]
        for c, theirs in zip(cases, mastra(cases), strict=True):
            assert ours(c) == theirs, c

"""Every case of the shared conformance suite, through `memfilter explain` as a user runs it.

The cases are copies of `shared/conformance/cases.json` and `ui-cases.json` (the project must
not need `shared/`).
A case passes when the outcome (and the error type of a rejection), the kept messages, the
saved rows, the model's context and the superseded rows (where the case says) equal the expectation as JSON values, `"<assigned>"` standing for a server-made
value; every id the client sent and the output lacks is in `dropped`; and a second run gives
the same bytes.
"""

import json
import subprocess
import sys
from datetime import datetime

import pytest
from factories import CASES

ASSIGNED = "<assigned>"


def run_explain(payload: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfilter", "explain"], input=payload, capture_output=True, check=False)


@pytest.fixture(scope="module")
def answers():
    """All cases in one `explain` call (an array), run twice to compare bytes."""
    payload = json.dumps([c["case"] for c in CASES]).encode()
    first, second = run_explain(payload), run_explain(payload)
    assert first.returncode == 0, first.stderr.decode()
    return first.stdout, second.stdout


def matches(expected, actual, assigned: dict, path: str = "$") -> None:
    """Compare JSON values; `<assigned>` binds to a server-made value, the same per message."""
    if expected == ASSIGNED:
        assert isinstance(actual, str) and actual, f"{path}: expected an assigned value, got {actual!r}"
        if path.endswith(".createdAt"):
            datetime.fromisoformat(actual)
        return
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected an object, got {actual!r}"
        assert expected.keys() == actual.keys(), f"{path}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            matches(expected[key], actual[key], assigned, f"{path}.{key}")
        return
    if isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{path}: {actual!r} != {expected!r}"
        for i, (e, a) in enumerate(zip(expected, actual)):
            matches(e, a, assigned, f"{path}[{i}]")
        return
    assert expected == actual, f"{path}: {actual!r} != {expected!r}"


def assigned_ids_agree(expect: dict, got: dict) -> None:
    """A message with an assigned id carries the same id in `messages` and `persist`."""

    def assigned(messages, expected):
        return [a["id"] for e, a in zip(expected, messages) if e.get("id") == ASSIGNED]

    from_messages = assigned(got["messages"], expect["messages"])
    from_persist = assigned(got["persist"], expect["persist"])
    assert set(from_persist) <= set(from_messages), (from_persist, from_messages)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["name"] for c in CASES])
def test_conformance_case(index, answers):
    case, expect = CASES[index]["case"], CASES[index]["expect"]
    got = json.loads(answers[0])[index]
    assert got["outcome"] == expect["outcome"]
    if expect["outcome"] == "rejected":
        assert got["error"]["type"] == expect["error_type"]
        assert got["error"]["message"]
    matches(expect["messages"], got["messages"], {}, "$.messages")
    matches(expect["persist"], got["persist"], {}, "$.persist")
    for key in ("context", "superseded"):
        if key in expect:
            matches(expect[key], got[key], {}, f"$.{key}")
    assigned_ids_agree(expect, got)
    if expect["outcome"] != "rejected":
        sent = [m["id"] for m in case["request"]["messages"] if "id" in m]
        kept = {m.get("id") for m in got["messages"]}
        dropped = [d["id"] for d in got["dropped"]]
        assert dropped == list(dict.fromkeys(i for i in sent if i not in kept))
        assert all(d["reason"] for d in got["dropped"])


def test_explain_gives_the_same_bytes_twice(answers):
    assert answers[0] == answers[1]


def test_explain_answers_a_single_case_with_a_single_object():
    result = run_explain(json.dumps(CASES[0]["case"]).encode())
    assert result.returncode == 0
    assert json.loads(result.stdout) == json.loads(run_explain(json.dumps([CASES[0]["case"]]).encode()).stdout)[0]

"""`memfilter explain` as a person uses it: bad input, rejections, the installed script."""

import json
import shutil
import subprocess
import sys

import pytest


def explain(payload: bytes, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memfilter", "explain", *argv], input=payload, capture_output=True)


def case(**request):
    base = {"threadId": "t1", "resourceId": "r1", "messages": [user("u1")]}
    return {"request": {**base, **request}, "stored": [], "storedElsewhere": [], "timestamp": 0}


def user(mid=None, text="hi", **extra):
    m = {"role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": text}]}, **extra}
    if mid:
        m["id"] = mid
    return m


class TestUnusableInputExitsTwoWithOneLine:
    @pytest.mark.parametrize(
        "payload",
        [b"{not json", b"42", b'{"stored": []}', b'[{"request": {"threadId": "t1"}, "stored": 7}]'],
        ids=["not JSON", "a number", "no request", "stored not a list"],
    )
    def test_exits_2_with_a_one_line_reason(self, payload):
        result = explain(payload)
        assert result.returncode == 2
        assert result.stdout == b""
        lines = result.stderr.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("memfilter explain: ")

    def test_a_missing_file_is_named(self, tmp_path):
        result = explain(b"", str(tmp_path / "nope.json"))
        assert result.returncode == 2
        assert "nope.json" in result.stderr.decode()


class TestRequestsTheProcessorWouldRejectAreDecisions:
    @pytest.mark.parametrize(
        "request_, error_type",
        [
            ({"threadId": 5}, "schema"),
            ({"threadId": ""}, "schema"),
            ({"messages": [user("u1", role="tool")]}, "schema"),
            ({"messages": [{"role": "user", "content": {"format": 1, "parts": []}}]}, "schema"),
            ({"messages": [user("u1"), user("u1")]}, "schema"),
            ({"messages": [user("u1", threadId="t2")]}, "thread-mismatch"),
            ({"messages": [user(str(i)) for i in range(1001)]}, "too-large"),
            ({"messages": [user("u1", text="x" * (1 << 20))]}, "too-large"),
        ],
        ids=[
            "threadId not a string",
            "empty threadId",
            "role tool",
            "format 1",
            "duplicate ids",
            "message of another thread",
            "too many messages",
            "too many bytes",
        ],
    )
    def test_rejected_with_the_error_type_of_the_contract(self, request_, error_type):
        result = explain(json.dumps(case(**request_)).encode())
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["outcome"] == "rejected"
        assert answer["error"]["type"] == error_type
        assert answer["messages"] == answer["persist"] == []

    def test_the_ownership_error_names_thread_owner_and_requester(self):
        c = case(resourceId="r1")
        c["owner"] = "r2"
        answer = json.loads(explain(json.dumps(c).encode()).stdout)
        assert answer["error"] == {"type": "ownership", "message": "thread t1 belongs to resource r2; request from r1 rejected"}


def test_the_console_script_is_installed_and_gives_the_module_answer():
    script = shutil.which("memfilter") or str(__import__("pathlib").Path(sys.executable).parent / "memfilter")
    payload = json.dumps(case()).encode()
    installed = subprocess.run([script, "explain"], input=payload, capture_output=True)
    assert installed.returncode == 0
    assert installed.stdout == explain(payload).stdout

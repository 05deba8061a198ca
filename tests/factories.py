"""What many tests build: the same instant, the same secret, a text message, stored messages and a
filtered input for the agent runner's tests, the conformance cases."""

from __future__ import annotations

import json
from pathlib import Path

from memfilter.schemas.wire import FilteredInput, Source

T0 = 1772366400000  # 2026-03-01T12:00:00Z, a record time
SECRET = b"the-tests-secret-0123456789"  # MEMFILTER_SECRET where a test needs a deployment's
DATA = Path(__file__).parent / "data"
# The cases of ../shared/conformance in `memfilter explain`'s shape: the filter's and the UI messages'.
UI_CASES = json.loads((DATA / "ui-conformance-cases.json").read_text())
CASES = json.loads((DATA / "conformance-cases.json").read_text()) + UI_CASES


def msg(mid: str | None, role: str = "user", text: str = "hi", **extra) -> dict:
    """A stored-form message with one text part (no id when `mid` is None)."""
    m = {"role": role, "content": {"format": 2, "parts": [{"type": "text", "text": text}]}, **extra}
    return m if mid is None else {"id": mid, **m}


# Stored messages (format 2) and a filtered input holding them, as the agent runner gets them.
def text(mid, role, words, **extra):
    return {"id": mid, "role": role, "content": {"format": 2, "parts": [{"type": "text", "text": words}]}, **extra}


def tool(mid, state, **inv):
    return {
        "id": mid,
        "role": "assistant",
        "content": {
            "format": 2,
            "parts": [
                {"type": "step-start"},
                {"type": "tool-invocation", "toolInvocation": {"state": state, "toolCallId": "c1", "toolName": "lookup", "args": {"q": 1}, **inv}},
            ],
        },
    }


def filtered(context, request_id="q1", thread="t1"):
    return FilteredInput(request_id, thread, "r1", "user-tail", [], context, [], Source("chat-requests", 0, 0), 0)

"""Realistic chat threads for benchmarks: what `useChat` echoes and what storage holds.

A turn is a user question and an assistant answer that calls a tool (the result carried in the
same message), with reasoning and provider item references as OpenAI's Responses API leaves
them. The echo is what the client sends back: the same ids, provider metadata gone, text
re-trimmed, a client tool result for the last (pending) call, and one new user message.
"""

from __future__ import annotations

from typing import Any


def stored_thread(thread: str, resource: str, turns: int, pending: bool = True) -> list[dict[str, Any]]:
    rows = []
    for t in range(turns):
        stamp = f"2026-03-01T10:{t // 60:02d}:{t % 60:02d}.000Z"
        rows.append(
            {
                "id": f"{thread}-u{t}",
                "role": "user",
                "createdAt": stamp,
                "threadId": thread,
                "resourceId": resource,
                "type": "v2",
                "content": {"format": 2, "parts": [{"type": "text", "text": f"Question {t}: what about city {t}?"}]},
            }
        )
        last = pending and t == turns - 1
        call = {
            "state": "call" if last else "result",
            "toolCallId": f"call_{thread}_{t}",
            "toolName": "getWeather",
            "args": {"city": f"City {t}", "day": "tomorrow"},
        }
        if not last:
            call["result"] = {"tempC": 10 + t % 15, "sky": "sunny", "wind": {"kmh": 12, "dir": "NW"}}
        rows.append(
            {
                "id": f"{thread}-a{t}",
                "role": "assistant",
                "createdAt": stamp,
                "threadId": thread,
                "resourceId": resource,
                "type": "v2",
                "content": {
                    "format": 2,
                    "content": f"In City {t}: mild.",
                    "parts": [
                        {"type": "step-start"},
                        {
                            "type": "reasoning",
                            "reasoning": "",
                            "details": [{"type": "text", "text": "Look up the forecast."}],
                            "providerMetadata": {"openai": {"itemId": f"rs_{t}", "reasoningEncryptedContent": None}},
                        },
                        {"type": "tool-invocation", "toolInvocation": call, "providerMetadata": {"openai": {"itemId": f"fc_{t}"}}},
                        {"type": "step-start"},
                        {"type": "text", "text": f"In City {t}: mild.", "providerMetadata": {"openai": {"itemId": f"msg_{t}"}}},
                    ],
                },
            }
        )
    return rows


def echo_of(rows: list[dict[str, Any]], new_text: str = "And next week?") -> list[dict[str, Any]]:
    """The client's full-history echo of `rows`, answering a pending call, plus a new message."""
    echo = []
    for row in rows:
        parts = []
        for part in row["content"]["parts"]:
            part = {k: v for k, v in part.items() if k != "providerMetadata"}
            inv = part.get("toolInvocation")
            if inv is not None and inv["state"] == "call":
                part["toolInvocation"] = {**inv, "state": "result", "result": {"tempC": 21, "sky": "clear"}}
            if part["type"] == "text":
                part["text"] = part["text"] + " "
            parts.append(part)
        echo.append({"id": row["id"], "role": row["role"], "createdAt": row["createdAt"], "content": {"format": 2, "parts": parts}})
    echo.append({"role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": new_text}]}})
    return echo

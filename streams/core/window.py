"""The model's context window: which rows of the conversation the model sees, and why.

A request's `context` is its system messages, a window of the conversation's last rows with
what the request contributes to them in place, then what else it contributes
(`memfilter.core.filter`). This module chooses the window (`docs/agent.md`, "`context`" and
"The context's window in tokens"):

- by rows (MEMFILTER_HISTORY_MESSAGES, Mastra's `lastMessages`): the last `history` rows,
  reaching back to the first stored row the request contributes to;
- within a token budget too (MEMFILTER_CONTEXT_TOKENS), counted by `memfilter.core.tokens`:
  what the request must have is always in (its system messages, what it contributes, and the
  turn it continues, from that turn's user row); then, newest first, each older row while the
  whole still fits, stopping at the first that does not (Mastra's `contiguous` trim); then the
  window moves forward to its first user row, so that it never starts inside a turn (an answer
  without its question, a tool result without its call: they share one stored row). A request
  whose must-haves alone exceed the budget is refused (`OverBudget`), naming both numbers.
  When not even the newest whole turn of the stored history fits beside them, the window says
  so (`Window.left_out`), and the model gets the must-haves alone; or, with the budget's
  `no_history` at `refuse` (MEMFILTER_CONTEXT_NO_HISTORY, as Mastra's limiter throws), the
  request is refused (`OverBudget`) naming the turn's tokens.

It promises: with a budget, the context's total (`Window.tokens`) is at most the budget, and
the window starts on a user row; `reasons` says of every stored row whether it is in, and if
not, why. Pure: rows come as the stored bytes, with the counts stored beside them where the
store has them; a row without one is counted from its bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from memfilter.core.tokens import ESTIMATE, Counter


class Budget(msgspec.Struct, frozen=True):
    """MEMFILTER_CONTEXT_TOKENS, counted by MEMFILTER_TOKEN_COUNTER; and what to do when no
    stored history fits (MEMFILTER_CONTEXT_NO_HISTORY): `send` the must-haves alone, or `refuse`."""

    tokens: int
    counter: Counter = ESTIMATE
    no_history: Literal["send", "refuse"] = "send"


class OverBudget(Exception):
    """What a request must have in its context exceeds the budget; or, with `no_history` at
    `refuse`, nothing of its stored history fits beside it. The message names the numbers."""


class Window(msgspec.Struct):
    """The window chosen: the context after the system messages, and how it was cut."""

    messages: list[Any]  # dicts, or a stored row's JSON (msgspec.Raw) where it goes on unchanged
    tail: list[str]  # the conversation's last rows read, oldest first
    cap: int  # the first of `tail` within MEMFILTER_HISTORY_MESSAGES (and the request's reach)
    fits: int = 0  # the first the budget leaves in, newest first (with a budget)
    start: int = 0  # the first in: a user row from `fits` on (without a budget, `cap`)
    tokens: float | None = None  # the context's total, with a budget (to one decimal)
    counts: dict[str, float] = {}  # what was counted, by message id (with a budget)
    left_out: bool = False  # with a budget: the stored history offered (within the rows) did not fit, not even its newest whole turn


class _Role(msgspec.Struct):
    role: str = ""


_ROLE = msgspec.json.Decoder(_Role)


def choose(
    contributed: list[tuple[str, Any]],
    tail: list[str],
    rows: Mapping[str, bytes],
    history: int,
    budget: Budget | None = None,
    system: Sequence[Any] = (),
    stored_counts: Mapping[str, float] = {},
) -> Window:
    """The window over `tail` (the conversation's last rows, without those the request
    supersedes) for a request that contributes `contributed` ((id, message as the model sees
    it), in order) and has the `system` messages; raise `OverBudget` when its must-haves
    do not fit `budget`."""
    placed = dict(contributed)
    if history <= 0:  # no window: what the request contributes, alone
        tail = []
    first = next((i for i, mid in enumerate(tail) if mid in placed), len(tail))
    cap = min(max(0, len(tail) - history), first)
    if budget is None:
        held = set(tail[cap:])
        return Window(_messages(tail[cap:], placed, rows) + [m for mid, m in contributed if mid not in held], tail, cap, cap, cap)

    def role(mid: str) -> str:
        m = placed.get(mid)
        return m.get("role", "") if isinstance(m, dict) else _ROLE.decode(rows[mid]).role

    must = first  # the turn the request continues, from its user row
    while must >= 0 and must < len(tail) and role(tail[must]) != "user":
        must -= 1
    must = first if must < 0 else must
    counter = budget.counter
    counts: dict[str, float] = {}  # each row weighed, once

    def weigh(mid: str) -> float:
        m = placed.get(mid)
        if type(m) is dict:
            c = counts[mid] = counter.message(m)
        else:
            known = stored_counts.get(mid)
            c = counts[mid] = known if known is not None else counter.row(rows[mid])
        return c

    held = set(tail[must:])
    rest = [mid for mid, _ in contributed if mid not in held]
    system_tokens = 0.0
    for m in system:
        system_tokens += counter.system(m if type(m) is dict else msgspec.json.decode(m))
    remaining = budget.tokens - system_tokens - counter.conversation
    current, over = 0.0, False
    for mid in [*reversed(rest), *reversed(tail[must:])]:  # newest first, as Mastra counts
        c = weigh(mid)
        over = over or current + c > remaining
        current += c
    if over:
        raise OverBudget(
            f"the request's system messages and what it contributes come to {counter.conversation + system_tokens + current:.1f} tokens; "
            f"the context budget is {budget.tokens} (MEMFILTER_CONTEXT_TOKENS): send less, or raise the budget"
        )
    needed = current  # the must-haves'
    fits = must
    while fits > cap:
        c = weigh(tail[fits - 1])
        if current + c > remaining:
            break
        current += c
        fits -= 1
    start = fits
    while start < must and role(tail[start]) != "user":
        start += 1
    left_out = start == must and cap < must  # history was offered, and not one whole turn of it fits
    if left_out and budget.no_history == "refuse":
        turn = must - 1  # the newest whole turn before the must-haves: from its user row
        while turn > cap and role(tail[turn]) != "user":
            turn -= 1
        needs = sum(weigh(mid) for mid in tail[turn:must])
        raise OverBudget(
            f"not even the newest whole turn of the stored history fits: it is {needs:.1f} tokens, and {remaining - needed:.1f} are left of the "
            f"context budget of {budget.tokens} (MEMFILTER_CONTEXT_TOKENS) beside the request; raise the budget, "
            "or hand the model the request alone (MEMFILTER_CONTEXT_NO_HISTORY=send)"
        )
    # The total to one decimal: the estimate's counts are tenths (3.8 a message), and a float sum
    # in another order than the one the fit was decided in can be a hair off.
    tokens = round(counter.conversation + system_tokens + sum([counts[mid] for mid in tail[start:]]) + sum([counts[mid] for mid in rest]), 1)
    return Window(_messages(tail[start:], placed, rows) + [placed[mid] for mid in rest], tail, cap, fits, start, tokens, counts, left_out)


def _messages(ids: list[str], placed: dict[str, Any], rows: Mapping[str, bytes]) -> list[Any]:
    return [placed[mid] if mid in placed else msgspec.Raw(rows[mid]) for mid in ids]


Why = Literal["in", "superseded", "rows", "budget", "turn"]


class WindowRow(msgspec.Struct):
    """A stored row as the window saw it: its tokens, and whether it is in the context or why not."""

    id: str
    tokens: float
    why: Why


def report(window: Window, order: Sequence[str], superseded: Sequence[str], rows: Mapping[str, bytes], budget: Budget) -> list[WindowRow]:
    """`reasons`, with each row's tokens (as weighed, else counted now from its bytes)."""
    counted = window.counts
    return [
        WindowRow(mid, round(counted[mid] if mid in counted else budget.counter.row(rows[mid]), 1), why)
        for mid, why in reasons(window, order, superseded)
        if mid in counted or mid in rows
    ]


def reasons(window: Window, order: Sequence[str], superseded: Sequence[str]) -> list[tuple[str, Why]]:
    """Why each stored row (`order`: the thread's rows, superseded ones too) is in the context or
    not: `in`, `superseded` (a regenerate or an edit took it out), `rows` (before the last
    MEMFILTER_HISTORY_MESSAGES), `budget` (older than the last row that fit), `turn` (it fit, but
    the window starts at a user row)."""
    at = {mid: i for i, mid in enumerate(window.tail)}
    gone = set(superseded)
    out: list[tuple[str, Why]] = []
    for mid in order:
        i = at.get(mid)
        why: Why
        if mid in gone:
            why = "superseded"
        elif i is None or i < window.cap:
            why = "rows"
        elif i < window.fits:
            why = "budget"
        elif i < window.start:
            why = "turn"
        else:
            why = "in"
        out.append((mid, why))
    return out

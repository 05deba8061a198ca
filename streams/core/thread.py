"""A thread as a batch's decisions see it, and what a committed write does to it: pure values.

The processor (`memfilter.runtime.processor`) reads each thread of a batch into a
`ThreadState` (`memfilter.store.history`, `read`), decides the thread's requests in order,
and for each decision that writes keeps the state `after_commit` returns: the thread as the
history store's COMMIT script (`store/scripts/commit.lua`) leaves it, so that the thread's
next request of the batch is decided on what the earlier ones saved. What a write does to a
thread is written here and in the script, nowhere else, and a property test
(`tests/redis/test_thread_state.py`) runs the same random writes through both on a real Redis
and holds them equal after every step.

It promises: `after_commit` changes nothing it is given (it returns a new state); the state
it returns is the one Redis holds once COMMIT answered `ok`, in every field the read fills
(but `head`, which it only ever forgets),
provided the state's `rows` hold every id the write takes out of the conversation (the
processor reads them so: `window_reach`). No I/O.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType

from memfilter.core.filter import Rejection


class Recorded(msgspec.Struct, omit_defaults=True):
    """What was emitted for a processed request, to emit again byte for byte on re-delivery
    (kept in the thread's `pending` until its batch's Kafka transaction commits)."""

    filtered: msgspec.Raw | UnsetType = UNSET  # the FilteredInput value, as sent
    persist: msgspec.Raw | UnsetType = UNSET  # the PersistMessages value, as sent
    error: Rejection | UnsetType = UNSET
    woken: int = -1  # decided on a wake (a request that waited for its turn): the wake's offset
    seen: dict[str, str] = {}  # a refusal's headers of what it saw (the processor's `seen`), to send the same again


class ThreadState(msgspec.Struct):
    """One thread as a batch saw it: meta, and the rows and records its requests name. Made by
    the store's read (and completed by it: `elsewhere`, `pending`, the tail's rows); from then
    on nothing changes it in place: `after_commit` returns the next one."""

    owner: str | None
    version: int  # writes so far
    newest_ms: int | None  # the newest `createdAt` saved, epoch ms
    size: int  # rows stored
    rows: dict[str, bytes]  # stored rows of the ids asked for
    elsewhere: dict[str, str]  # asked-for id not stored here -> the `thread_tag` (hex) of the other thread that owns it
    pending: dict[bytes, Recorded] = {}  # `window_key` -> record, of requests whose outputs may not be committed yet
    window: bytes = b""  # the retry window (`recent`: `WINDOW_ENTRY`s, oldest first)
    superseded: frozenset[str] = frozenset()  # ids of its rows out of the conversation
    tail: list[str] = []  # the ids of the thread's last rows, in order
    counts: dict[str, float] = {}  # token counts stored beside the rows read (with a budget)
    erased: bool = False  # the thread was erased (`memfilter forget`) and not started again since
    replying: str | None = None  # the request whose reply is being made: decided, asked for an answer, its reply not saved yet
    replying_ms: int = 0  # that request's record time, epoch ms
    waiting: int = 0  # requests that wait for their turn (`Write.wait`), oldest first in the thread's `waiting` list
    # The (partition, offset) of the first of them, where a batch asked for it (a wake of the
    # thread: `HistoryStore.read`'s `heads`); None when not asked for, or not known since a
    # decision on a wake took the first out (a second wake in the batch then decides nothing).
    head: tuple[int, int] | None = None
    unavailable: str = ""  # why the thread, cold (in PostgreSQL only), could not be loaded back: its requests are refused with it


class Write(msgspec.Struct, frozen=True, gc=False):
    """One request's effect on its thread: what COMMIT is given (the store encodes it)."""

    thread: str
    version: int  # the version the decision saw
    after: bytes  # the `window_key` of the request of this thread committed just before in the same batch, or empty
    owner: str  # the request's resource
    newest_ms: int  # the newest `createdAt` of its rows, epoch ms; -1 if none has one
    rows: list[tuple[str, bytes]]  # (message id, the row as stored) to save
    recorded: Recorded  # what it emits, kept until its batch's Kafka transaction commits
    new_ids: list[str]  # ids of the rows not stored in the thread before: to claim first
    entry: bytes  # the request's `WINDOW_ENTRY` (its `window_key` first)
    superseded: list[str]  # ids it takes out of the conversation
    request_id: str
    counts: list[float] = []  # each row's token count, in order (with a budget)
    replying_ms: int = -1  # the request's record time if it asks for an answer (the thread is `replying` to it), else -1
    # A request that waits for its turn (MEMFILTER_CONCURRENT_TURNS enqueue, interrupt): itself,
    # to keep at the end of the thread's `waiting` list (`Waiting`, encoded). Nothing else is
    # written but its window entry: it has emitted nothing yet.
    wait: bytes = b""
    woken: bool = False  # the thread's first waiting request, decided now: it leaves the `waiting` list (no new window entry)


def after_commit(state: ThreadState, write: Write, window_bytes: int) -> ThreadState:
    """The thread once `write` is committed (COMMIT answered `ok`); `window_bytes`, the retry
    window's size in bytes (the store's `window_bytes`)."""
    window = state.window if write.woken else (state.window + write.entry)[-window_bytes:]
    if write.wait:
        return msgspec.structs.replace(state, window=window, waiting=state.waiting + 1)
    pending = {**state.pending, write.entry[:8]: write.recorded}
    replying, replying_ms = (write.request_id, write.replying_ms) if write.replying_ms >= 0 else (state.replying, state.replying_ms)
    waiting, head = (state.waiting - 1, None) if write.woken else (state.waiting, state.head)
    if not write.rows and not write.superseded:  # a decision that saves nothing: its record alone
        return msgspec.structs.replace(state, window=window, pending=pending, replying=replying, replying_ms=replying_ms, waiting=waiting, head=head)
    new_ids = list(dict.fromkeys(mid for mid, _ in write.rows if mid not in state.rows))
    rows = {**state.rows, **dict(write.rows)}
    # those still in the conversation (a stored row is in the order or superseded): COMMIT's LREM finds them
    gone = {mid for mid in write.superseded if mid in rows and mid not in state.superseded}
    tail = [mid for mid in [*state.tail, *new_ids] if mid not in gone]
    newest = state.newest_ms if write.newest_ms <= (state.newest_ms if state.newest_ms is not None else -1) else write.newest_ms
    return msgspec.structs.replace(
        state,
        owner=state.owner if state.owner is not None else write.owner,
        version=state.version + 1,
        newest_ms=newest,
        size=state.size + len(new_ids),
        rows=rows,
        window=window,
        pending=pending,
        superseded=state.superseded | gone if gone else state.superseded,
        tail=tail,
        counts={**state.counts, **{mid: c for (mid, _), c in zip(write.rows, write.counts)}} if write.counts else state.counts,
        erased=False,
        replying=replying,
        replying_ms=replying_ms,
        waiting=waiting,
        head=head,
    )

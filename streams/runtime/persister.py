"""The persister: `persist-messages` written by other services, applied to the history store.

Services that save messages of a thread (the agent runner saving its replies) publish them
on `persist-messages`, and so does the processor. This applies each event's rows, byte for byte, to its
thread: new rows are appended in order, a changed row replaces the stored one, an unchanged
row does nothing, and another service's event applied before (the same resource and
`requestId`) changes nothing: re-delivered or repeated, an event is applied once (the
processor's own are skipped live, already saved, and applied once by a rebuild). A
row that would move a stored tool invocation back (a late copy of a pending call, after the
client's result) is not saved, as the filter's base layer keeps the stored row against an
echo (`APPLY` in `memfilter.store`). The ids an event lists in `superseded` (a regenerate or
an edit: the processor's own, or another service's) leave the thread's conversation and stay
stored; a later save of one updates its row and leaves it out.

What a writer of `persist-messages` may do (docs/security.md): save rows in a
thread that already has an owner, naming that owner as the event's resource. So an event goes
to the dead-letter topic whole, before it writes or claims anything, when:
- it does not decode, or is not keyed by its thread id (as a request: `memfilter.core.filter`);
- its thread has no owner yet (`ownership`): only the processor's first save sets the owner,
  so no writer can take a thread before its resource's first request;
- its thread belongs to another resource (`ownership`);
- it names a message id that another thread owns (`foreign-message-id`);
- it would change the role of a stored row (`role`);
- it claims to be the processor's or the operator's (header `memfilter.origin`) but its
  signature does not verify (`origin`, see `memfilter.core.origin`), or carries an `erasure`
  without the operator's signature. The processor's own, verified, events may set the owner of
  a thread that has none: a rebuild applies them as the live writes happened;
- its thread was erased (`erased`): only the processor's own events write there again.

The operator's events (`memfilter history import`, `memfilter forget`; signed) are applied live
like other services': an import sets the owner of a thread that has none and writes only where
it agrees with the stored thread (`clash`: APPLY); an erasure (`erasure`, no messages) removes
the thread for good at the version it was asked at (`HistoryStore.erase`; `stale` if the
thread moved since: `memfilter forget` asks again). An erasure is applied on its own, between
the events before it and after it.

With working memory (MEMFILTER_WORKING_MEMORY), an event's `workingMemory` update is applied
with its rows, once its thread has taken the event (not refused: under the thread's owner, so no
resource writes another's document), to its resource's (or thread's) document
(`memfilter.store.memory`); an erasure takes the thread's updates out of it.
"""

from __future__ import annotations

import msgspec

from memfilter.core import origin
from memfilter.core.filter import Rejected, Rejection, check_key, decode_json, parse_ms
from memfilter.core.working_memory import MAX_CALL_BYTES, call_bytes
from memfilter.runtime.records import Out, Record, dead_letter, internal_error
from memfilter.schemas.wire import Message, MessagesOf, PersistMessagesOf
from memfilter.store.history import HistoryStore, Save
from memfilter.store.layout import save_identity, thread_tag
from memfilter.store.memory import Update, WorkingMemories

# The value is decoded twice, as the filter does a request: typed to validate and read it,
# raw to save each row byte for byte, as the processor saves its own.
_TYPED = msgspec.json.Decoder(PersistMessagesOf[Message])
_RAW = msgspec.json.Decoder(MessagesOf[msgspec.Raw])  # after _TYPED: the rows as they came


def _rows(event: PersistMessagesOf[Message], raw: MessagesOf[msgspec.Raw]) -> list[tuple[str, bytes]]:
    """The event's rows as (id, JSON); raise Rejected naming what is wrong."""
    rows = []
    seen = set()
    for i, (m, row) in enumerate(zip(event.messages, raw.messages)):
        if m.id is msgspec.UNSET:
            raise Rejected("schema", f"messages[{i}] has no id; saved rows need one")
        if m.id in seen:
            raise Rejected("schema", f"message id {m.id} appears twice in the event; each row needs its own id")
        seen.add(m.id)
        for field, got, want in (("threadId", m.threadId, event.threadId), ("resourceId", m.resourceId, event.resourceId)):
            if got is not msgspec.UNSET and got != want:
                raise Rejected("thread-mismatch", f"messages[{i}] has {field} {got!r}, the event is for {want!r}")
        rows.append((m.id, bytes(row)))
    return rows


class _Event(msgspec.Struct, gc=False):
    event: PersistMessagesOf[Message]
    rows: list[tuple[str, bytes]]
    writer: str  # "processor" or "import" (signed: `memfilter.core.origin`), or "service"
    timestamp_ms: int  # its record time: where a working memory update goes among others (`memfilter.store.memory`)


class Persister:
    def __init__(self, store: HistoryStore, dlq_topic: str, secret: bytes = b"", memories: WorkingMemories | None = None):
        self.store = store
        self.dlq_topic = dlq_topic
        self.secret = secret  # MEMFILTER_SECRET, which verifies the processor's own events
        # MEMFILTER_WORKING_MEMORY: where an event's update of working memory goes (None: off, and
        # an update stays on the log alone, for a rebuild with it on)
        self.memories = memories

    async def process(self, records: list[Record]) -> list[Out]:
        """Apply the records in order (`apply`); return the dead letters."""
        return [dead_letter(record, self.dlq_topic, result) for record, result in zip(records, await self.apply(records)) if isinstance(result, Rejection)]

    async def apply(self, records: list[Record], due: set[str] | None = None) -> list[Rejection | int]:
        """Apply the records in order; for each, why it was refused, or its thread's version
        after it; into `due`, the threads whose waiting requests' turn has come
        (`HistoryStore.apply`). A batch takes three round trips, whatever its size, and ends as the events
        would leave it one by one:

        1. the owners, as stored, of the batch's threads and message ids; each event is checked
           against them as the events before it in the batch leave them, so that an event to
           be refused is refused before it claims anything (a claim cannot be taken back
           safely: the thread may be saving the same id meanwhile);
        2. the accepted events' id claims;
        3. their rows (a script per event, in order), which check the thread's owner again.

        Only a writer racing between 1 and 3 can make 2 or 3 refuse an event that 1 let
        through: its claims that did succeed then stay with its thread. Another service's
        event applied before (its `save_identity` is in the thread's `saved`) changes nothing."""
        results: list[Rejection | int | None] = [None] * len(records)
        events: list[tuple[int, _Event]] = []
        for i, record in enumerate(records):
            try:
                events.append((i, self._decode(record)))
            except Rejected as e:
                results[i] = Rejection(e.type, e.message)
            except Exception as e:
                results[i] = internal_error(record, e)
        saves: list[tuple[int, _Event]] = []
        for i, ev in events:  # an erasure on its own, after the saves before it
            if ev.event.erasure is msgspec.UNSET:
                saves.append((i, ev))
                continue
            await self._save(saves, results, due)
            saves = []
            results[i] = await self._erase(ev)
        await self._save(saves, results, due)
        return results

    async def _save(self, events: list[tuple[int, _Event]], results: list[Rejection | int | None], due: set[str] | None) -> None:
        """`apply`'s three round trips, for events without an erasure."""
        if not events:
            return
        ids = list(dict.fromkeys(mid for _, ev in events for mid, _ in ev.rows))
        holders, owners, erased = await self.store.owners(ids, list(dict.fromkeys(ev.event.threadId for _, ev in events)))
        checked = []
        for i, ev in events:
            tag = thread_tag(ev.event.threadId)
            results[i] = _refusal(ev, owners, {mid for mid, _ in ev.rows if holders.get(mid, tag) != tag}, erased)
            if results[i] is None:
                checked.append((i, ev))
                if ev.rows:  # what this event leaves for the ones after it
                    owners.setdefault(ev.event.threadId, ev.event.resourceId)
                    holders.update((mid, tag) for mid, _ in ev.rows)
        held = iter(await self.store.claim([(mid, ev.event.threadId) for _, ev in checked for mid, _ in ev.rows]))
        saves = []
        for i, ev in checked:
            taken = {mid for mid, _ in ev.rows if next(held)}
            results[i] = _refusal(ev, {ev.event.threadId: ev.event.resourceId}, taken)
            if results[i] is None:
                saves.append((i, ev))
        applied = await self.store.apply(
            [
                Save(
                    ev.event.threadId,
                    ev.event.resourceId,
                    max((parse_ms(m.createdAt) or -1 for m in ev.event.messages), default=-1),
                    ev.rows,
                    [m.role for m in ev.event.messages],
                    b"" if ev.writer == "processor" else save_identity(ev.event.resourceId, ev.event.requestId),
                    ev.writer,
                    ev.event.superseded,
                    ev.event.requestId,
                )
                for _, ev in saves
            ],
            due=due,
        )
        for (i, ev), result in zip(saves, applied):
            results[i] = _refused(ev, *result) if isinstance(result, tuple) else result
        if self.memories is not None:  # with the saves: only an update whose thread took its event
            updates = [(ev, ev.event.workingMemory) for (_, ev), result in zip(saves, applied) if isinstance(result, int)]
            await self.memories.apply(
                [Update(ev.event.threadId, ev.event.resourceId, ev.event.requestId, ev.timestamp_ms, wm.calls) for ev, wm in updates if wm is not msgspec.UNSET]
            )

    async def _erase(self, ev: _Event) -> Rejection | int:
        """Apply an operator's erasure (`HistoryStore.erase`): the thread's version after it, or why not."""
        e = ev.event
        _, owners, _ = await self.store.owners([], [e.threadId])
        if (owner := owners.get(e.threadId)) is not None and owner != e.resourceId:
            return _refused(ev, "ownership", owner)
        erased_ms = parse_ms(e.erasure.at) if e.erasure is not msgspec.UNSET else None
        result = await self.store.erase(e.threadId, e.historyVersion, save_identity(e.resourceId, e.requestId), erased_ms or 0)
        if isinstance(result, tuple) and result[0] == "unavailable":
            return _refused(ev, *result)
        if isinstance(result, int) and self.memories is not None:
            await self.memories.erase(e.threadId, e.resourceId)
        if isinstance(result, tuple):
            return Rejection(
                "stale",
                f"thread {e.threadId} is at history version {result[1]}, its erasure {e.requestId} was asked at {e.historyVersion}: "
                "it moved since memfilter forget read it; not erased by this event (memfilter forget asks again)",
            )
        return result

    def _decode(self, record: Record) -> _Event:
        """The record's event and rows; raise Rejected naming what is wrong."""
        event = decode_json(_TYPED, record.value, "persist-messages value", "PersistMessages")
        check_key(event.threadId, record.key)
        writer = "service"
        if origin.is_processors(record.value, record.headers, self.secret):
            writer = "processor"
        elif origin.is_operators(record.value, record.headers, self.secret):
            writer = "import"
        elif origin.claims_origin(record.headers):
            raise Rejected(
                "origin",
                "the event claims a memfilter.origin but its signature does not verify; only the processor and the operator's commands set that header",
            )
        if event.erasure is not msgspec.UNSET:
            if writer != "import":
                raise Rejected("origin", f"an erasure of thread {event.threadId} not signed by the operator; only memfilter forget erases")
            if event.messages or event.superseded or event.historyVersion is msgspec.UNSET:
                raise Rejected("schema", "an erasure has no messages and no superseded ids, and names the historyVersion it erases")
        if event.workingMemory is not msgspec.UNSET:
            if writer == "processor":
                raise Rejected(
                    "schema", "the processor's own events never update working memory; only another service's (the agent runner's) or an import does"
                )
            if big := [i for i, call in enumerate(event.workingMemory.calls) if call_bytes(call) > MAX_CALL_BYTES]:
                raise Rejected(
                    "too-large",
                    f"workingMemory.calls[{big[0]}] is over {MAX_CALL_BYTES:,} bytes; a working memory every request of the resource carries keeps to that",
                )
        return _Event(event, _rows(event, _RAW.decode(record.value)), writer, record.timestamp_ms)


def _refusal(e: _Event, owners: dict[str, str], elsewhere: set[str], erased: set[str] | frozenset[str] = frozenset()) -> Rejection | None:
    """Why the event may not be saved, given the threads' owning resources, which of its ids
    other threads own, and which threads are erased."""
    thread = e.event.threadId
    if thread in erased and e.writer != "processor":
        return _refused(e, "erased", "")
    owner = owners.get(thread)
    if owner is not None and owner != e.event.resourceId:
        return _refused(e, "ownership", owner)
    if owner is None and e.writer == "service":
        return _refused(e, "unowned", "")
    for mid, _ in e.rows:
        if mid in elsewhere:
            return Rejection("foreign-message-id", f"message id {mid} belongs to another thread; not saved in {thread}")
    return None


def _refused(e: _Event, why: str, detail: str) -> Rejection:
    """The rejection for a refusal as APPLY names it: ownership (detail: the owner), unowned,
    role (detail: the row's id); or as the history store does: unavailable (detail: why the
    thread, out of Redis, could not be loaded back)."""
    thread, resource = e.event.threadId, e.event.resourceId
    if why == "ownership":
        return Rejection("ownership", f"thread {thread} belongs to resource {detail}; rows from {resource} not saved")
    if why == "unowned":
        return Rejection(
            "ownership",
            f"thread {thread} has no owner yet; rows from {resource} not saved (only the processor's first save of a request sets the owner: publish the thread's first request on chat-requests)",
        )
    if why == "erased":
        return Rejection("erased", f"thread {thread} was erased (memfilter forget); rows from {resource} not saved: it stays erased")
    if why == "unavailable":
        return Rejection(
            "unavailable", f"thread {thread}: {detail}; event {e.event.requestId} not applied: publish it again (applying it twice changes nothing)"
        )
    if why == "clash":
        return Rejection(
            "clash",
            f"imported message {detail} disagrees with thread {thread} as stored (another row under its id, or another order); the thread is not imported",
        )
    return Rejection("role", f"message {detail} is stored in thread {thread} with another role; an event cannot change a stored message's role")

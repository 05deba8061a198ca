"""The persister: `persist-messages` written by other services, applied to the history store.

Services that save messages of a thread (the agent runner saving its replies) publish them
on `persist-messages`, and so does the processor. This applies each event's rows, byte for byte, to its
thread: new rows are appended in order, a changed row replaces the stored one, an unchanged
row does nothing, so the processor's own events (and any event applied twice) change nothing.
It never moves or changes a message of another thread: an event naming an id that another
thread owns, or a thread owned by another resource, goes to the dead-letter topic whole.
"""

from __future__ import annotations

import msgspec

from schemas.wire import Message, PersistMessagesOf
from streams.filter import Rejection, parse_ms
from streams.history import HistoryStore
from streams.processor import Out, Record, dead_letter

# The value is decoded twice, as the filter does a request: typed to validate and read it,
# raw to save each row byte for byte, as the processor saves its own.
_TYPED = msgspec.json.Decoder(PersistMessagesOf[Message])
_RAW = msgspec.json.Decoder(PersistMessagesOf[msgspec.Raw])


def _rows(event: PersistMessagesOf[Message], raw: PersistMessagesOf[msgspec.Raw]) -> list[tuple[str, bytes]]:
    """The event's rows as (id, JSON); raise ValueError naming what is wrong."""
    rows = []
    for i, (m, row) in enumerate(zip(event.messages, raw.messages)):
        if m.id is msgspec.UNSET:
            raise ValueError(f"schema: messages[{i}] has no id; saved rows need one")
        for field, got, want in (("threadId", m.threadId, event.threadId), ("resourceId", m.resourceId, event.resourceId)):
            if got is not msgspec.UNSET and got != want:
                raise ValueError(f"thread-mismatch: messages[{i}] has {field} {got!r}, the event is for {want!r}")
        rows.append((m.id, bytes(row)))
    return rows


class Persister:
    def __init__(self, store: HistoryStore, dlq_topic: str):
        self.store = store
        self.dlq_topic = dlq_topic

    async def process(self, records: list[Record]) -> list[Out]:
        """Apply the records in order; return the dead letters. A batch takes three round
        trips, whatever its size, and ends as the events would leave it one by one:

        1. the owners, as stored, of the batch's threads and message ids; each event is checked
           against them as the events before it in the batch leave them, so that an event to
           be refused is refused before it claims anything (a claim cannot be taken back
           safely: the thread may be saving the same id meanwhile);
        2. the accepted events' id claims;
        3. their rows (a script per event, in order), which check the thread's owner again.

        Only a writer racing between 1 and 3 can make 2 or 3 refuse an event that 1 let
        through: its claims that did succeed then stay with its thread."""
        errors: list[Rejection | None] = [None] * len(records)
        events = []
        for i, record in enumerate(records):
            decoded = _decode(record)
            if isinstance(decoded, Rejection):
                errors[i] = decoded
            else:
                events.append((i, *decoded))
        ids = list(dict.fromkeys(mid for _, _, rows in events for mid, _ in rows))
        holders, owners = await self.store.owners(ids, list(dict.fromkeys(event.threadId for _, event, _ in events)))
        checked = []
        for i, event, rows in events:
            errors[i] = _refusal(event, rows, owners, holders)
            if errors[i] is None:
                checked.append((i, event, rows))
                if rows:  # what this event leaves for the ones after it
                    owners.setdefault(event.threadId, event.resourceId)
                    holders.update((mid, event.threadId) for mid, _ in rows)
        held = iter(await self.store.claim([(mid, event.threadId) for _, event, rows in checked for mid, _ in rows]))
        saves = []
        for i, event, rows in checked:
            errors[i] = _refusal(event, rows, {}, {mid: other for (mid, _), other in zip(rows, [next(held) for _ in rows]) if other})
            if errors[i] is None:
                saves.append((i, event, rows))
        refused = await self.store.apply(
            [(event.threadId, event.resourceId, max((parse_ms(m.createdAt) or -1 for m in event.messages), default=-1), rows) for _, event, rows in saves]
        )
        for (i, event, rows), owner in zip(saves, refused):
            if owner is not None:
                errors[i] = _refusal(event, rows, {event.threadId: owner}, {})
        return [dead_letter(record, self.dlq_topic, error) for record, error in zip(records, errors) if error is not None]


def _refusal(event: PersistMessagesOf[Message], rows: list[tuple[str, bytes]], owners: dict[str, str], holders: dict[str, str]) -> Rejection | None:
    """Why the event may not be saved, given the threads' owning resources and the ids' owning threads."""
    owner = owners.get(event.threadId)
    if owner is not None and owner != event.resourceId:
        return Rejection("ownership", f"thread {event.threadId} belongs to resource {owner}; rows from {event.resourceId} not saved")
    for mid, _ in rows:
        other = holders.get(mid, event.threadId)
        if other != event.threadId:
            return Rejection("foreign-message-id", f"message id {mid} belongs to thread {other}; not saved in {event.threadId}")
    return None


def _decode(record: Record) -> tuple[PersistMessagesOf[Message], list[tuple[str, bytes]]] | Rejection:
    """The event and its rows, or why it is rejected."""
    try:
        event = _TYPED.decode(record.value)
        return event, _rows(event, _RAW.decode(record.value))
    except msgspec.DecodeError as e:
        kind = "schema" if isinstance(e, msgspec.ValidationError) else "decode"
        return Rejection(kind, f"persist-messages value is not PersistMessages: {e}")
    except ValueError as e:
        kind, message = str(e).split(": ", 1)
        return Rejection(kind, message)

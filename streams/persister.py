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
        """Apply the records in order; return the dead letters. A batch takes two round trips,
        whatever its size: every event's id claims, then every accepted event's rows. That is
        the order the events would have one by one: an event's claims see the ids the events
        before it claimed, and its rows the owner the events before it set (a script per event,
        run in order); claims and rows touch different keys."""
        errors: list[Rejection | None] = [None] * len(records)
        events = []
        for i, record in enumerate(records):
            decoded = _decode(record)
            if isinstance(decoded, Rejection):
                errors[i] = decoded
            else:
                events.append((i, *decoded))
        held = iter(await self.store.claim([(mid, event.threadId) for _, event, rows in events for mid, _ in rows]))
        saves = []
        for i, event, rows in events:
            foreign = [(mid, other) for (mid, _), other in zip(rows, [next(held) for _ in rows]) if other is not None]
            if foreign:
                mid, other = foreign[0]
                errors[i] = Rejection("foreign-message-id", f"message id {mid} belongs to thread {other}; not saved in {event.threadId}")
            else:
                saves.append((i, event, rows))
        owners = await self.store.apply(
            [(event.threadId, event.resourceId, max((parse_ms(m.createdAt) or -1 for m in event.messages), default=-1), rows) for _, event, rows in saves]
        )
        for (i, event, _), owner in zip(saves, owners):
            if owner is not None:
                errors[i] = Rejection("ownership", f"thread {event.threadId} belongs to resource {owner}; rows from {event.resourceId} not saved")
        return [dead_letter(record, self.dlq_topic, error) for record, error in zip(records, errors) if error is not None]


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

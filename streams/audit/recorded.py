"""What the product's topics recorded, read once and kept on disk, for audits and rebuilds.

A replay compares each request of a range with what was recorded for it on `filtered-inputs`,
`persist-messages` and the dead-letter topic, and brings threads to the history version each
decision saw from `persist-messages`; a rebuild applies all of `persist-messages`. Those
topics grow without bound, so they are not held in memory: each is read once, in batches,
into an SQLite file (Python's own `sqlite3`) in a temporary folder that is deleted after,
indexed by what is looked up. Memory stays flat however long the topics are; the disk holds
about what the topics do.

What is kept, and how it is found:
- filtered inputs of `chat-requests` records: by the request's source position, and by
  thread (the retry window a decision saw: `window`);
- `persist-messages` events: by thread, in log order, as `ThreadLog`s; the processor's own
  (signed: `memfilter.core.origin`) also by (thread, `requestId`, `historyVersion`), which names
  one decision's save: a copy of one published again is kept once, as the live worker, which
  skips its own events, ignored it;
- dead letters of `chat-requests` records: by source position; of `persist-messages` records
  (events the live persister refused): their source positions, which `ThreadLog` leaves out;
- erasures (`memfilter forget`: the operator's signed events with `erasure`), placed by their
  `historyVersion` as the processor's events are: a thread's log begins at its last erasure
  applied live, and nothing before it is handed out again (`ThreadLog`, `erased_at`).
Records that are none of these (a record a tool wrote on a topic by hand) are passed over.
"""

from __future__ import annotations

import contextlib
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from memfilter.core import origin
from memfilter.runtime.records import Record
from memfilter.schemas.wire import FilteredInput
from memfilter.settings import Topics
from memfilter.store.layout import WINDOW_ENTRY, record_field, window_key

Progress = Callable[[int, int, str], None]  # (done, total, what)


class TopicMissing(Exception):
    """A topic to read is not on the broker."""


def parse_position(text: str | None) -> int | datetime | dict[int, int] | None:
    """`--from`/`--to`: one offset for every partition (`120`), offsets by partition
    (`0:120,3:98`), or a time (`2026-11-30T10:00:00Z`)."""
    if text is None:
        return None
    if text.isdigit():
        return int(text)
    if ":" in text and all(part.split(":")[0].isdigit() and part.split(":")[1].isdigit() for part in text.split(",")):
        return {int(p): int(o) for p, o in (part.split(":") for part in text.split(","))}
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not an offset, partition:offset list or ISO time") from None


def empty_range(start, end) -> str | None:
    """Why `--from start --to end` holds no request, when it can be told without reading: an end
    at or before the start (offsets of every partition, of the same partitions, or times)."""
    if start is None or end is None:
        return None
    if isinstance(start, int) and isinstance(end, int) and end <= start:
        return f"--to {end} is not after --from {start}"
    if isinstance(start, dict) and isinstance(end, dict):
        behind = sorted(p for p in start.keys() & end.keys() if end[p] <= start[p])
        if behind and len(behind) == len(start.keys() | end.keys()):
            return f"--to is not after --from on partitions {behind}"
    if isinstance(start, datetime) and isinstance(end, datetime) and end <= start:
        return f"--to {end.isoformat()} is not after --from {start.isoformat()}"
    return None


async def read_topic(bootstrap: str, topic: str, start=None, end=None, progress: Progress | None = None) -> AsyncIterator[list[Record]]:
    """The topic's records from `start` (default: the beginning) to `end` (exclusive; default:
    its end when called), partition by partition in offset order, a batch at a time."""
    probe = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    try:
        await probe.start()
        known = await probe.topics()
    finally:
        await probe.stop()
    if topic not in known:
        raise TopicMissing(f"topic {topic} does not exist on {bootstrap}")
    # read_committed: what the workers' transactions committed, not copies a crash left in an
    # aborted one (the end offsets are then the last stable ones)
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()  # subscribed first: start() loads the topic's partitions
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.unsubscribe()
        first = await consumer.beginning_offsets(tps)
        last = await consumer.end_offsets(tps)
        lo = await _offsets(consumer, tps, start, first, last)
        hi = await _offsets(consumer, tps, end, last, last)
        consumer.assign(tps)
        total, done = sum(max(0, hi[tp] - lo[tp]) for tp in tps), 0
        for tp in tps:
            if lo[tp] >= hi[tp]:
                continue
            consumer.seek(tp, lo[tp])
            while (position := await consumer.position(tp)) < hi[tp]:
                batch = await consumer.getmany(tp, timeout_ms=1000, max_records=5000)
                records = [Record.of(r) for r in batch.get(tp, []) if r.offset < hi[tp]]
                done += min(await consumer.position(tp), hi[tp]) - position
                if progress:
                    progress(done, total, topic)
                if records:
                    yield records
    finally:
        await consumer.stop()


async def _offsets(consumer, tps, position, default, last) -> dict[TopicPartition, int]:
    """Offsets by partition for a `parse_position` value (None: `default`), at most the end."""
    if position is None:
        return dict(default)
    if isinstance(position, int):
        return {tp: min(position, last[tp]) for tp in tps}
    if isinstance(position, dict):
        return {tp: min(position.get(tp.partition, default[tp]), last[tp]) for tp in tps}
    found = await consumer.offsets_for_times({tp: int(position.timestamp() * 1000) for tp in tps})
    return {tp: found[tp].offset if found[tp] is not None else last[tp] for tp in tps}


class _Saved(msgspec.Struct):
    requestId: str = ""
    historyVersion: int | None = None
    erasure: dict | None = None


_SCHEMA = """
-- time: the request's record time (the filtered input's own); request: its `window_key`
CREATE TABLE filtered (seq INTEGER PRIMARY KEY, partition INT, offset INT, thread TEXT, request BLOB, time INT, value BLOB);
CREATE INDEX filtered_at ON filtered (partition, offset);
CREATE INDEX filtered_window ON filtered (thread, partition, offset);
-- processors: 1 for the events placed by their version (the processor's, and erasures), 0 for
-- the others (log order); request_id: of those placed only; erasure: 1 for an erasure
CREATE TABLE persist (seq INTEGER PRIMARY KEY, thread BLOB, processors INT, version INT, request_id TEXT, partition INT, offset INT, record BLOB, erasure INT);
CREATE INDEX persist_log ON persist (thread, processors, seq);
CREATE UNIQUE INDEX persist_own ON persist (thread, request_id, version);
CREATE TABLE dead (partition INT, offset INT, headers BLOB);
CREATE INDEX dead_at ON dead (partition, offset);
-- `persist-messages` events the live persister refused (their dead letters' source positions)
CREATE TABLE refused (partition INT, offset INT, PRIMARY KEY (partition, offset));
"""

_record = msgspec.msgpack.Encoder()
_as_record = msgspec.msgpack.Decoder(Record)
_headers = msgspec.msgpack.Decoder(list[tuple[str, bytes]])


class Recorded:
    """The recorded events of one deployment's topics, in an SQLite file under `folder`."""

    def __init__(self, folder: Path, topics: Topics, secret: bytes):
        self.topics = topics
        self.secret = secret  # tells the processor's persist events (`memfilter.core.origin`)
        self.db = sqlite3.connect(folder / "recorded.sqlite3")
        self.db.executescript("PRAGMA journal_mode = OFF; PRAGMA synchronous = OFF;" + _SCHEMA)

    @classmethod
    @contextlib.contextmanager
    def temporary(cls, topics: Topics, secret: bytes) -> Iterator[Recorded]:
        with tempfile.TemporaryDirectory(prefix="memfilter-recorded-") as folder:
            recorded = cls(Path(folder), topics, secret)
            try:
                yield recorded
            finally:
                recorded.db.close()

    async def load(self, bootstrap: str, topics: Iterable[str], progress: Progress | None = None) -> None:
        """Read these of the deployment's topics, whole, into the file."""
        add = {self.topics.filtered: self.add_filtered, self.topics.persist: self.add_persisted, self.topics.dlq: self.add_dead}
        for topic in topics:
            async for records in read_topic(bootstrap, topic, progress=progress):
                add[topic](records)
        self.db.commit()

    # ---- adding --------------------------------------------------------------------------

    def add_filtered(self, records: list[Record]) -> None:
        rows = []
        for r in records:
            try:
                event = msgspec.json.decode(r.value, type=FilteredInput)
            except (msgspec.DecodeError, TypeError):
                continue  # not the processor's
            if event.source.topic == self.topics.requests:
                request = window_key(record_field(event.resourceId, event.requestId))
                rows.append((event.source.partition, event.source.offset, event.threadId, request, r.timestamp_ms, r.value))
        self.db.executemany("INSERT INTO filtered (partition, offset, thread, request, time, value) VALUES (?, ?, ?, ?, ?, ?)", rows)

    def add_persisted(self, records: list[Record]) -> None:
        rows = []
        for r in records:
            saved, erasure = _Saved(), False
            if origin.is_processors(r.value, r.headers, self.secret):
                saved = _decoded(r.value)
            elif origin.is_operators(r.value, r.headers, self.secret):
                saved = _decoded(r.value)
                erasure = saved.erasure is not None and saved.historyVersion is not None
                if not erasure:
                    saved = _Saved()  # an import: with the others, in log order
            # an event of the processor's without a version goes with the others, in log order
            placed = saved.historyVersion is not None
            rows.append((r.key, int(placed), saved.historyVersion, saved.requestId or None, r.partition, r.offset, _record.encode(r), int(erasure)))
        self.db.executemany(
            "INSERT OR IGNORE INTO persist (thread, processors, version, request_id, partition, offset, record, erasure) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )

    def add_dead(self, records: list[Record]) -> None:
        rows, refused = [], []
        for r in records:
            h = dict(r.headers)
            source = h.get("source.topic", b"").decode(errors="replace")
            with contextlib.suppress(KeyError, ValueError):
                if source == self.topics.requests:
                    rows.append((int(h["source.partition"]), int(h["source.offset"]), _record.encode(list(r.headers))))
                elif source == self.topics.persist:
                    refused.append((int(h["source.partition"]), int(h["source.offset"])))
        self.db.executemany("INSERT INTO dead (partition, offset, headers) VALUES (?, ?, ?)", rows)
        self.db.executemany("INSERT OR IGNORE INTO refused (partition, offset) VALUES (?, ?)", refused)

    # ---- looking up ----------------------------------------------------------------------

    def filtered_at(self, partition: int, offset: int) -> bytes | None:
        """The first filtered input recorded for the request at this position."""
        return self._one("SELECT value FROM filtered WHERE partition = ? AND offset = ? ORDER BY seq LIMIT 1", partition, offset)

    def window(self, thread: str, partition: int, offset: int, size: int) -> bytes:
        """The thread's retry window as the request at this position saw it: the last `size`
        requests of the thread processed before it (`WINDOW_ENTRY`s, oldest first). A thread's
        requests are processed in their partition's order."""
        found = self.db.execute(
            "SELECT request, offset, MIN(time) FROM filtered WHERE thread = ? AND partition = ? AND offset < ? GROUP BY offset ORDER BY offset DESC LIMIT ?",
            (thread, partition, offset, size),
        ).fetchall()
        return b"".join(WINDOW_ENTRY.pack(request, partition, at, time) for request, at, time in reversed(found))

    def processors_save(self, thread: str, request_id: str, version: int) -> bytes | None:
        """The processor's `persist-messages` event of the decision of this request on this
        version of the thread."""
        record = self._one("SELECT record FROM persist WHERE thread = ? AND request_id = ? AND version = ?", thread.encode(), request_id, version)
        return _as_record.decode(record).value if record is not None else None

    def dead_at(self, partition: int, offset: int) -> dict[str, bytes] | None:
        """The headers of the first dead letter recorded for the request at this position."""
        headers = self._one("SELECT headers FROM dead WHERE partition = ? AND offset = ? ORDER BY rowid LIMIT 1", partition, offset)
        return dict(_headers.decode(headers)) if headers is not None else None

    def erased_at(self, thread: bytes | None) -> int | None:
        """The history version at which the thread's last erasure applied live erased it, if
        it was erased: every decision on that version or an earlier one saw erased history."""
        return self._one(
            "SELECT version FROM persist WHERE thread IS ? AND erasure = 1 AND NOT EXISTS "
            "(SELECT 1 FROM refused WHERE refused.partition = persist.partition AND refused.offset = persist.offset) ORDER BY seq DESC LIMIT 1",
            thread,
        )

    def persisted(self) -> int:
        return self._one("SELECT count(*) FROM persist")

    def refused_live(self) -> int:
        """The `persist-messages` events the live persister refused."""
        return self._one(
            "SELECT count(*) FROM persist WHERE EXISTS (SELECT 1 FROM refused WHERE refused.partition = persist.partition AND refused.offset = persist.offset)"
        )

    def threads(self) -> list[bytes | None]:
        return [thread for (thread,) in self.db.execute("SELECT DISTINCT thread FROM persist")]

    def log(self, thread: bytes | None) -> ThreadLog:
        return ThreadLog(self.db, thread)

    def _one(self, query: str, *args):
        row = self.db.execute(query, args).fetchone()
        return row[0] if row is not None else None


def _decoded(value: bytes | None) -> _Saved:
    try:
        return msgspec.json.decode(value or b"", type=_Saved)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Saved()  # signed but not an event: the persister refuses it wherever it is


class ThreadLog:
    """One thread's `persist-messages` events, handed out in the order they were applied live:
    other services' in log order, each of the processor's where its `historyVersion` says.
    An event the live persister refused (its dead letter is on the dead-letter topic) is left
    out: it changed nothing live, but placed by log order among the processor's events it
    could be applied where it was not (a reply refused as `unowned` before the thread's first
    request was decided would be accepted after it)."""

    def __init__(self, db: sqlite3.Connection, thread: bytes | None):
        self.db = db
        self.thread = thread
        self._after = {True: -1, False: -1}  # the last seq handed out, of the processor's and of the others'
        self._head: dict[bool, tuple[int, int | None, bytes] | None] = {}  # the next of each, once looked up
        # A thread erased live begins at its last erasure: the events applied before it live
        # (the others' before it in the log; the placed ones of an earlier version) are never
        # handed out, so no rebuild or replay writes erased content again, even for a while.
        self._version_above = -1
        erasure = db.execute(
            "SELECT seq, version, record FROM persist WHERE thread IS ? AND erasure = 1 AND NOT EXISTS "
            "(SELECT 1 FROM refused WHERE refused.partition = persist.partition AND refused.offset = persist.offset) ORDER BY seq DESC LIMIT 1",
            (thread,),
        ).fetchone()
        if erasure is not None:
            self._after[False], self._version_above = erasure[0], erasure[1]
            self._head[True] = erasure  # handed out first

    def _next_of(self, processors: bool) -> tuple[int, int | None, bytes] | None:
        if processors not in self._head:
            self._head[processors] = self.db.execute(
                "SELECT seq, version, record FROM persist WHERE thread IS ? AND processors = ? AND seq > ? AND (version IS NULL OR version > ?) AND NOT EXISTS "
                "(SELECT 1 FROM refused WHERE refused.partition = persist.partition AND refused.offset = persist.offset) ORDER BY seq LIMIT 1",
                (self.thread, int(processors), self._after[processors], self._version_above),
            ).fetchone()
        return self._head[processors]

    def __bool__(self) -> bool:
        return self._next_of(True) is not None or self._next_of(False) is not None

    def next(self, version: int) -> Record:
        """The event to apply on the thread at `version`: the processor's next if it was decided
        on this version (or an earlier one: a repeat), else the next of the others. A thread's
        last erasure comes first, whatever the version (a rebuild starts the thread there)."""
        mine = self._next_of(True)
        first = mine is not None and mine[1] == self._version_above
        take = mine is not None and (first or mine[1] <= version or self._next_of(False) is None)
        seq, _, record = self._next_of(take)
        self._after[take] = seq
        del self._head[take]
        return _as_record.decode(record)

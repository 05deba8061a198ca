"""History from `persist-messages`: the disaster-recovery rebuild and the audit replay.

Every save of a thread's history is an event on `persist-messages`: the processor's own (one
per request that saved rows, signed by it: `streams/origin.py`) and other services' (the
agent runner's replies). Both apply them with the persister's own code and rules, so an event
the live persister refused is refused here too, and one applied before changes nothing. Each
event that changes something moves the thread's version by one, exactly as the live writes
did, so a version says where a write happened:

- A thread's events are applied in the order they were applied live (`ThreadLog`): other
  services' in log order, and each of the processor's where its `historyVersion` (the version
  its decision saw) says. The processor publishes a batch's events after the batch, so in the
  log they can follow saves that were applied after them live.
- A decision is replayed on the version it saw: `historyVersion` on its filtered input, or
  the `memfilter.history-version` header of a rejection's dead letter.

- `rebuild`: replaces a key prefix's history with the whole topic applied by the persister's
  own code, so rebuilding twice gives the same store. (Applying the topic again on top would
  replay old saves over newer ones before the newer come again: same rows, moved versions.)
  The record of processed requests is on no topic, so a rebuilt store decides a re-delivered
  request again rather than re-emitting it.
- `replay`: for a range of `chat-requests`, in an isolated key prefix (never the live
  history), brings each thread to the version its recorded decision saw, decides the request
  again with the processor's own code, and compares with what was recorded on
  `filtered-inputs`, `persist-messages` and the dead-letter topic. Which thread held a message
  id when is on no topic (threads on other partitions decide in their own order), so each
  decision is given the other threads' ids it saw, as recorded: none for an accepted request,
  the `memfilter.ids-elsewhere` header for a rejection.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.wire import FilteredInput, PersistMessages
from streams import origin
from streams.filter import Limits
from streams.history import HistoryStore
from streams.persister import Persister
from streams.processor import ELSEWHERE_HEADER, VERSION_HEADER, Processor, Record, Topics

Progress = Callable[[int, int], None]


class TopicMissing(Exception):
    """A topic to read is not on the broker."""


def parse_position(text: str | None) -> int | datetime | dict[int, int] | None:
    """`--from`/`--to`: an offset for every partition (`120`), offsets by partition
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


async def read_topic(bootstrap: str, topic: str, start=None, end=None) -> list[Record]:
    """The topic's records from `start` (default: the beginning) to `end` (exclusive; default:
    its end when called), partition by partition in offset order."""
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
        partitions = sorted(consumer.partitions_for_topic(topic) or ())
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.unsubscribe()
        first = await consumer.beginning_offsets(tps)
        last = await consumer.end_offsets(tps)
        lo = await _offsets(consumer, tps, start, first, last)
        hi = await _offsets(consumer, tps, end, last, last)
        consumer.assign(tps)
        records: list[Record] = []
        for tp in tps:
            if lo[tp] >= hi[tp]:
                continue
            consumer.seek(tp, lo[tp])
            while (await consumer.position(tp)) < hi[tp]:
                batch = await consumer.getmany(tp, timeout_ms=1000, max_records=5000)
                records += [Record.of(r) for r in batch.get(tp, []) if r.offset < hi[tp]]
        return records
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


class _Version(msgspec.Struct):
    historyVersion: int | None = None


class ThreadLog:
    """One thread's `persist-messages` events, handed out in the order they were applied live."""

    def __init__(self) -> None:
        self.processors: deque[tuple[int, Record]] = deque()  # (the version its decision saw, event)
        self.others: deque[Record] = deque()  # other services' events, and any without a version

    def add(self, record: Record, secret: bytes) -> None:
        version = None
        if origin.is_processors(record.value, record.headers, secret):
            version = msgspec.json.decode(record.value, type=_Version).historyVersion
        if version is None:
            self.others.append(record)
        else:
            self.processors.append((version, record))

    def __bool__(self) -> bool:
        return bool(self.processors or self.others)

    def next(self, version: int) -> Record:
        """The event to apply on a thread at `version`: the processor's next if it was decided on
        this version (or an earlier one: a repeat), else the next of the others in log order."""
        if self.processors and (self.processors[0][0] <= version or not self.others):
            return self.processors.popleft()[1]
        return self.others.popleft()


def thread_logs(events: list[Record], secret: bytes) -> dict[bytes | None, ThreadLog]:
    """The events by record key (the thread id, for every event the persister accepts)."""
    logs: dict[bytes | None, ThreadLog] = {}
    for record in events:
        logs.setdefault(record.key, ThreadLog()).add(record, secret)
    return logs


async def rebuild(bootstrap: str, topics: Topics, store: HistoryStore, secret: bytes, progress: Progress | None = None) -> tuple[int, int]:
    """Replace what is under `store`'s prefix with every `persist-messages` event applied as it
    was live; (events applied, events refused). Stop the workers using that prefix first.
    `secret` is the deployment's MEMFILTER_SECRET, which tells the processor's events.

    Threads are independent, so each round applies the next event of every thread in one
    persister batch (three round trips): as many rounds as the longest thread has events."""
    events = await read_topic(bootstrap, topics.persist)
    await _drop(store)
    persister = Persister(store, topics.dlq, secret)
    logs = thread_logs(events, secret)
    versions = dict.fromkeys(logs, 0)
    refused = done = 0
    while logs:
        round_ = [(key, log.next(versions[key])) for key, log in logs.items()]
        for (key, _), result in zip(round_, await persister.apply([event for _, event in round_])):
            if isinstance(result, int):
                versions[key] = result
            else:
                refused += 1
        logs = {key: log for key, log in logs.items() if log}
        done += len(round_)
        if progress:
            progress(done, len(events))
    return len(events) - refused, refused


@dataclass
class Difference:
    requestId: str
    threadId: str
    source: str  # topic-partition-offset of the request
    diff: list[str]


@dataclass
class Report:
    requests: int = 0
    differences: list[Difference] = field(default_factory=list)

    @property
    def different(self) -> int:
        return len(self.differences)

    @property
    def identical(self) -> int:
        return self.requests - self.different

    def to_json(self) -> bytes:
        fields = {"requests": self.requests, "identical": self.identical, "different": self.different}
        return msgspec.json.format(msgspec.json.encode({**fields, "differences": self.differences}))


async def replay(
    bootstrap: str,
    topics: Topics,
    store_of: Callable[[str], HistoryStore],
    secret: bytes,
    start=None,
    end=None,
    limits: Limits = Limits(),
    progress: Progress | None = None,
) -> Report:
    """Decide the range's requests again on rebuilt history; compare with what was recorded.
    `store_of(prefix)` gives the isolated store; its keys are deleted afterwards."""
    requests = await read_topic(bootstrap, topics.requests, start, end)
    filtered = await read_topic(bootstrap, topics.filtered)
    persisted = await read_topic(bootstrap, topics.persist)
    dead = await read_topic(bootstrap, topics.dlq)

    decoder = msgspec.json.Decoder(FilteredInput)
    recorded_filtered: dict[tuple[int, int], tuple[bytes, FilteredInput]] = {}
    recorded_by_id: dict[str, tuple[bytes, FilteredInput]] = {}
    for r in filtered:
        event = decoder.decode(r.value)
        if event.source.topic == topics.requests:
            recorded_filtered.setdefault((event.source.partition, event.source.offset), (r.value, event))
            recorded_by_id.setdefault(event.requestId, (r.value, event))
    recorded_persist: dict[str, bytes] = {}
    persist_decoder = msgspec.json.Decoder(PersistMessages)
    for r in persisted:
        if origin.is_processors(r.value, r.headers, secret):
            recorded_persist.setdefault(persist_decoder.decode(r.value).requestId, r.value)
    logs = thread_logs(persisted, secret)
    recorded_dead: dict[tuple[int, int], dict[str, bytes]] = {}
    for r in dead:
        h = dict(r.headers)
        if h.get("source.topic", b"").decode() == topics.requests:
            recorded_dead.setdefault((int(h["source.partition"]), int(h["source.offset"])), h)

    def recorded_elsewhere(record: Record) -> dict[str, str]:
        seen = recorded_dead.get((record.partition, record.offset), {}).get(ELSEWHERE_HEADER)
        return msgspec.json.decode(seen, type=dict[str, str]) if seen else {}

    store = store_of(f"replay-{uuid.uuid4().hex[:12]}")
    processor = Processor(store, topics, limits, secret=secret, recorded_elsewhere=recorded_elsewhere)
    persister = Persister(store, topics.dlq, secret)
    report = Report()
    try:
        for n, record in enumerate(requests, 1):
            report.requests += 1
            where = (record.partition, record.offset)
            thread = record.key.decode(errors="replace") if record.key is not None else ""
            source = f"{record.topic}-{record.partition}-{record.offset}"
            diff: list[str]
            if where in recorded_filtered:
                raw, event = recorded_filtered[where]
                diff = await _advance(store, persister, logs.get(record.key), event.threadId, event.historyVersion)
                if not diff:
                    diff = _compare(await processor.process([record]), topics, raw, recorded_persist.get(event.requestId))
                request_id, thread = event.requestId, event.threadId
            elif (rid := _request_id(record)) in recorded_by_id:
                # A request id decided before (published again, or re-delivered): the worker
                # sent what it recorded then, and so does a replay that decided the first copy.
                raw, event = recorded_by_id[rid]
                diff = _compare(await processor.process([record]), topics, raw, recorded_persist.get(rid))
                request_id, thread = rid, event.threadId
            elif where in recorded_dead:
                headers = recorded_dead[where]
                diff = []
                if VERSION_HEADER in headers:  # decided against stored history: on the same
                    diff = await _advance(store, persister, logs.get(record.key), thread, int(headers[VERSION_HEADER]))
                if not diff:
                    outs = await processor.process([record])
                    got = [dict(o.headers).get("error.type", b"").decode() for o in outs if o.topic == topics.dlq]
                    want = headers.get("error.type", b"").decode()
                    diff = [] if got == [want] else [f"recorded: rejected ({want}); replayed: {got[0] if got else 'accepted'}"]
                request_id = source
            else:
                diff, request_id = ["nothing recorded for this request (not processed yet?)"], source
            if diff:
                report.differences.append(Difference(request_id, thread, source, diff))
            if progress:
                progress(n, len(requests))
    finally:
        await _drop(store)
    return report


class _Id(msgspec.Struct):
    requestId: str | None = None


def _request_id(record: Record) -> str | None:
    try:
        return msgspec.json.decode(record.value, type=_Id).requestId
    except Exception:  # anything a client can publish: the processor rejected it
        return None


async def _advance(store: HistoryStore, persister: Persister, log: ThreadLog | None, thread: str, version: int) -> list[str]:
    """Apply the thread's events, in their live order, until its version is `version`."""
    current = (await store.read({thread: ([], [])}))[thread].version
    while current < version and log:
        result = (await persister.apply([log.next(current)]))[0]
        current = result if isinstance(result, int) else current
    if current != version:
        return [f"the decision saw history version {version}; persist-messages rebuilds version {current}"]
    return []


def _compare(outs, topics: Topics, filtered: bytes, persist: bytes | None) -> list[str]:
    got_filtered = next((o.value for o in outs if o.topic == topics.filtered), None)
    got_persist = next((o.value for o in outs if o.topic == topics.persist), None)
    if got_filtered is None:
        error = next((dict(o.headers).get("error.type", b"").decode() for o in outs if o.topic == topics.dlq), "?")
        return [f"recorded: a filtered input; replayed: rejected ({error})"]
    diff = _json_diff("filtered", msgspec.json.decode(filtered), msgspec.json.decode(got_filtered))
    if (persist is None) != (got_persist is None):
        diff.append(f"persist: recorded {'nothing' if persist is None else 'rows'}, replayed {'nothing' if got_persist is None else 'rows'}")
    elif persist is not None:
        diff += _json_diff("persist", msgspec.json.decode(persist), msgspec.json.decode(got_persist))
    return diff


def _json_diff(path: str, recorded, replayed, limit: int = 20) -> list[str]:
    """Readable differences: `path: recorded X, replayed Y`, deepest paths first found."""
    if recorded == replayed:
        return []
    if isinstance(recorded, dict) and isinstance(replayed, dict):
        out = []
        for k in list(dict.fromkeys([*recorded, *replayed])):
            out += _json_diff(f"{path}.{k}", recorded.get(k, "<absent>"), replayed.get(k, "<absent>"), limit)
        return out[:limit]
    if isinstance(recorded, list) and isinstance(replayed, list) and len(recorded) == len(replayed):
        out = []
        for i, (a, b) in enumerate(zip(recorded, replayed)):
            out += _json_diff(f"{path}[{i}]", a, b, limit)
        return out[:limit]
    show = lambda v: msgspec.json.encode(v).decode()[:200]  # noqa: E731
    return [f"{path}: recorded {show(recorded)}, replayed {show(replayed)}"]


async def _drop(store: HistoryStore) -> None:
    async for key in store.redis.scan_iter(match=f"{store.prefix}:*", count=1000):
        await store.redis.delete(key)

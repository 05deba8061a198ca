"""History from `persist-messages`: the disaster-recovery rebuild and the audit replay.

Every save of a thread's history is an event on `persist-messages`: the processor's own (one
per request that saved rows, signed by it: `memfilter.core.origin`) and other services' (the
agent runner's replies). Both apply them with the persister's own code and rules, so an event
the live persister refused is refused here too, and one applied before changes nothing. Each
event that changes something moves the thread's version by one, exactly as the live writes
did, so a version says where a write happened:

- A thread's events are applied in the order they were applied live (`ThreadLog`): other
  services' in log order, and each of the processor's where its `historyVersion` (the version
  its decision saw) says. The processor publishes a batch's events after the batch, so in the
  log they can follow saves that were applied after them live. Events the live persister
  refused (dead letters on the dead-letter topic) are left out, refused wherever they were.
- A decision is replayed on the version it saw: `historyVersion` on its filtered input, or
  the `memfilter.history-version` header of a rejection's dead letter.

- `rebuild`: replaces a key prefix's history with the whole topic applied by the persister's
  own code, so rebuilding twice gives the same store. (Applying the topic again on top would
  replay old saves over newer ones before the newer come again: same rows, moved versions.)
  The record of processed requests is on no topic, so a rebuilt store decides a re-delivered
  request again rather than re-emitting it.
- Erased threads (`memfilter forget`): a thread's log begins at its last erasure, so neither
  applies anything the erasure removed; a replayed request decided before that erasure is
  counted `erased`, neither decided again nor compared (its history is gone by design).
- `replay`: for a range of `chat-requests`, in an isolated key prefix (never the live
  history), brings each thread to the version its recorded decision saw, decides the request
  again with the processor's own code, and compares with what was recorded on
  `filtered-inputs`, `persist-messages` and the dead-letter topic. Which thread held a message
  id when is on no topic (threads on other partitions decide in their own order), so each
  decision is given the other threads' ids it saw, as recorded: none for an accepted request,
  the `memfilter.ids-elsewhere` header for a rejection. Nor is the retry window a request
  was checked against: it is made again from the thread's filtered inputs before the
  request, so a retry is a `duplicate` in the replay exactly when it was live.

Both read each topic once, in batches, into an index on disk (`memfilter.audit.recorded`): their
memory does not grow with the topics or the range.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field

import msgspec

from memfilter.audit.recorded import Progress, Recorded, ThreadLog, read_topic
from memfilter.core import origin
from memfilter.core.filter import Policy
from memfilter.core.filtered import BadReference, whole
from memfilter.core.window import WindowRow
from memfilter.runtime.persister import Persister
from memfilter.runtime.processor import ELSEWHERE_HEADER, MEMORY_HEADER, REPLYING_HEADER, VERSION_HEADER, WAITED_HEADER, Processor
from memfilter.runtime.records import Record
from memfilter.schemas.wire import FilteredInput, Waited
from memfilter.settings import Topics, WorkingMemory
from memfilter.store import cold, reads
from memfilter.store.history import HistoryStore
from memfilter.store.memory import WorkingMemories


@dataclass(frozen=True)
class Rebuilt:
    """What a rebuild did: `persist-messages` events applied, refused and left out as erased
    (`apply_log`), and the threads PostgreSQL refused to hold, with why (in Redis alone)."""

    applied: int
    refused: int
    erased: int
    refused_by_postgres: dict[str, str]


async def rebuild(
    bootstrap: str, topics: Topics, store: HistoryStore, secret: bytes, progress: Progress | None = None, working_memory: WorkingMemory = WorkingMemory()
) -> Rebuilt:
    """Replace what is under `store`'s prefix with every `persist-messages` event applied as it
    was live; with a PostgreSQL tier, write every thread to it too (`memfilter.store.cold.fill`:
    over older versions only, so PostgreSQL and Redis agree, but for a thread PostgreSQL refuses,
    which is reported). Stop the workers using that prefix first. `secret` is the deployment's
    MEMFILTER_SECRET, which tells the processor's events."""
    with Recorded.temporary(topics, secret) as recorded:
        await recorded.load(bootstrap, [topics.persist, topics.dlq], progress)
        await reads.drop(store)
        applied, refused, erased = await apply_log(recorded, store, progress, WorkingMemories.of(working_memory, store))
    refused_by_postgres: dict[str, str] = {}
    if store.warmer is not None:  # with a PostgreSQL tier, it holds every thread as Redis now does
        _, refused_by_postgres = await cold.fill(store, store.warmer.pg)
    return Rebuilt(applied, refused, erased, refused_by_postgres)


async def apply_log(recorded: Recorded, store: HistoryStore, progress: Progress | None = None, memories: WorkingMemories | None = None) -> tuple[int, int, int]:
    """Apply every `persist-messages` event of `recorded` to `store`, each thread's in its live
    order (`ThreadLog`); (events applied, events refused, events left out as erased: before
    their thread's last erasure). Any content of the log is taken: an event that does not
    decode, names another resource's thread or was refused live is counted refused, as the
    persister refuses it, and the rest go on.

    Threads are independent, so each round applies the next event of every thread in one
    persister batch (three round trips): as many rounds as the longest thread has events."""
    persister = Persister(store, recorded.topics.dlq, recorded.secret, memories)
    logs = {thread: log for thread in recorded.threads() if (log := recorded.log(thread))}  # a thread whose every event was refused live has none
    versions = dict.fromkeys(logs, 0)
    skipped = recorded.refused_live()  # refused live: left out (`ThreadLog`)
    total, applied, refused = recorded.persisted() - skipped, 0, 0
    while logs:
        round_ = [(key, log.next(versions[key])) for key, log in logs.items()]
        for (key, _), result in zip(round_, await persister.apply([event for _, event in round_])):
            if isinstance(result, int):
                versions[key] = result
                applied += 1
            else:
                refused += 1
        logs = {key: log for key, log in logs.items() if log}
        if progress:
            progress(applied + refused, total, "applied")
    return applied, refused + skipped, total - applied - refused


@dataclass
class Difference:
    requestId: str
    threadId: str
    source: str  # topic-partition-offset of the request
    diff: list[str]


@dataclass
class Window:
    """A request's context window as the replay decided it (with a budget, `--why`): every row
    read, its tokens, and why it is in or out (`memfilter.core.window.report`)."""

    requestId: str
    threadId: str
    source: str
    rows: list[WindowRow]


@dataclass
class Report:
    requests: int = 0
    differences: list[Difference] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)  # with `why`, each request's
    erased: int = 0  # requests decided on history since erased (`memfilter forget`): not replayed

    @property
    def different(self) -> int:
        return len(self.differences)

    @property
    def identical(self) -> int:
        return self.requests - self.different - self.erased

    def to_json(self) -> bytes:
        fields = {
            "requests": self.requests,
            "identical": self.identical,
            "different": self.different,
            "erased": self.erased,
            "differences": self.differences,
        }
        if self.windows:
            fields["windows"] = self.windows
        return msgspec.json.format(msgspec.json.encode(fields))


async def replay(
    bootstrap: str,
    topics: Topics,
    store_of: Callable[[str], HistoryStore],
    secret: bytes,
    start=None,
    end=None,
    policy: Policy = Policy(),
    progress: Progress | None = None,
    why: bool = False,
    working_memory: WorkingMemory = WorkingMemory(),
) -> Report:
    """Decide the range's requests again on rebuilt history; compare with what was recorded.
    `store_of(prefix)` gives the isolated store; its keys are deleted afterwards. `policy` is
    the deployment's (`Settings.policy`); with a budget, `why` reports each request's window."""
    with Recorded.temporary(topics, secret) as recorded:
        await recorded.load(bootstrap, [topics.filtered, topics.persist, topics.dlq], progress)
        store = store_of(f"replay-{uuid.uuid4().hex[:12]}")
        try:
            batches = read_topic(bootstrap, topics.requests, start, end, progress)
            return await replay_log(recorded, store, batches, policy, why, WorkingMemories.of(working_memory, store))
        finally:
            await reads.drop(store)


class _Seen:
    """What each decision saw beside its thread, from what was recorded (`Seen`)."""

    def __init__(self, recorded: Recorded, retry_window: int):
        self.recorded = recorded
        self.retry_window = retry_window

    def elsewhere(self, record: Record) -> dict[str, str]:
        seen = (self.recorded.dead_at(record.partition, record.offset) or {}).get(ELSEWHERE_HEADER)
        try:
            return msgspec.json.decode(seen, type=dict[str, str]) if seen else {}
        except msgspec.DecodeError:  # not the processor's: read as none, and the decision may then differ
            return {}

    def window(self, record: Record) -> bytes:
        thread = record.key.decode(errors="replace") if record.key is not None else ""
        return self.recorded.window(thread, record.partition, record.offset, self.retry_window)

    def replying(self, record: Record) -> tuple[str, int] | None:
        seen = (self.recorded.dead_at(record.partition, record.offset) or {}).get(REPLYING_HEADER)
        try:
            return msgspec.json.decode(seen, type=tuple[str, int]) if seen else None
        except msgspec.DecodeError:  # not the processor's: read as none, and the decision may then differ
            return None

    def working_memory(self, record: Record) -> str | None:
        try:
            if (raw := self.recorded.filtered_at(record.partition, record.offset)) is not None:
                return msgspec.json.decode(raw, type=_Remembered).workingMemory
            seen = (self.recorded.dead_at(record.partition, record.offset) or {}).get(MEMORY_HEADER)
            return msgspec.json.decode(seen, type=str | None) if seen else None
        except (msgspec.DecodeError, msgspec.ValidationError):  # not the processor's: read as none, and the decision may then differ
            return None

    def waited(self, record: Record) -> Waited | None:
        try:
            if (raw := self.recorded.filtered_at(record.partition, record.offset)) is not None:
                waited = msgspec.json.decode(raw, type=_Waited).waited
                return waited if waited is not msgspec.UNSET else None
            seen = (self.recorded.dead_at(record.partition, record.offset) or {}).get(WAITED_HEADER)
            return msgspec.json.decode(seen, type=Waited) if seen else None
        except msgspec.DecodeError:  # not the processor's: read as none, and the decision may then differ
            return None


class _Waited(msgspec.Struct):
    waited: Waited | msgspec.UnsetType = msgspec.UNSET


class _Remembered(msgspec.Struct):
    workingMemory: str | None = None


async def replay_log(
    recorded: Recorded,
    store: HistoryStore,
    batches: AsyncIterable[list[Record]],
    policy: Policy = Policy(),
    why: bool = False,
    memories: WorkingMemories | None = None,
) -> Report:
    """Decide each `chat-requests` record of `batches` again on `store` (empty at first), brought
    to the history each recorded decision saw, and compare with `recorded`. Any content of the
    topics is taken: what was recorded for a request but cannot be read (a record that does not
    decode, a header that is not what the processor writes) is that request's difference."""
    topics = recorded.topics
    replayer = _Replayer(
        topics,
        store,
        recorded,
        Processor(store, topics, policy, secret=recorded.secret, seen=_Seen(recorded, store.retry_window), windows=why, memories=memories),
        Persister(store, topics.dlq, recorded.secret, memories),
    )
    report = Report()
    async for batch in batches:
        # the worker's wakes of requests that waited for their turn are not requests: each
        # waiting request is replayed at its own position, decided as woken (`_Seen.waited`)
        batch = [r for r in batch if not origin.is_wake(r.key, r.value, r.headers, recorded.secret)]
        report.requests += len(batch)
        windows: dict[tuple[int, int], list[WindowRow]] = {}
        for wave in _waves(batch):
            differences, erased, decided = await replayer.wave(wave)
            windows |= decided
            report.differences += differences
            report.erased += erased
        for record in batch:
            if (rows := windows.get((record.partition, record.offset))) is not None:
                thread = record.key.decode(errors="replace") if record.key is not None else ""
                report.windows.append(Window(_request_id(record) or _source(record), thread, _source(record), rows))
    return report


def _waves(batch: list[Record]) -> list[list[Record]]:
    """The batch as waves of at most one request per thread, each thread's in their order:
    threads are independent, so a wave is replayed in the round trips of one request."""
    waves: list[list[Record]] = []
    depth: dict[bytes | None, int] = {}  # a thread's requests so far: the wave of its next
    for record in batch:
        n = depth[record.key] = depth.get(record.key, -1) + 1
        if n == len(waves):
            waves.append([])
        waves[n].append(record)
    return waves


@dataclass
class _Request:
    """One request of a wave: what was recorded for it, and what the replay found."""

    record: Record
    thread: str
    request_id: str | None
    version: int | None = None  # the history version its recorded decision saw
    filtered: bytes | None = None  # its recorded filtered input, if it was accepted
    event: FilteredInput | None = None  # the same, decoded
    rejected: str | None = None  # its recorded dead letter's error type, if it was rejected
    diff: list[str] = field(default_factory=list)


@dataclass
class _Replayer:
    topics: Topics
    store: HistoryStore
    recorded: Recorded
    processor: Processor
    persister: Persister
    logs: dict[bytes | None, ThreadLog] = field(default_factory=dict)  # of the threads met so far: where each is in its log

    async def wave(self, records: list[Record]) -> tuple[list[Difference], int, dict[tuple[int, int], list[WindowRow]]]:
        """Bring each request's thread to the version its decision saw, decide them again, and
        compare with what was recorded; the differences, how many requests were decided on
        history since erased (left out), and each decision's window (with `--why`)."""
        requests = [r for r in map(self._recorded, records) if not self._erased(r)]
        erased = len(records) - len(requests)
        targets = [(r, (self._log(r.record.key), r.thread, r.version)) for r in requests if r.version is not None]
        for (r, _), diff in zip(targets, await self._advance([target for _, target in targets])):
            r.diff = diff
        again = [r for r in requests if not r.diff]
        decided = await self.processor.decide_batch([r.record for r in again])
        for r, outs in zip(again, decided.outs):
            if r.filtered is not None and r.event is not None:
                saved = self.recorded.processors_save(r.event.threadId, r.event.requestId, r.event.historyVersion)
                r.diff = _compare(outs, self.topics, r.filtered, saved)
            else:
                got = [dict(o.headers).get("error.type", b"").decode() for o in outs if o.topic == self.topics.dlq]
                r.diff = [] if got == [r.rejected] else [f"recorded: rejected ({r.rejected}); replayed: {got[0] if got else 'accepted'}"]
        await self.store.drop_records(decided.recorded)  # no re-delivery here: not kept
        # named by its request id; by where it was published when it has none (or no JSON)
        return [Difference(r.request_id or _source(r.record), r.thread, _source(r.record), r.diff) for r in requests if r.diff], erased, decided.windows

    def _erased(self, r: _Request) -> bool:
        """Was the request decided on history an erasure has removed since?"""
        if r.version is None:  # rejected before its history was read
            return False
        at = self.recorded.erased_at(r.record.key)
        return at is not None and r.version <= at

    def _recorded(self, record: Record) -> _Request:
        thread = record.key.decode(errors="replace") if record.key is not None else ""
        if (raw := self.recorded.filtered_at(record.partition, record.offset)) is not None:
            event = msgspec.json.decode(raw, type=FilteredInput)
            return _Request(record, event.threadId, event.requestId, event.historyVersion, filtered=raw, event=event)
        if (headers := self.recorded.dead_at(record.partition, record.offset)) is not None:
            rejected = headers.get("error.type", b"").decode(errors="replace")
            if (version := headers.get(VERSION_HEADER)) is None:  # rejected before its history was read
                return _Request(record, thread, _request_id(record), rejected=rejected)
            if not version.isdigit():  # a dead letter not written by the processor
                return _Request(record, thread, _request_id(record), diff=[f"its dead letter's {VERSION_HEADER} header is not a version: {version!r}"])
            return _Request(record, thread, _request_id(record), int(version), rejected=rejected)  # decided against stored history: on the same
        return _Request(record, thread, _request_id(record), diff=["nothing recorded for this request (not processed yet?)"])

    def _log(self, key: bytes | None) -> ThreadLog:
        if key not in self.logs:
            self.logs[key] = self.recorded.log(key)
        return self.logs[key]

    async def _advance(self, targets: list[tuple[ThreadLog, str, int]]) -> list[list[str]]:
        """Apply each thread's events, in their live order, until its version is the target:
        the threads' next events in one persister batch a round, as `apply_log` does."""
        if not targets:
            return []
        states = await self.store.read({thread: [] for _, thread, _ in targets})
        current = {thread: states[thread].version for _, thread, _ in targets}
        while behind := [(log, thread) for log, thread, version in targets if current[thread] < version and log]:
            for (_, thread), result in zip(behind, await self.persister.apply([log.next(current[thread]) for log, thread in behind])):
                current[thread] = result if isinstance(result, int) else current[thread]
        return [
            [] if current[thread] == version else [f"the decision saw history version {version}; persist-messages rebuilds version {current[thread]}"]
            for _, thread, version in targets
        ]


def _source(record: Record) -> str:
    return f"{record.topic}-{record.partition}-{record.offset}"


class _Id(msgspec.Struct):
    requestId: str | None = None


def _request_id(record: Record) -> str | None:
    try:
        return msgspec.json.decode(record.value, type=_Id).requestId
    except Exception:  # anything a client can publish: the processor rejected it
        return None


def _compare(outs, topics: Topics, filtered: bytes, persist: bytes | None) -> list[str]:
    got_filtered = next((o.value for o in outs if o.topic == topics.filtered), None)
    got_persist = next((o.value for o in outs if o.topic == topics.persist), None)
    if got_filtered is None:
        error = next((dict(o.headers).get("error.type", b"").decode() for o in outs if o.topic == topics.dlq), "?")
        return [f"recorded: a filtered input; replayed: rejected ({error})"]
    try:  # the two formats are one decision written two ways
        diff = _json_diff("filtered", whole(msgspec.json.decode(filtered)), whole(msgspec.json.decode(got_filtered)))
    except BadReference as e:
        return [f"recorded: a filtered input whose {e}"]
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

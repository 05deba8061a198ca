"""The independent checker: what the product promises (docs/delivery.md), as a model, held
against what the clients were told and what the topics and Redis hold after. It imports none of
the product's code: it reads the wire as JSON and Kafka headers, as any consumer would.

The workload (`workload.py`) is full echoes: turn k of a thread publishes the thread's user
messages u0..uk, as `useChat` sends the whole conversation; a conversation's turns echo the
agent runner's replies too, each sent once the last reply is saved; a chat through the gateway
echoes the thread as stored, and regenerates and answers tool calls too. So the history a
decision saw shows in what it saved (its event on `persist-messages`, by its `requestId`): the
messages of its request not stored before it, and only those (docs: the spec's "What is
saved"); a tool's outcome, the message of its call; a regenerate, nothing, and it takes out of
the conversation every row after its last message (the spec's "Regenerate"). A model of each
thread, applied in the order the thread's outcomes are on their topics, says what that must be.

Found, each a line of `Verdict.problems`:
- `lost`: a request whose publish was acknowledged has no outcome (a filtered input or a dead
  letter naming its position); one the gateway answered has no filtered input or no saved
  reply; one it refused has no dead letter with that reason;
- `twice`: a request with two outcomes, or a message saved by two events (but a tool's outcome
  and the reply that continues its call's message);
- `order`: a thread's outcomes, on either outcome topic, not in the order of its requests on
  their topic;
- `stale`: a decision that saved a message stored before it (it saw history that a later state
  contradicts: a write lost, or read from a replica behind), or left out one that was not (but
  a row a regenerate took out, which an echo never saves again); a regenerate that took out
  other rows than followed its last message;
- `stored`: a thread's stored order in Redis not the messages its decisions saved, in order,
  and its replies each once (a conversation that waited for each reply: each after its turn);
- `postgres`: the same of its messages in PostgreSQL (the sink's copy of all history);
- `told`: a turn the gateway refused that was decided all the same;
- `dead letter`: a dead letter without its reason (`error.type`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Sent:
    """One request as its client saw it: where its publish landed (None: not acknowledged)."""

    thread: str
    turn: int
    request_id: str
    messages: list[str]  # the message ids it carried, in order
    at: tuple[int, int] | None  # (partition, offset) on the requests topic, once acknowledged
    sent_ms: int = 0  # when it was published (epoch ms)
    # A conversation's turn (its client echoes the replies, as `useChat` does): True once the
    # client saw its outcome and, for a filtered input, its reply's save, before the next turn
    waited: bool | None = None
    # A turn through the gateway: what it was told ("answered": the reply's stream finished,
    # held until the reply was stored; "no reply": the empty stream of a request that asks for
    # none, once decided; "rejected <code>": the worker's refusal; anything else,
    # an error or a timeout, says nothing of whether the request was written); None: published
    # straight onto the requests topic
    told: str | None = None
    kind: str = "submit"  # or "tool": its last message the client's outcome of a stored call; "regenerate"


REPLY = "/reply"  # the agent runner's save of a reply is the request's `requestId` and this
REQUESTS = "chat-requests"


@dataclass
class Outcome:
    """A record of `filtered-inputs` or the dead-letter topic naming a request's position."""

    at: tuple[int, int]  # the request's position
    where: tuple[int, int]  # the outcome's own (partition, offset)
    thread: str
    contributed: list[str] | None  # message ids; None: a dead letter
    reason: str = ""
    request_id: str = ""  # the request's `requestId`


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    outcomes: int = 0
    dead_letters: int = 0
    unacknowledged: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def outcome_of(topic_kind: str, partition: int, offset: int, key: bytes | None, value: bytes, headers: dict[str, str]) -> Outcome | None:
    """An outcome from a record's bytes: a filtered input (JSON: `source`, `messages`, which
    refer into `context` by `{"$ref": "#/context/<i>"}`) or a dead letter of a request (headers
    `source.*`; its value the request's bytes, unchanged)."""
    if topic_kind == "filtered":
        event = json.loads(value)
        context = event.get("context", [])
        ids = []
        for m in event["messages"]:
            if "$ref" in m:
                m = context[int(m["$ref"].rsplit("/", 1)[1])]
            ids.append(m["id"])
        src = event["source"]
        return Outcome((src["partition"], src["offset"]), (partition, offset), event["threadId"], ids, request_id=event["requestId"])
    if "source.partition" not in headers or headers.get("source.topic", REQUESTS) != REQUESTS:
        return None
    at = (int(headers["source.partition"]), int(headers["source.offset"]))
    try:
        request_id = json.loads(value).get("requestId", "")
    except (ValueError, AttributeError):  # not a JSON object: no request id to find it by
        request_id = ""
    return Outcome(
        at, (partition, offset), (key or b"").decode(errors="replace"), None, headers.get("error.type", ""), request_id if isinstance(request_id, str) else ""
    )


def firsts(events: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """A thread's saves, each request id's first alone: an event whose `requestId` the thread
    has had changes nothing (docs/delivery.md, "Once")."""
    first: dict[str, list[str]] = {}
    for request_id, ids in events:
        first.setdefault(request_id, ids)
    return list(first.items())


def check(
    sent: list[Sent],
    outcomes: list[Outcome],
    saved: dict[str, list[tuple[str, list[str]]]],
    stored: dict[str, list[str]],
    kept: dict[str, list[str]] | None = None,
    superseded: dict[str, dict[str, list[str]]] | None = None,
) -> Verdict:
    """`saved`: each thread's `persist-messages` events, as (its requestId, the message ids it
    saves), in log order; `stored`: each thread's stored order in Redis; `kept`: in PostgreSQL,
    when the run has it; `superseded`: by thread, the ids each request's event takes out of the
    conversation (a regenerate's)."""
    verdict = Verdict(outcomes=len(outcomes), dead_letters=sum(o.contributed is None for o in outcomes))
    by_at: dict[tuple[int, int], list[Outcome]] = defaultdict(list)
    by_request: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_at[o.at].append(o)
        if o.request_id:
            by_request[(o.thread, o.request_id)].append(o)
        if o.contributed is None and not o.reason:
            verdict.problems.append(f"dead letter: the outcome at {o.where} of request {o.at} has no error.type")

    def landed(s: Sent) -> tuple[int, int] | None:
        """Where a request is on the topic: its acknowledgement's position; or, a publish not
        acknowledged (or made by the gateway) that was written all the same, the position its
        outcome names."""
        found = by_request.get((s.thread, s.request_id))
        return s.at if s.at is not None else found[0].at if found else None

    threads: dict[str, list[Sent]] = defaultdict(list)
    for s in sent:
        threads[s.thread].append(s)
        if s.told is None and s.at is not None and not by_at.get(s.at):
            verdict.problems.append(f"lost: request {s.request_id} (acknowledged at {s.at}) has no outcome")
        if s.at is None if s.told is None else not (s.told in ("answered", "no reply") or s.told.startswith("rejected")):
            verdict.unacknowledged += 1
        if (at := landed(s)) is not None and len(by_at.get(at, ())) > 1:
            seen = ", ".join(
                f"{'a filtered input' if o.contributed is not None else 'a dead letter ' + o.reason} at {o.where} of {o.request_id or '?'}" for o in by_at[at]
            )
            verdict.problems.append(f"twice: request {s.request_id} at {at} has {len(by_at[at])} outcomes: {seen}")
    for thread, requests in threads.items():
        events = firsts(saved.get(thread, []))
        saves = dict(events)
        taken_out = (superseded or {}).get(thread, {})
        for s in requests:  # what the gateway told its caller, held against the topics
            outcome = by_at.get(landed(s) or (-1, -1), [None])[0]
            if s.told in ("answered", "no reply") and (outcome is None or outcome.contributed is None):
                verdict.problems.append(f"lost: request {s.request_id} was told {s.told!r} by the gateway, but has no filtered input")
            elif s.told == "answered" and s.request_id + REPLY not in saves:
                verdict.problems.append(f"lost: request {s.request_id} was answered through the gateway, but its reply is not saved")
            if s.told is not None and s.told.startswith("rejected"):
                found = by_request.get((thread, s.request_id), [])
                if not any(f"rejected {o.reason}" == s.told for o in found if o.contributed is None):
                    verdict.problems.append(f"lost: request {s.request_id} was told {s.told!r} by the gateway, but has no dead letter saying so")
                if any(o.contributed is not None for o in found):  # the caller believes its turn did nothing
                    verdict.problems.append(f"told: request {s.request_id} was told {s.told!r} by the gateway, but it was decided")
        # decided in the order the requests are on their partition (a thread's are all on one)
        decided = sorted(((by_at[at][0], s) for s in requests if (at := landed(s)) is not None and by_at.get(at)), key=lambda p: p[0].at)
        for filtered in (True, False):  # on each outcome topic, the outcomes in that order too
            mine = sorted((o for o, _ in decided if (o.contributed is not None) == filtered), key=lambda o: o.where)
            if [o.at for o in mine] != sorted(o.at for o in mine):
                turns = {o.at: s.turn for o, s in decided}
                verdict.problems.append(f"order: thread {thread}'s outcomes are for turns {[turns[o.at] for o in mine]}")
        replies = list(dict.fromkeys(m for request_id, ids in events if request_id.endswith(REPLY) for m in ids))
        # A conversation that waited for every reply promises its order whole: each turn's
        # message, then its reply. Elsewhere a reply and the thread's next requests are
        # concurrent writers: the requests' messages keep their order, each reply is stored once.
        whole = all(s.waited for s in requests)
        model: list[str] = []  # the thread's stored order, as the decisions so far make it
        gone: set[str] = set()  # the rows regenerates took out of the conversation
        for o, s in decided:
            if o.contributed is None:
                continue
            if s.kind == "regenerate" and s.messages[-1] in model:  # the spec's "Regenerate": nothing saved, what followed taken out
                expected, after = [], model[model.index(s.messages[-1]) + 1 :]
                out = taken_out.get(s.request_id, [])
                if (out != after) if whole else not set(out) <= set(after) | set(replies):
                    verdict.problems.append(f"stale: regenerate {s.request_id} took out {out}, but {after} followed its last message")
                gone.update(out)
                model = [m for m in model if m not in out]
            elif s.kind == "tool":  # the client's outcome of a stored call: that message saved again, in its place
                expected = [s.messages[-1]]
            else:
                # an echoed reply is the agent's to save; an echoed row a regenerate took out is never saved again (the spec's "Regenerate")
                expected = [m for m in s.messages if m not in model and m not in replies and m not in gone]
            if saves.get(s.request_id, []) != expected:
                verdict.problems.append(f"stale: request {s.request_id} saved {saves.get(s.request_id, [])}, but {expected} were not stored before it")
            model.extend(
                m for m in saves.get(s.request_id, []) if m not in model and (whole or m not in replies)
            )  # a tool's outcome: its call's message is a reply
            if whole:
                model.extend(m for m in saves.get(s.request_id + REPLY, []) if m not in model)
        live = sorted(m for m in replies if m not in gone)
        for where, holds in (("stored", stored), ("postgres", kept)):
            if holds is None:
                continue
            got = holds.get(thread, [])
            mine = got if whole else [m for m in got if m not in replies]
            if mine != model or sorted(m for m in got if m in replies) != live:
                what = "in Redis" if where == "stored" else "in PostgreSQL"
                verdict.problems.append(f"{where}: thread {thread} holds {got} {what}; its decisions saved {model}, its replies {live}")
        # a tool's outcome saves its call's message again, and the reply continues it (same id)
        again = {(s.request_id + end, s.messages[-1]) for s in requests if s.kind == "tool" for end in ("", REPLY)}
        seen: set[str] = set()
        for request_id, event in events:
            for m in event:
                if m in seen and (request_id, m) not in again:
                    verdict.problems.append(f"twice: message {m} of thread {thread} saved by two events")
                seen.add(m)
    return verdict

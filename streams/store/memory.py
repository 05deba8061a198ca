"""Working memory in Redis: each document as its updates on the log make it.

Why this shape: a resource's document is updated from its threads, on several partitions, by
several workers; a rebuild applies each thread's events in the thread's order, the threads
interleaved otherwise. So a document is kept as the set of its updates, each placed by its
record time, then its thread and event (`member`), and the document is their fold in that
order (`memfilter.core.working_memory.fold`): whatever order the updates are applied in, live or
in a rebuild, the same set makes the same document.

Keys (`memfilter.store.layout`, under the scope's hash tag: a thread-scoped document shares its
thread's slot): `updates` (sorted set of members by record time), `calls` (hash: member -> its
calls' arguments, a JSON list), `document` (the fold) and `folded` (how many updates it folds).
An update that comes last in the order, as nearly every one does, is folded onto the document
alone; one that comes before others (a thread whose clock is behind) folds them all again.

What it promises:
- an update applied again changes nothing (its member is added once, its first arguments kept:
  a reply made twice for one input, after a rebalance, is saved once and updates once);
- the document is written only as the fold of the updates it was folded from (`MEMORY` checks
  their number in one script), so two workers applying updates of one resource at once never
  leave a document that misses one;
- an erased thread's updates leave its resource's document, as a rebuild, which begins the
  thread at its erasure, never applies them; a thread-scoped document goes whole.
The owner checks (another resource can neither read nor write a document) are the callers':
the persister applies an update only with its thread's save, under the thread's owner, and the
processor reads the document of the resource that owns the request's thread.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from memfilter.core.working_memory import Template, fold
from memfilter.settings import WorkingMemory
from memfilter.store.history import HistoryStore
from memfilter.store.layout import hash_tag
from memfilter.store.scripts import MEMORY

Scope = Literal["resource", "thread"]


class Update(msgspec.Struct, frozen=True):
    """An update as an event of `persist-messages` carries it, applied with its thread's save."""

    thread: str
    resource: str
    request_id: str
    timestamp_ms: int
    calls: list[dict[str, Any]]  # each call's arguments, in the order the reply made them


class WorkingMemories:
    """The working memories under a store's prefix, of one scope and template."""

    def __init__(self, store: HistoryStore, template: Template, scope: Scope):
        self.store, self.template, self.scope = store, template, scope

    @classmethod
    def of(cls, settings: WorkingMemory, store: HistoryStore) -> WorkingMemories | None:
        """The store's working memories as MEMFILTER_WORKING_MEMORY says (None: off)."""
        template = settings.read()
        return None if template is None or settings.scope == "off" else cls(store, template, settings.scope)

    def base(self, thread: str, resource: str) -> str:
        """The keys' common part of the document a thread's requests read and its updates change."""
        kind, name = ("t", thread) if self.scope == "thread" else ("r", resource)
        return f"{self.store.prefix}:wm:{kind}:{hash_tag(name)}"

    async def documents(self, owned: list[tuple[str, str]]) -> list[str | None]:
        """The document of each (thread, its owner): one round trip."""
        if not owned:
            return []
        found = await self.store.transport.pipeline([("GET", f"{self.base(t, r)}:document") for t, r in owned])
        return [None if d is None else d.decode() for d in found]

    async def apply(self, updates: list[Update]) -> None:
        """Add each update to its document's set (once), and fold the documents that changed."""
        if not updates:
            return
        commands: list[tuple] = []
        for u in updates:
            base, member = self.base(u.thread, u.resource), _member(u.thread, u.request_id)
            commands += [("ZADD", f"{base}:updates", "NX", u.timestamp_ms, member), ("HSETNX", f"{base}:calls", member, msgspec.json.encode(u.calls))]
        added = await self.store.transport.pipeline(commands)
        changed: dict[str, list[bytes]] = {}
        for u, n in zip(updates, added[::2]):
            if n:
                changed.setdefault(self.base(u.thread, u.resource), []).append(_member(u.thread, u.request_id))
        for base, members in sorted(changed.items()):
            await self._fold(base, members)

    async def erase(self, thread: str, resource: str) -> None:
        """An erased thread's updates out: its document, or its resource's without them."""
        base = self.base(thread, resource)
        if self.scope == "thread":
            await self.store.transport.pipeline([("DEL", f"{base}:updates", f"{base}:calls", f"{base}:document", f"{base}:folded")])
            return
        [members] = await self.store.transport.pipeline([("ZRANGE", f"{base}:updates", 0, -1)])
        gone = [m for m in members if msgspec.json.decode(m)[0] == thread]
        if gone:
            await self.store.transport.pipeline([("ZREM", f"{base}:updates", *gone), ("HDEL", f"{base}:calls", *gone)])
            await self._fold(base, [])

    async def _fold(self, base: str, added: list[bytes]) -> None:
        """Write the document its updates make: the `added` ones folded onto it when they are
        the last in order, else all of them again; and again if more came meanwhile."""
        while True:
            count, document, folded, *ranks = await self.store.transport.pipeline(
                [("ZCARD", f"{base}:updates"), ("GET", f"{base}:document"), ("GET", f"{base}:folded")] + [("ZRANK", f"{base}:updates", m) for m in added]
            )
            last = sorted(r for r in ranks if r is not None) == list(range(count - len(added), count))
            if added and last and int(folded or 0) == count - len(added):
                calls = await self.store.transport.pipeline([("HMGET", f"{base}:calls", *added)])
                order = [calls[0][i] for i in sorted(range(len(added)), key=lambda i: ranks[i])]
                document = fold(
                    self.template, [call for c in order if c is not None for call in msgspec.json.decode(c)], None if document is None else document.decode()
                )
            else:  # every update, in order
                members, calls = await self.store.transport.pipeline([("ZRANGE", f"{base}:updates", 0, -1), ("HGETALL", f"{base}:calls")])
                count, document = len(members), fold(self.template, [call for m in members if m in calls for call in msgspec.json.decode(calls[m])])
            command = MEMORY.command(
                updates_key=f"{base}:updates",
                document_key=f"{base}:document",
                folded_key=f"{base}:folded",
                count=count,
                has_document=0 if document is None else 1,
                document=document or "",
            )
            [written] = await self.store.transport.pipeline([command])
            if written:
                return


def _member(thread: str, request_id: str) -> bytes:
    """An update's member: its thread and event, which order updates of one record time."""
    return msgspec.json.encode([thread, request_id])

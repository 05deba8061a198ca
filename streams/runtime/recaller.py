"""The agent runner's semantic recall: for each input, what the model is also given.

Why: the filtered input's context holds the last turns; what was said long before, in this
thread or (scope `resource`) another of the same user's, is found by meaning, as Mastra's
`SemanticRecall` finds it (docs/recall.md). The rules are `memfilter.core.recall`'s; this is
their shell: the question embedded (`memfilter.runtime.embeddings`), the resource's vectors
searched and the rows around the matches read (`memfilter.store.vectors`).

What it promises:
- a search names the input's resource, always: another resource's message is never recalled,
  nor one the context already holds, nor one out of its thread's conversation (erased,
  superseded); a thread Redis holds as erased is never recalled from, even while PostgreSQL's
  copy has yet to be told (the sink follows the log);
- what was recalled is said in the reply's metadata (`recall`: the matches with their scores,
  and the ids of the messages the model was given), so an audit sees why the model saw it;
- recall that cannot be made within RECALL_S (PostgreSQL or the endpoint not answering) does
  not hold the reply: the model answers the context alone, and the metadata says why.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import openai

from memfilter.core.recall import question, recall, with_recalled
from memfilter.runtime.embeddings import Embeddings
from memfilter.schemas.wire import FilteredInput
from memfilter.settings import Settings
from memfilter.store import reads
from memfilter.store.history import HistoryStore
from memfilter.store.postgres import Refused, Unavailable
from memfilter.store.redis_driver import connect
from memfilter.store.transport import UNAVAILABLE
from memfilter.store.vectors import MessageVectors

log = logging.getLogger("memfilter")

RECALL_S = 10.0  # seconds recall may take before the model answers without it


class Recaller:
    def __init__(self, settings: Settings):
        self.settings = settings.recall
        self.vectors = MessageVectors(settings.postgres.url, settings.redis.prefix, settings.postgres.timeout)
        self.store = HistoryStore(connect(settings.redis.url), settings.redis.prefix)
        self.embeddings = Embeddings(settings.recall, settings.agent.openai_api_key)

    async def recalled(self, event: FilteredInput) -> tuple[FilteredInput, dict[str, Any] | None]:
        """The input as the model is given it, and what was recalled for the reply's metadata
        (None: nothing was searched, the input has no question)."""
        text = question(event.context)
        if text is None:
            return event, None
        try:
            return await asyncio.wait_for(self._recall(event, text), RECALL_S)
        except (TimeoutError, Unavailable, Refused, openai.APIError, *UNAVAILABLE) as e:
            why = f"recall not made: {type(e).__name__}: {str(e)[:300]}" if str(e) else f"recall not made within {RECALL_S:g} s"
            log.warning("memfilter agent: request %s: %s", event.requestId, why)
            return event, {"error": why}

    async def _recall(self, event: FilteredInput, text: str) -> tuple[FilteredInput, dict[str, Any]]:
        s = self.settings
        [vector] = await self.embeddings.embed([text])
        if vector is None:
            return event, {"error": "the embeddings endpoint refused the question"}
        thread = event.threadId if s.scope == "thread" else None
        matches = await self.vectors.search(s.model, event.resourceId, vector, s.top_k, thread)
        rows = await self.vectors.around(event.resourceId, matches, s.before, s.after)
        for erased in await reads.gone(self.store, event.resourceId, list(rows)):  # Redis says so before the sink tells PostgreSQL
            del rows[erased]
        # the matches still in a conversation (a vector the embedder has yet to prune names nothing)
        found = [m for m in matches if any(row["id"] == m.message_id for row in rows.get(m.thread_id, ()))]
        held = {m["id"] for m in event.context if isinstance(m.get("id"), str)}
        chosen = recall(found, rows, held, event.threadId, s.top_k, s.before, s.after, s.threshold)
        given = [row["id"] for row in (*chosen.own, *chosen.other)]
        audit = {
            "scope": s.scope,
            "matches": [{"id": m.message_id, "threadId": m.thread_id, "score": round(m.score, 6)} for m in chosen.matches],
            "messages": given,
        }
        if not given:
            return event, audit
        return msgspec.structs.replace(event, context=with_recalled(event.context, chosen, event.threadId)), audit

"""The embeddings endpoint: texts in, vectors out, through the official `openai` package.

Why: semantic recall embeds every saved message (`memfilter embedder`) and each input's
question (the agent runner), with one model (MEMFILTER_EMBEDDINGS_MODEL) at one
OpenAI-compatible endpoint (MEMFILTER_EMBEDDINGS_BASE_URL), as Mastra's `embedder` does.

What it promises: an endpoint that does not answer (connection, timeout, 429, 5xx), or that
answers as if set up wrong (401, 403, 404: the key or the model), is asked again until it
answers, with the reason in `problem` meanwhile (`/readyz`): nothing is skipped for an outage.
A text the endpoint refuses for what it is (another 4xx: too long, say) is a data error of that
text alone: its vector is None, and the others are made.
"""

from __future__ import annotations

import asyncio
import logging

import openai

from memfilter.settings import Recall

log = logging.getLogger("memfilter")

BATCH = 128  # texts per call
MISCONFIGURED = {
    401: "MEMFILTER_EMBEDDINGS_API_KEY (or OPENAI_API_KEY)",
    403: "MEMFILTER_EMBEDDINGS_API_KEY (or OPENAI_API_KEY)",
    404: "MEMFILTER_EMBEDDINGS_MODEL or MEMFILTER_EMBEDDINGS_BASE_URL",
}


class Embeddings:
    def __init__(self, recall: Recall, api_key: str):
        self.model, self.base_url = recall.model, recall.base_url
        self.client = openai.AsyncOpenAI(api_key=recall.api_key or api_key or "none", base_url=recall.base_url, max_retries=0, timeout=60)
        self.problem: str | None = None  # why the endpoint is not answering, while it is not

    async def embed(self, texts: list[str]) -> list[list[float] | None]:
        """Each text's vector, in order; None for a text the endpoint refuses."""
        out: list[list[float] | None] = []
        for at in range(0, len(texts), BATCH):
            out += await self._batch(texts[at : at + BATCH])
        return out

    async def _batch(self, texts: list[str]) -> list[list[float] | None]:
        try:
            return list(await self._call(texts))
        except openai.APIStatusError as e:
            if len(texts) == 1:
                log.warning("memfilter: the embeddings endpoint refused a text of %d characters: HTTP %d: %s", len(texts[0]), e.status_code, str(e)[:200])
                return [None]
        # one text refused the whole call: each alone, to find it (them)
        out: list[list[float] | None] = []
        for text in texts:
            try:
                out += await self._call([text])
            except openai.APIStatusError as e:
                log.warning("memfilter: the embeddings endpoint refused a text of %d characters: HTTP %d: %s", len(text), e.status_code, str(e)[:200])
                out.append(None)
        return out

    async def _call(self, texts: list[str]) -> list[list[float]]:
        """The vectors of `texts`, asked again until the endpoint answers; a refusal of the
        texts (a 4xx that is not about the settings) is raised."""
        delay = 0.5
        while True:
            try:
                answer = await self.client.embeddings.create(model=self.model, input=texts, encoding_format="float")
                self.problem = None
                return [item.embedding for item in sorted(answer.data, key=lambda item: item.index)]
            except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as e:  # timeouts too
                self.problem = f"the embeddings endpoint at {self.base_url} is not answering ({type(e).__name__})"
            except openai.APIStatusError as e:
                setting = MISCONFIGURED.get(e.status_code)
                if setting is None:
                    raise
                self.problem = f"the embeddings endpoint at {self.base_url} answers HTTP {e.status_code} for model {self.model}: check {setting}"
            log.warning("memfilter: %s; asking again in %.1f s", self.problem, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    async def close(self) -> None:
        await self.client.close()

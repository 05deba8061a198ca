"""`memfilter agent`: the reference agent runner, downstream of the worker.

It closes the loop the product sits in: a client publishes a request, the worker filters it
and emits a filtered input with the model's `context`, this runner sends that context to a
model and saves the reply through `persist-messages`, the worker's persister applies it to the
thread, and the client's next echo finds it stored.

A consumer group (`MEMFILTER_AGENT_GROUP`) on `filtered-inputs`, on the worker's transactional
task loop (`memfilter.runtime.loop`), of which this module is a `Handler`. For each batch: the
inputs that want an answer (`memfilter.core.replies`, `wants_reply`) go to the model, a
thread's inputs in order and threads side by side (at most MODEL_CONCURRENCY calls at once);
then each partition's replies and its offsets are committed in one Kafka transaction. Exactly
once, as the worker: each partition has its own transactional id, so a runner given a partition
aborts what its last owner left open and fences it out; a re-delivered input makes the same
reply (id and createdAt come from the input), and the persister applies a repeated event once.

Models (`MEMFILTER_AGENT_BACKEND`):
- `echo` (default): offline and deterministic (`replies.echo_reply`);
- `openai`: any OpenAI-compatible chat-completions endpoint through the official `openai`
  package (`MEMFILTER_AGENT_BASE_URL`, `MEMFILTER_AGENT_MODEL`, `OPENAI_API_KEY`).

No input stops the runner: one that is not a filtered input, that the model refuses (an HTTP
4xx: too long, say), or that fails in any other way goes to the dead-letter topic with the
reason (`decode`, `model`, `internal`). A model that does not
answer (connection, timeout, 429, 5xx) is retried until it does, as the worker waits for
Redis: nothing is skipped for an outage.

Web server (as the worker's): `/metrics`, `/healthz`, `/readyz` on MEMFILTER_AGENT_WEB_PORT.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import faust
import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from memfilter.core import replies
from memfilter.core.filter import Rejection
from memfilter.core.filtered import decode_whole
from memfilter.metrics import AgentMetrics
from memfilter.runtime.health import serve_health
from memfilter.runtime.loop import Batch, Handled, TaskLoop
from memfilter.runtime.records import Out, Record, dead_letter, internal_error
from memfilter.schemas.wire import FilteredInput
from memfilter.settings import Agent, Settings

log = logging.getLogger("memfilter")

MODEL_CONCURRENCY = 16  # model calls in flight at once, per runner


class ModelRefused(Exception):
    """The model will not answer this input (not an outage): it is dead-lettered."""


Model = Callable[[FilteredInput], Awaitable[replies.Parts]]


def echo_model(secret: bytes) -> Model:
    async def answer(event: FilteredInput) -> replies.Parts:
        return replies.echo_reply(event.context, replies.reply_id(event, secret).replace("-", ""))

    return answer


class Health:
    """What keeps the runner from answering now, for `/readyz`: a model that is not set up
    right (a key it refuses, a model it does not have) is a problem of the runner's, not of an
    input, so its inputs wait for it as they wait for an outage."""

    def __init__(self) -> None:
        self.model_problem: str | None = None

    def problems(self) -> list[str]:
        return [self.model_problem] if self.model_problem else []


# The model's answers that say the runner is set up wrong, and the setting to fix.
MISCONFIGURED = {401: "OPENAI_API_KEY", 403: "OPENAI_API_KEY", 404: "MEMFILTER_AGENT_MODEL or MEMFILTER_AGENT_BASE_URL"}


def openai_model(agent: Agent, health: Health) -> Model:
    import openai

    client = openai.AsyncOpenAI(api_key=agent.openai_api_key, base_url=agent.base_url, max_retries=0, timeout=60)

    async def answer(event: FilteredInput) -> replies.Parts:
        delay = 0.5
        while True:
            try:
                completion = await client.chat.completions.create(model=agent.model, messages=replies.chat_messages(event.context))
                health.model_problem = None
                return replies.chat_reply(completion.choices[0].message)
            except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as e:  # timeouts too
                log.warning("model at %s not answering (%s); retrying in %.1fs", agent.base_url, type(e).__name__, delay)
            except openai.APIStatusError as e:
                setting = MISCONFIGURED.get(e.status_code)
                if setting is None:
                    raise ModelRefused(f"the model refused request {event.requestId}: HTTP {e.status_code}: {str(e)[:300]}") from None
                health.model_problem = f"the model at {agent.base_url} answers HTTP {e.status_code} for model {agent.model}: check {setting}"
                log.error("memfilter agent: %s; inputs wait until it answers (retrying in %.1fs)", health.model_problem, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    return answer


def transactional_id(group: str, partition: int) -> str:
    """The transactional id of an agent runner's task (`memfilter.runtime.loop`: fencing)."""
    return f"memfilter-agent-{group}-partition-{partition}"


class AgentHandler:
    """The agent runner's part of the task loop: answers, to be committed with the offsets."""

    stops_on: tuple[type[Exception], ...] = ()
    rejoins_on: tuple[type[Exception], ...] = ()

    def __init__(self, settings: Settings, model: Model, metrics: AgentMetrics):
        self.settings = settings
        self.topics = settings.topics
        self.model = model
        self.metrics = metrics
        self._calls = asyncio.Semaphore(MODEL_CONCURRENCY)

    def describe(self) -> str:
        s = self.settings
        return f"group {s.agent.group}, model {s.agent.backend}, Kafka {s.kafka.bootstrap}"

    def tasks(self, consumer: AIOKafkaConsumer, assigned: set[TopicPartition]) -> list[int]:
        return sorted(tp.partition for tp in assigned)

    async def take_up(self) -> None:
        pass

    async def prepare(self, loop: TaskLoop, batch: Batch, epoch: int) -> None:
        pass

    async def handle(self, batch: Batch) -> Handled:
        """Each partition's answers, its threads side by side."""
        outs: dict[int, list[Out]] = {}
        for tp, records in batch.items():
            by_thread: dict[bytes | None, list] = {}
            for r in records:
                by_thread.setdefault(r.key, []).append(r)
            answered = await asyncio.gather(*(self._thread(rs) for rs in by_thread.values()))
            outs[tp.partition] = [out for per_thread in answered for out in per_thread]
        sent = [out for task_outs in outs.values() for out in task_outs]

        async def done() -> None:
            for out in sent:
                self.metrics.outputs.labels("reply" if out.topic == self.topics.persist else "dead-letter").inc()

        return Handled(outs, done)

    async def _thread(self, records: list) -> list[Out]:
        """One thread's inputs of the batch, in order: the records to send."""
        out = []
        for r in records:
            try:
                event = decode_whole(r.value)
            except (msgspec.DecodeError, TypeError) as e:
                out.append(self._dead(r, Rejection("decode", f"record is not a FilteredInput ({e}); it was skipped")))
                continue
            try:
                if not replies.wants_reply(event.context):
                    self.metrics.inputs.labels("no-reply").inc()
                    continue
                async with self._calls:
                    with self.metrics.model_seconds.time():
                        parts = await self.model(event)
                value = replies.reply_event(event, replies.reply_message(event, parts, r.timestamp, self.settings.secret))
            except ModelRefused as e:
                out.append(self._dead(r, Rejection("model", str(e))))
                continue
            except Exception as e:  # one input's problem (a bug, a context no code foresaw): not the runner's
                out.append(self._dead(r, internal_error(Record.of(r), e)))
                continue
            self.metrics.inputs.labels("answered").inc()
            out.append(Out(self.topics.persist, r.key, value, None))
        return out

    def _dead(self, r, error: Rejection) -> Out:
        self.metrics.inputs.labels("dead-letter").inc()
        return dead_letter(Record.of(r), self.topics.dlq, error)


def create_agent_app(settings: Settings) -> faust.App:
    health = Health()
    model = echo_model(settings.secret) if settings.agent.backend == "echo" else openai_model(settings.agent, health)
    metrics = AgentMetrics()
    group = settings.agent.group
    loop = TaskLoop(
        "agent",
        settings.kafka,
        group,
        [settings.topics.filtered],
        AgentHandler(settings, model, metrics),
        metrics,
        lambda task: transactional_id(group, task),
        max_records=500,
        start_at_end=settings.agent.start == "latest",
    )
    app = serve_health(
        group,
        settings,
        f"{settings.worker.data_dir}-agent",
        settings.agent.web_port,
        metrics,
        lambda: health.problems() + loop.problems(),
    )
    app.add_dependency(loop)
    return app

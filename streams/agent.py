"""`memfilter agent`: the reference agent runner, downstream of the worker.

It closes the loop the product sits in: a client publishes a request, the worker filters it
and emits a filtered input with the model's `context`, this runner sends that context to a
model and saves the reply through `persist-messages`, the worker's persister applies it to the
thread, and the client's next echo finds it stored.

A consumer group (`MEMFILTER_AGENT_GROUP`) on `filtered-inputs`, read_committed. For each
batch: the inputs that want an answer (`streams/replies.py`, `wants_reply`) go to the model,
a thread's inputs in order and threads side by side (at most MODEL_CONCURRENCY calls at
once); then each partition's replies and its offsets are committed in one Kafka transaction,
as the worker commits its outputs. Exactly once, as the worker: each partition has its own
transactional id, so a runner given a partition aborts what its last owner left open and
fences it out; a re-delivered input makes the same reply (id and createdAt come from the
input), and the persister applies a repeated event once.

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
import os
from collections.abc import Awaitable, Callable

import faust
import mode
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import ConsumerStoppedError

from schemas.wire import FilteredInput
from streams import replies
from streams.app import Rebalance, seek_to_committed, serve_health, wait_for_topics
from streams.filter import Rejection
from streams.metrics import AgentMetrics
from streams.processor import MAX_RECORD_BYTES, Record, dead_letter, internal_error
from streams.settings import Settings

log = logging.getLogger("memfilter")

MODEL_CONCURRENCY = 16  # model calls in flight at once, per runner
_FILTERED = msgspec.json.Decoder(FilteredInput)


class ModelRefused(Exception):
    """The model will not answer this input (not an outage): it is dead-lettered."""


Model = Callable[[FilteredInput], Awaitable[replies.Parts]]


def echo_model(secret: bytes) -> Model:
    async def answer(event: FilteredInput) -> replies.Parts:
        return replies.echo_reply(event.context, replies.reply_id(event, secret).replace("-", ""))

    return answer


def openai_model(settings: Settings) -> Model:
    import openai

    client = openai.AsyncOpenAI(api_key=settings.openai_api_key or "none", base_url=settings.agent_base_url, max_retries=0, timeout=60)

    async def answer(event: FilteredInput) -> replies.Parts:
        delay = 0.5
        while True:
            try:
                completion = await client.chat.completions.create(model=settings.agent_model, messages=replies.chat_messages(event.context))
                return replies.chat_reply(completion.choices[0].message)
            except (openai.APIConnectionError, openai.RateLimitError, openai.InternalServerError) as e:  # timeouts too
                log.warning("model at %s not answering (%s); retrying in %.1fs", settings.agent_base_url, type(e).__name__, delay)
            except openai.APIStatusError as e:
                raise ModelRefused(f"the model refused request {event.requestId}: HTTP {e.status_code}: {str(e)[:300]}") from None
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)

    return answer


def transactional_id(group: str, partition: int) -> str:
    return f"memfilter-agent-{group}-partition-{partition}"


class AgentLoop(mode.Service):
    """Fetch a batch of filtered inputs, answer them, commit the replies with the offsets."""

    def __init__(self, settings: Settings, model: Model, metrics: AgentMetrics, **kwargs):
        super().__init__(**kwargs)
        self.settings = settings
        self.model = model
        self.metrics = metrics
        self._consumer: AIOKafkaConsumer | None = None
        self._producers: dict[int, AIOKafkaProducer] = {}
        self._turn = asyncio.Lock()  # held while a batch is handled; a rebalance waits for it
        self._epoch = 0  # assignments so far: a batch fetched before one is dropped, and fetched again
        self._calls = asyncio.Semaphore(MODEL_CONCURRENCY)

    async def on_start(self) -> None:
        s = self.settings
        log.info("memfilter agent starting: group %s, model %s, Kafka %s", s.agent_group, s.agent_backend, s.bootstrap)
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap,
            group_id=s.agent_group,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",
            max_partition_fetch_bytes=MAX_RECORD_BYTES,
            session_timeout_ms=int(s.session_timeout * 1000),
            heartbeat_interval_ms=int(s.session_timeout * 250),
            fetch_max_wait_ms=100,
        )
        await self._consumer.start()
        await wait_for_topics(self._consumer, [s.topics.filtered])
        self._consumer.subscribe([s.topics.filtered], listener=Rebalance(self))

    async def on_stop(self) -> None:
        async with self._turn:
            await self._stop_producers()
        if self._consumer is not None:
            await self._consumer.stop()

    @property
    def assigned(self) -> set[TopicPartition]:
        return self._consumer.assignment() if self._consumer is not None else set()

    @mode.Service.task
    async def _run(self) -> None:
        try:
            while not self.should_stop:
                batch = await self._consumer.getmany(timeout_ms=int(self.settings.batch_within * 1000), max_records=500)
                epoch = self._epoch  # no await since the fetch: the batch is of this assignment
                async with self._turn:
                    if batch and epoch == self._epoch:
                        await asyncio.gather(*(self._partition(tp, records) for tp, records in batch.items()))
        except ConsumerStoppedError:
            pass
        except Exception:
            log.critical("memfilter agent: stopping on an unexpected error", exc_info=True)
            self._crash_process()

    def _crash_process(self) -> None:
        os._exit(1)  # as the worker: better restarted than up and idle

    async def _partition(self, tp: TopicPartition, records: list) -> None:
        """A partition's part of the batch: answers, then one transaction with the offset."""
        by_thread: dict[bytes | None, list] = {}
        for r in records:
            by_thread.setdefault(r.key, []).append(r)
        answered = await asyncio.gather(*(self._thread(rs) for rs in by_thread.values()))
        outs = [out for per_thread in answered for out in per_thread]
        producer = self._producers[tp.partition]
        await producer.begin_transaction()
        sent = [await producer.send(topic, value, key=key, headers=list(headers)) for topic, key, value, headers in outs]
        await asyncio.gather(*sent)
        await producer.send_offsets_to_transaction({tp: records[-1].offset + 1}, self.settings.agent_group)
        await producer.commit_transaction()
        for topic, *_ in outs:
            self.metrics.outputs.labels("reply" if topic == self.settings.topics.persist else "dead-letter").inc()

    async def _thread(self, records: list) -> list[tuple[str, bytes | None, bytes, tuple]]:
        """One thread's inputs of the batch, in order: (topic, key, value, headers) to send."""
        out = []
        for r in records:
            try:
                event = _FILTERED.decode(r.value)
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
            out.append((self.settings.topics.persist, r.key, value, ()))
        return out

    def _dead(self, r, error: Rejection) -> tuple[str, bytes | None, bytes, tuple]:
        self.metrics.inputs.labels("dead-letter").inc()
        dead = dead_letter(Record.of(r), self.settings.topics.dlq, error)
        return dead.topic, dead.key, dead.value, dead.headers

    async def partitions_revoked(self) -> None:
        async with self._turn:
            await self._stop_producers()
            self._epoch += 1
        self.metrics.assigned.set(0)

    async def partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        """A producer per partition first (it fences the last owner), then the committed offsets."""
        async with self._turn:
            s = self.settings
            self._producers = {
                tp.partition: AIOKafkaProducer(
                    bootstrap_servers=s.bootstrap, transactional_id=transactional_id(s.agent_group, tp.partition),
                    acks="all", max_request_size=MAX_RECORD_BYTES,
                )
                for tp in assigned
            }
            await asyncio.gather(*(p.start() for p in self._producers.values()))
            await seek_to_committed(self._consumer, assigned)
            self._epoch += 1  # a batch fetched before the seek is dropped (`_run`): fetched again from here
        self.metrics.assigned.set(len(assigned))
        log.info("memfilter agent ready: partitions %s of %s", sorted(tp.partition for tp in assigned), self.settings.topics.filtered)

    async def _stop_producers(self) -> None:
        producers, self._producers = self._producers, {}
        await asyncio.gather(*(p.stop() for p in producers.values()))


def create_agent_app(settings: Settings) -> faust.App:
    model = echo_model(settings.secret) if settings.agent_backend == "echo" else openai_model(settings)
    metrics = AgentMetrics()
    loop = AgentLoop(settings, model, metrics)
    app = serve_health(settings.agent_group, settings, f"{settings.data_dir}-agent", settings.agent_web_port, metrics, lambda: [] if loop.assigned else ["no partitions assigned"])
    app.add_dependency(loop)
    return app

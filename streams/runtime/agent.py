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
reply id, and the persister applies a repeated event once.

A reply streams as it is made: the model yields UI message stream chunks, each relayed at once
to `reply-streams` (`memfilter.runtime.relay`) for the gateway, and folded into the reply saved
(`memfilter.core.reply_stream`), so the saved reply is what the chunks add up to. A client's
stop (`reply-stops`) ends the model call; the reply is saved as it stands, finish reason
`interrupted`. A model that fails midway: saved as it stands, finish reason `error`. Either
way a tool call still being streamed is saved as `output-error`, never as a call to answer.

Mastra's memory loaders, when set: with MEMFILTER_RECALL, what was said long ago is found by
meaning and given to the model with the context (`memfilter.runtime.recaller`, docs/recall.md);
with MEMFILTER_WORKING_MEMORY, the `openai` backend offers `updateWorkingMemory`, answers its
calls and calls the model again, and the reply's event carries the calls that updated the
document (`openai_model`, docs/working-memory.md).

Models (`MEMFILTER_AGENT_BACKEND`):
- `echo` (default): offline and deterministic (`replies.echo_reply`);
- `openai`: any OpenAI-compatible chat-completions endpoint through the official `openai`
  package, streamed (`memfilter.core.chat_completions`), with the system prompt, tools and
  sampling settings of `Agent` (docs/agent.md).

No input stops the runner: one that is not a filtered input, that the model refuses (an HTTP
4xx: too long, say), or that fails in any other way before its reply begins goes to the
dead-letter topic with the reason (`decode`, `model`, `internal`). A model that does not
answer (connection, timeout, 429, 5xx) is retried until it does, as the worker waits for
Redis: nothing is skipped for an outage.

Web server (as the worker's): `/metrics`, `/healthz`, `/readyz` on MEMFILTER_AGENT_WEB_PORT.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import faust
import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from memfilter.core import chat_completions, replies, working_memory
from memfilter.core.filter import Rejection
from memfilter.core.filtered import decode_whole
from memfilter.core.reply_stream import Reply
from memfilter.core.ui import to_ui
from memfilter.metrics import AgentMetrics
from memfilter.runtime.health import serve_health
from memfilter.runtime.loop import Batch, Handled, TaskLoop
from memfilter.runtime.records import Out, Record, dead_letter, internal_error
from memfilter.runtime.relay import Relay, Streaming
from memfilter.schemas.wire import FilteredInput
from memfilter.settings import Agent, Settings

if TYPE_CHECKING:
    from memfilter.core.working_memory import Template
    from memfilter.runtime.recaller import Recaller

log = logging.getLogger("memfilter")

MODEL_CONCURRENCY = 16  # model calls in flight at once, per runner


class ModelRefused(Exception):
    """The model will not answer this input (not an outage): it is dead-lettered."""


# A model: the reply to a filtered input (its id given) as UI message stream chunks, ending
# with `finish` (finish reason, and metadata for the saved reply).
Model = Callable[[FilteredInput, str], AsyncIterator[dict[str, Any]]]


def echo_model(event: FilteredInput, reply_id: str) -> AsyncIterator[dict[str, Any]]:
    async def chunks() -> AsyncIterator[dict[str, Any]]:
        for chunk in replies.echo_reply(event.context, reply_id.replace("-", "")):
            yield chunk

    return chunks()


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


class ToolsFileError(ValueError):
    """MEMFILTER_AGENT_TOOLS names a file that is not a list of tools; the message says why."""


def read_tools(path: str) -> list[dict[str, Any]]:
    """The tools of MEMFILTER_AGENT_TOOLS: a JSON list of {name, description, inputSchema}
    (or `parameters`, as OpenAI names it), as chat-completions functions."""
    if not path:
        return []
    try:
        declared = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ToolsFileError(f"MEMFILTER_AGENT_TOOLS={path!r} cannot be read as JSON: {e}") from None
    if not isinstance(declared, list):
        raise ToolsFileError(f"MEMFILTER_AGENT_TOOLS={path!r} is not a JSON list of tools")
    tools = []
    for i, tool in enumerate(declared):
        schema = tool.get("inputSchema", tool.get("parameters", {"type": "object", "properties": {}})) if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not isinstance(schema, dict):
            raise ToolsFileError(f"MEMFILTER_AGENT_TOOLS={path!r}: tool {i} needs a name and a JSON Schema object as inputSchema")
        tools.append({"name": tool["name"], "description": str(tool.get("description", "")), "parameters": schema})
    return tools


def openai_model(agent: Agent, health: Health, template: Template | None = None) -> Model:
    """The `openai` backend. With working memory (`template`), the model is offered
    `updateWorkingMemory` too: the runner answers its calls itself, against the input's
    document (`memfilter.core.working_memory.update`), and calls the model again with the
    answers, up to MAX_STEPS calls a reply, as Mastra's agent does; the calls that update it
    are the reply's, saved with it (`memory_calls`)."""
    import openai

    client = openai.AsyncOpenAI(api_key=agent.openai_api_key, base_url=agent.base_url, max_retries=0, timeout=60)
    tools = read_tools(agent.tools) + ([working_memory.tool(template)] if template is not None else [])
    sampling = {
        "temperature": agent.temperature,
        "top_p": agent.top_p,
        "max_completion_tokens": agent.max_output_tokens,
        "seed": agent.seed,
        "stop": agent.stop_sequences.split("|") if agent.stop_sequences else None,
    }

    async def opened(event: FilteredInput, body: dict[str, Any]) -> Any:
        """The streamed completion, once the endpoint takes the call."""
        delay = 0.5
        while True:
            try:
                stream = await client.chat.completions.create(**body)
                health.model_problem = None
                return stream
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

    def answer(event: FilteredInput, reply_id: str) -> AsyncIterator[dict[str, Any]]:
        async def chunks() -> AsyncIterator[dict[str, Any]]:
            body = chat_completions.request(event.context, agent.model, agent.system, tools, **sampling)
            document = event.workingMemory if isinstance(event.workingMemory, str) else None
            made = 0  # calls answered, which the reply's event carries
            for step in range(MAX_STEPS + 1):
                stream = await opened(event, body)
                completion = chat_completions.Completion(reply_id.replace("-", "")[:12] + (f"s{step}" if step else ""))
                said: list[str] = []
                try:
                    async for chunk in stream:
                        for out in completion.add(chunk.to_dict()):
                            said += [out["delta"]] if out["type"] == "text-delta" else []
                            yield out
                finally:
                    await stream.close()
                calls = list(completion.calls.values())
                *ending, finish = completion.finish()
                ours = [c for c in calls if c["name"] == working_memory.TOOL] if template is not None else []
                for out in ending:
                    yield out
                answers = []
                for call in ours:  # answered here, in order, each against the document the ones before it left
                    if made == MAX_CALLS:  # an event carries no more (`WorkingMemoryUpdate`)
                        out = {
                            "type": "tool-output-error",
                            "toolCallId": call["id"],
                            "errorText": f"not stored: a reply updates working memory {MAX_CALLS} times at most",
                        }
                    else:
                        out, document = _memory_call(template, document, call)
                        made += out["type"] == "tool-output-available"
                    answers.append((call, out))
                    yield out
                if not ours or len(ours) < len(calls) or step == MAX_STEPS:  # a client's tool, or enough: the reply ends
                    yield finish
                    return
                body["messages"] += _answered_step("".join(said), answers)

        return chunks()

    return answer


MAX_STEPS = 5  # the model's calls a reply after its first, each answering working memory's tool calls
MAX_CALLS = 64  # calls of updateWorkingMemory a reply answers (what its event may carry: `WorkingMemoryUpdate`)


def _memory_call(template: Template | None, document: str | None, call: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """A call of `updateWorkingMemory` answered: its output chunk, and the document after it."""
    assert template is not None
    try:
        given = json.loads(call["arguments"] or "{}")
        size = working_memory.call_bytes(given)
    except ValueError as e:
        return {"type": "tool-output-error", "toolCallId": call["id"], "errorText": f"the arguments are not JSON an event can carry: {e}"}, document
    if size > working_memory.MAX_CALL_BYTES:  # its event would be refused, the reply with it
        return {"type": "tool-output-error", "toolCallId": call["id"], "errorText": f"not stored: over {working_memory.MAX_CALL_BYTES:,} bytes"}, document
    done = working_memory.update(template, document, given)
    if isinstance(done, working_memory.Refused):
        return {"type": "tool-output-error", "toolCallId": call["id"], "errorText": "; ".join(done.errors)}, document
    after = done.document if done.document is not None else document
    return {"type": "tool-output-available", "toolCallId": call["id"], "output": working_memory.output(done)}, after


def _answered_step(text: str, answers: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    """A step's calls and their answers, as chat messages for the model's next call."""
    assistant = {
        "role": "assistant",
        "content": text or None,
        "tool_calls": [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}} for c, _ in answers],
    }
    results = [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps(out.get("output", {"error": out.get("errorText")}))} for c, out in answers]
    return [assistant, *results]


def memory_calls(ui: dict[str, Any]) -> list[dict[str, Any]]:
    """The reply's calls of `updateWorkingMemory` that updated the document, in order: what
    its saved event applies (`memfilter.store.memory`)."""
    return [
        p["input"]
        for p in ui.get("parts", [])
        if p.get("type") == f"tool-{working_memory.TOOL}" and p.get("state") == "output-available" and (p.get("output") or {}).get("success")
    ]


def transactional_id(group: str, partition: int) -> str:
    """The transactional id of an agent runner's task (`memfilter.runtime.loop`: fencing)."""
    return f"memfilter-agent-{group}-partition-{partition}"


class AgentHandler:
    """The agent runner's part of the task loop: answers, to be committed with the offsets."""

    stops_on: tuple[type[Exception], ...] = ()
    rejoins_on: tuple[type[Exception], ...] = ()

    def __init__(self, settings: Settings, model: Model, metrics: AgentMetrics, relay: Relay, recaller: Recaller | None = None):
        self.settings = settings
        self.topics = settings.topics
        self.model = model
        self.metrics = metrics
        self.relay = relay
        self.recaller = recaller  # MEMFILTER_RECALL: what the model is also given (`memfilter.runtime.recaller`)
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
                async with self._calls, self.relay.streaming(event) as live:
                    given, recalled = await self.recaller.recalled(event) if self.recaller is not None else (event, None)
                    with self.metrics.model_seconds.time():
                        reply = await self._reply(event, live, given)
                ui = reply.ui()
                if recalled is not None:  # for an audit: why the model saw what it saw
                    ui = {**ui, "metadata": {**(ui.get("metadata") or {}), "recall": recalled}}
                value = replies.reply_event(event, replies.reply_message(event, ui, r.timestamp, self.settings.secret), memory_calls(ui))
            except ModelRefused as e:
                out += [self._dead(r, Rejection("model", str(e))), Out(self.topics.persist, r.key, replies.no_reply_event(event), None)]
                continue
            except Exception as e:  # one input's problem (a bug, a context no code foresaw): not the runner's
                out += [self._dead(r, internal_error(Record.of(r), e)), Out(self.topics.persist, r.key, replies.no_reply_event(event), None)]
                continue
            self.metrics.inputs.labels("answered").inc()
            self._count(reply.metadata)
            out.append(Out(self.topics.persist, r.key, value, None))
        return out

    async def _reply(self, event: FilteredInput, live: Streaming, given: FilteredInput) -> Reply:
        """The model's reply to `event` (given as `given`: with what was recalled), each chunk
        relayed as it comes; cut short by a stop or by a failure midway, it is what was made,
        closed (see the module's header)."""
        reply_id, base = replies.continued(event, self.settings.secret)
        reply = Reply(reply_id, to_ui(base) if base is not None else None)
        await live.send({"type": "start", "messageId": reply_id})
        began = False

        async def made() -> None:
            nonlocal began
            async for chunk in self.model(given, reply_id):
                reply.add(chunk)
                began = True
                await live.send(chunk)

        making = asyncio.ensure_future(made())
        stop = asyncio.ensure_future(live.stopped.wait())
        try:
            await asyncio.wait({making, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the runner itself is stopping: the model call ends too
            for task in (stop, making):
                task.cancel()
            await asyncio.gather(stop, making, return_exceptions=True)
            raise
        stop.cancel()
        if not making.done():  # a client's stop
            making.cancel()
            await asyncio.gather(making, return_exceptions=True)
            await self._cut(reply, live, "interrupted", "stopped by the client before the call was complete")
            return reply
        try:
            making.result()
        except ModelRefused as e:
            if began:
                raise
            await live.send({"type": "error", "errorText": str(e)})
            raise
        except Exception as e:  # the model failed midway (or made chunks no client takes: BadChunk): what it made is saved, marked
            log.warning("memfilter agent: the model failed midway through request %s's reply: %s", event.requestId, e)
            await self._cut(reply, live, "error", f"the reply failed: {type(e).__name__}: {str(e)[:300]}")
        return reply

    async def _cut(self, reply: Reply, live: Streaming, reason: str, why: str) -> None:
        """Close a reply cut short, and tell the client so."""
        for chunk in reply.ended(why):
            await live.send(chunk)
        metadata: dict[str, Any] = {"finishReason": reason} | ({"error": why} if reason == "error" else {})
        closing: list[dict[str, Any]]
        if reason == "error":
            closing = [{"type": "message-metadata", "messageMetadata": metadata}, {"type": "error", "errorText": why}]
        else:
            closing = [{"type": "finish", "finishReason": reason, "messageMetadata": metadata}]
        for end in closing:
            reply.add(end)
            await live.send(end)

    def _count(self, metadata: Any) -> None:
        metadata = metadata if isinstance(metadata, dict) else {}
        self.metrics.finishes.labels(str(metadata.get("finishReason", "unknown"))).inc()
        usage = metadata["usage"] if isinstance(metadata.get("usage"), dict) else {}
        for kind in ("input", "output"):
            if isinstance(usage.get(f"{kind}Tokens"), int):
                self.metrics.tokens.labels(kind).inc(usage[f"{kind}Tokens"])

    def _dead(self, r, error: Rejection) -> Out:
        self.metrics.inputs.labels("dead-letter").inc()
        return dead_letter(Record.of(r), self.topics.dlq, error)


def create_agent_app(settings: Settings) -> faust.App:
    health = Health()
    model = echo_model if settings.agent.backend == "echo" else openai_model(settings.agent, health, settings.working_memory.read())
    metrics = AgentMetrics()
    group = settings.agent.group
    relay = Relay(settings.kafka, settings.topics, settings.secret)
    recaller = None
    if settings.recall.scope != "off":
        from memfilter.runtime.recaller import Recaller

        recaller = Recaller(settings)
    loop = TaskLoop(
        "agent",
        settings.kafka,
        group,
        [settings.topics.filtered],
        AgentHandler(settings, model, metrics, relay, recaller),
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
    app.add_dependency(relay)
    app.add_dependency(loop)
    return app

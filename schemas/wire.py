"""The wire types: every value on the product's four topics, as msgspec Structs.

This module is the one place the shapes of `chat-requests`, `filtered-inputs` and
`persist-messages` values are written down. The JSON Schemas beside it (`*.schema.json`) are
generated from these Structs by `python -m memfilter.schemas --write` for consumers in other languages, and a
test fails when they drift.

Messages are Mastra DB messages (format 2). They must pass through the processor losslessly:
every key it does not interpret, on the message, its content, a part or a tool invocation,
comes out exactly as it went in, and unknown part types pass through. msgspec Structs drop
unknown keys (msgspec issue #490), so the `Message` Struct tree below is a message's *shape*:
what the processor reads, typed and validated. What it passes on is the message as it came
(its JSON bytes, or the dict msgspec decodes them to, `MessageDict`). See `ChatRequestOf`.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

Role = Literal["user", "assistant", "system", "signal"]
ToolState = Literal[
    "partial-call",
    "call",
    "approval-requested",
    "approval-responded",
    "result",
    "output-error",
    "output-denied",
]
Outcome = Literal[
    "empty",
    "retain-full-input",
    "unchanged",
    "seeded",
    "user-tail",
    "tool-outcomes",
    "stored-echo-dropped",
    "unpersisted-assistant-kept",
    "regenerated",
    "edited",
]
# What a `useChat` request says it is (AI SDK v5): a new or edited message, or a regenerate.
Trigger = Literal["submit-message", "regenerate-message"]
# What a request does when it arrives while a reply to an earlier request of its thread is
# being made (MEMFILTER_CONCURRENT_TURNS, `memfilter.core.filter`, `turn`), strictest last: a
# request may ask for a stricter one than its deployment's, never a looser.
TURN_POLICIES = ("concurrent", "interrupt", "enqueue", "reject")
TurnPolicy = Literal["concurrent", "interrupt", "enqueue", "reject"]


# An id a client or a writer gives (a thread, a resource, a message; and a message's `type`,
# stored beside them). Ids key Redis, Kafka records and PostgreSQL's rows, so one rule holds
# them wherever they come in (docs/security.md, "Ids and texts"): 1 to MAX_ID_LENGTH
# characters, none a control character. A key of two ids then fits a PostgreSQL index entry
# (2,704 bytes) whatever the characters, U+0000 (which PostgreSQL's text cannot hold) never
# reaches a column, and no id breaks a log line or a header.
MAX_ID_LENGTH = 256
PRINTABLE = "^[^\\x00-\\x1f\\x7f]+$(?!\\n)"  # `(?!\n)`: Python's `$` passes a last newline
Id = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LENGTH, pattern=PRINTABLE)]
# A request's id: printable as an id, of any length. It keys no PostgreSQL index (a save's
# identity is kept in a thread's `saved`; the request that superseded a row, in a column no
# index reads), and a reply's save is named after it (`<requestId>/reply`).
RequestId = Annotated[str, Meta(min_length=1, pattern=PRINTABLE)]


def id_problem(value: Any, kind: Any = Id) -> str | None:
    """None when `value` is an id (`Id`, or the `kind` given: `RequestId`), else why not, in a
    phrase for an error."""
    try:
        msgspec.convert(value, kind)
        return None
    except msgspec.ValidationError as e:
        if not isinstance(value, str) or not value:
            return f"is not an id ({e})"
        if len(value) > MAX_ID_LENGTH and kind is Id:
            return f"is {len(value):,} characters; an id has {MAX_ID_LENGTH} at most"
        bad = next(c for c in value if c < "\x20" or c == "\x7f")
        return f"holds the control character U+{ord(bad):04X} at {value.index(bad)}; an id is printable text"


# Values the processor passes on without reading them stay JSON bytes (msgspec.Raw): decoding
# them into Python objects only to encode them again costs allocations and garbage collection.
AnyJSON = msgspec.Raw
# An object whose values pass through: decoding it as a dict checks that it is one.
JSONObject = dict[str, msgspec.Raw]


class ToolInvocation(Struct, omit_defaults=True, gc=False):
    """`part.toolInvocation`; other keys (`title`, `x-*`, ...) pass through untouched."""

    state: ToolState
    toolCallId: str
    toolName: str | UnsetType = UNSET
    args: AnyJSON | UnsetType = UNSET
    result: AnyJSON | UnsetType = UNSET
    errorText: str | UnsetType = UNSET
    approval: AnyJSON | UnsetType = UNSET
    preliminary: bool | UnsetType = UNSET  # an output still streaming (AI SDK): not a client outcome


class Part(Struct, omit_defaults=True, gc=False):
    """One part of a message. `type` is open: unknown part types pass through."""

    type: str
    text: str | UnsetType = UNSET  # on `text` and `reasoning` parts; a string wherever it is
    toolInvocation: ToolInvocation | UnsetType = UNSET
    providerExecuted: bool | UnsetType = UNSET
    providerMetadata: JSONObject | UnsetType = UNSET
    providerOptions: JSONObject | UnsetType = UNSET


class Content(Struct, omit_defaults=True, gc=False):
    format: Literal[2]
    parts: list[Part]
    content: str | UnsetType = UNSET
    metadata: JSONObject | UnsetType = UNSET
    providerMetadata: JSONObject | UnsetType = UNSET


class Message(Struct, omit_defaults=True, gc=False):
    """A Mastra DB message, format 2. Other keys on every level pass through untouched."""

    role: Role
    content: Content
    id: Id | UnsetType = UNSET
    createdAt: str | UnsetType = UNSET
    threadId: str | UnsetType = UNSET
    resourceId: str | UnsetType = UNSET
    type: Id | UnsetType = UNSET


class UIMessage(Struct, omit_defaults=True, gc=False):
    """An AI SDK UI message (what `useChat` holds), accepted in a request beside `Message`s and
    converted to one on the way in (`memfilter.core.ui`, `docs/ui-messages.md`). Its parts are
    open (`{"type": ...}` and any keys); other keys pass through. Written here for the JSON
    Schema: the conversion reads the message as it came, to keep every key."""

    role: Role
    parts: list[dict[str, Any]]
    id: Id | UnsetType = UNSET
    content: str | UnsetType = UNSET  # AI SDK v4's text mirror
    metadata: dict[str, Any] | UnsetType = UNSET
    createdAt: str | UnsetType = UNSET
    threadId: str | UnsetType = UNSET
    resourceId: str | UnsetType = UNSET


class UIPart(Struct, omit_defaults=True, gc=False):
    """A part of a UI message, as the processor reads it to decide (its keys typed as the
    stored part they become would have them); the part itself is converted whole."""

    type: str
    text: str | UnsetType = UNSET
    state: str | UnsetType = UNSET  # of a tool part: one of the UI states (`memfilter.core.ui`)
    toolCallId: str | UnsetType = UNSET
    toolName: str | UnsetType = UNSET  # of a `dynamic-tool` part
    input: AnyJSON | UnsetType = UNSET
    output: AnyJSON | UnsetType = UNSET
    errorText: str | UnsetType = UNSET
    approval: AnyJSON | UnsetType = UNSET
    preliminary: bool | UnsetType = UNSET
    toolInvocation: ToolInvocation | UnsetType = UNSET  # an AI SDK v4 part: already stored form
    providerExecuted: bool | UnsetType = UNSET
    providerMetadata: JSONObject | UnsetType = UNSET
    providerOptions: JSONObject | UnsetType = UNSET
    callProviderMetadata: JSONObject | UnsetType = UNSET
    mediaType: str | UnsetType = UNSET  # of a `file` part
    url: str | UnsetType = UNSET  # of a `file` or `source-url` part
    sourceId: str | UnsetType = UNSET  # of a `source-url` part
    reasoning: AnyJSON | UnsetType = UNSET  # of a `reasoning` part already in stored form


class EitherMessage(Struct, omit_defaults=True, gc=False):
    """A request's message of either kind, as the processor reads it: a stored-format message
    (`content` an object) or a UI message (`parts`, `content` absent or a string)."""

    role: Role
    content: Content | str | UnsetType = UNSET
    parts: list[UIPart] | UnsetType = UNSET
    metadata: JSONObject | UnsetType = UNSET
    id: Id | UnsetType = UNSET
    createdAt: str | UnsetType = UNSET
    threadId: str | UnsetType = UNSET
    resourceId: str | UnsetType = UNSET
    type: Id | UnsetType = UNSET


# A message as it travels through the processor: the dict msgspec decoded, every key kept.
MessageDict = Annotated[
    dict[str, Any],
    Meta(extra_json_schema={"$ref": "#/$defs/Message"}),
]
# A filtered input's contributed message: whole, or in format 2 a reference to the same
# message in its `context` (`memfilter.core.filtered`).
ContributedDict = Annotated[
    dict[str, Any],
    Meta(
        extra_json_schema={
            "anyOf": [
                {"$ref": "#/$defs/Message"},
                {
                    "type": "object",
                    "properties": {"$ref": {"type": "string", "pattern": "^#/context/[0-9]+$"}},
                    "required": ["$ref"],
                    "additionalProperties": False,
                },
            ]
        }
    ),
]
# A message of a request: either kind, each on its own.
RequestMessageDict = Annotated[
    dict[str, Any],
    Meta(extra_json_schema={"anyOf": [{"$ref": "#/$defs/Message"}, {"$ref": "#/$defs/UIMessage"}]}),
]

M = TypeVar("M")


# Generic in how its messages are held: `ChatRequest` (dicts) is what clients build; the
# filter decodes the same bytes as `ChatRequestOf[Message]` to read them typed and as
# `ChatRequestOf[msgspec.Raw]` to pass them on byte for byte.
class ChatRequestOf(Struct, Generic[M], omit_defaults=True):
    """A value on `chat-requests`, keyed by `threadId`."""

    threadId: Id
    resourceId: Id
    messages: list[M]
    requestId: RequestId | UnsetType = UNSET
    retainFullInput: bool = False
    trigger: Trigger | UnsetType = UNSET
    messageId: Id | UnsetType = UNSET  # with `submit-message`: the message edited (`docs/regenerate-edit.md`)
    concurrentTurns: TurnPolicy | UnsetType = UNSET  # stricter than the deployment's MEMFILTER_CONCURRENT_TURNS only


ChatRequest = ChatRequestOf[RequestMessageDict]


class MessagesOf(Struct, Generic[M]):
    """A value's messages alone, its other keys skipped unread: what a second decode of a value
    already checked needs (its messages' bytes as they came, `msgspec.Raw`), at no more cost."""

    messages: list[M]


class Dropped(Struct, gc=False):
    id: str
    reason: str


class Source(Struct):
    topic: str
    partition: int
    offset: int


class FilteredInput(Struct):
    """A value on `filtered-inputs`: what one accepted request contributes downstream.

    `messages` is what the request contributed; `context` the model's input, in order: the
    request's system messages, the last rows of the conversation with the request's updates in
    place, then what else it contributed (`memfilter.core.filter`, `_context`). With `format`
    2, a contributed message that is in the context is written there only, and `messages`
    holds a reference to it (`memfilter.core.filtered`, `whole_messages`); without `format`,
    every message is whole in both. `historyVersion` is the thread's version when the decision
    was made, so an audit can rebuild exactly the history the decision saw.
    """

    requestId: RequestId
    threadId: Id
    resourceId: Id
    outcome: Outcome
    messages: list[ContributedDict]
    context: list[MessageDict]
    dropped: list[Dropped]
    source: Source
    historyVersion: int = 0
    superseded: list[str] = []  # ids of the rows this request took out of the conversation (regenerate, edit)
    format: Literal[2] | UnsetType = UNSET  # 2: `messages` refer into `context`; absent: format 1, all whole
    contextTokens: float | UnsetType = UNSET  # with a token budget (MEMFILTER_CONTEXT_TOKENS): what the context weighs
    # with a token budget: true when the stored history the rows allowed did not fit, not even
    # its newest whole turn, so the context holds the request alone (absent otherwise)
    historyLeftOut: (
        Annotated[
            bool,
            Meta(
                description="With a token budget (MEMFILTER_CONTEXT_TOKENS): true when none of the stored history the rows allowed fits "
                "beside the request, not even its newest whole turn, so the context holds the request alone (MEMFILTER_CONTEXT_NO_HISTORY=send). "
                "Absent otherwise."
            ),
        ]
        | UnsetType
    ) = UNSET
    waited: Waited | UnsetType = UNSET  # a request that waited for the reply before it (enqueue, interrupt)
    # with MEMFILTER_WORKING_MEMORY: the working memory's document as the decision saw it (null:
    # never written); the context carries it to the model in Mastra's system message
    workingMemory: str | None | UnsetType = UNSET


class Waited(Struct, omit_defaults=True):
    """How a request that arrived while its thread's reply was being made waited for it
    (MEMFILTER_CONCURRENT_TURNS `enqueue` or `interrupt`) before it was decided."""

    ms: Annotated[int, Meta(description="From the request's record time to the decision's, in ms.")]
    lapsed: Annotated[
        bool,
        Meta(description="True when the reply it waited for was not saved within MEMFILTER_TURN_WAIT_S: decided without it."),
    ] = False


class WorkingMemoryUpdate(Struct):
    """What an event does to the working memory of its thread's resource (or of its thread,
    as MEMFILTER_WORKING_MEMORY says): the calls of Mastra's `updateWorkingMemory` tool its
    reply made, each with the arguments the model gave (`{"memory": ...}`), applied in order
    (`memfilter.store.memory`)."""

    calls: Annotated[list[dict[str, Any]], Meta(max_length=64)]  # an event's are folded in one go: bounded, far above what a reply makes


class Erasure(Struct):
    """What an erasure event (`memfilter forget`) says: no content, only what an auditor needs.
    The thread and the resource it erased are the event's `threadId` and `resourceId`."""

    at: str  # when it was asked for (ISO-8601, UTC)
    by: str  # who asked (`memfilter forget --by`, else the operator's login)
    scope: Literal["thread", "resource"]  # `--thread`, or one thread of a `--resource`
    reason: str = ""


# Generic like `ChatRequestOf`: the persister reads the same bytes typed and raw.
class PersistMessagesOf(Struct, Generic[M], omit_defaults=True):
    """A value on `persist-messages`: rows to save in one thread.

    `requestId` names another service's save: a second event of the same resource and
    `requestId` in a thread is a repeat and changes nothing. The processor's own events carry
    `historyVersion`, the thread's version its decision saw, so that a rebuild applies them
    where they happened among other writers' saves (which leave it out).

    An operator's event (signed: `memfilter.core.origin`) is an import's rows (`memfilter
    history import`), or, with `erasure` and no messages, the erasure of the thread at the
    version `historyVersion` (`memfilter forget`, `docs/erasure.md`).
    """

    requestId: RequestId
    threadId: Id
    resourceId: Id
    messages: list[M]
    historyVersion: int | UnsetType = UNSET
    superseded: list[Id] = []  # ids of this thread's rows to take out of the conversation (kept stored)
    erasure: Erasure | UnsetType = UNSET  # an operator's erasure of the thread (no messages)
    workingMemory: WorkingMemoryUpdate | UnsetType = UNSET  # an update of the working memory (the agent's tool call)


PersistMessages = PersistMessagesOf[MessageDict]


class ReplyChunk(Struct):
    """A value on `reply-streams`: one chunk of a reply as the agent runner makes it, keyed by
    thread, for the gateway to relay to the browser (`memfilter.core.reply_stream`).

    Not part of the history: the saved reply goes through `persist-messages`, exactly once,
    and equals what its chunks add up to. `attempt` names one run of the model for the
    request: a runner that takes an input up again (its last owner died mid-reply) begins a
    new attempt, from a `start` chunk.
    """

    requestId: RequestId  # the filtered input's
    threadId: Id
    resourceId: Id
    attempt: str
    chunk: dict[str, Any]  # a UI message stream chunk (the `ai` package's uiMessageChunkSchema)


class StopReply(Struct, omit_defaults=True):
    """A value on `reply-stops`, keyed by thread: a client's stop of the reply being made in
    its thread (the gateway's `POST /api/chat/{id}/stop`). The runner making it ends the model
    call and saves what was made, with finish reason `interrupted`."""

    threadId: Id
    resourceId: Id
    requestId: str = ""  # the reply's request, when known: another request's reply is not stopped


TOPIC_VALUES: dict[str, type] = {
    "chat-requests": ChatRequest,
    "filtered-inputs": FilteredInput,
    "persist-messages": PersistMessages,
    "reply-streams": ReplyChunk,
    "reply-stops": StopReply,
}


def json_schemas() -> dict[str, dict[str, Any]]:
    """One self-contained JSON Schema per topic value, keyed by topic name."""
    out = {}
    for topic, struct in TOPIC_VALUES.items():
        shapes = [struct, Message, UIMessage] if struct is ChatRequest else [struct, Message]
        (root, *_), components = msgspec.json.schema_components(shapes)
        name = root["$ref"].rsplit("/", 1)[1]
        schema = components.pop(name)
        out[topic] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            **schema,
            "title": f"{topic} value ({struct.__name__.split('[')[0].removesuffix('Of')})",
            "$defs": components,
        }
    return out

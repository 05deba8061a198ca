"""Every setting of the product, from the environment: typed parts, checked when made.

Each environment variable in `docs/settings.md` is one field of one part: where to reach Kafka
(`Kafka`), Redis (`Redis`) and PostgreSQL (`Postgres`), the topics' names (`Topics`), how requests are decided
(`Decisions`, which makes the filter's `Policy`), and what only the worker (`Worker`), the
agent runner (`Agent`), semantic recall (`Recall`), the gateway (`Gateway`) or `memfilter stack` (`Stack`) reads. `Settings.from_env()` converts
and checks them all with msgspec (the same library that checks the wire types), so a bad value
stops a command before it starts, with one line that names the variable and what it takes:

    MEMFILTER_MAX_MESSAGES='abc' is not valid: expected `int`, got `str`

Every command reads its settings here and nowhere else; nothing else in the environment
changes what the product does. Topic names are set here alone: the worker, the agent runner,
the client and `memfilter stack up` (which makes them) all take `Settings.topics`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from memfilter.core.filter import HISTORY_MESSAGES, Limits, Policy
from memfilter.core.tokens import COUNTERS
from memfilter.core.window import Budget
from memfilter.schemas.wire import TurnPolicy

Port = Annotated[int, Meta(ge=1, le=65535)]
Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0)]

# Defaults the store's layout relies on (docs/capacity.md): how long a processed request is
# kept for retries, and how many of a thread's last requests are retry-checked.
PROCESSED_TTL_S = 7 * 24 * 3600
RETRY_WINDOW = 8
# How long the relay topics (`Topics.relays`) keep a record: long enough to resume any reply
# still being made (MEMFILTER_GATEWAY_REPLY_S at most), short because they copy message content.
RELAY_RETENTION_MS = 3600 * 1000
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
_BOOTSTRAP = re.compile(r"^[^\s,:]+:\d{1,5}(,[^\s,:]+:\d{1,5})*$")


class SettingError(ValueError):
    """A setting that will not do: one line naming the variable and the fix."""


class Kafka(
    msgspec.Struct,
    frozen=True,
    rename={
        "bootstrap": "KAFKA_BOOTSTRAP_SERVERS",
        "batch_max": "MEMFILTER_BATCH_MAX",
        "batch_within": "MEMFILTER_BATCH_WITHIN",
        "session_timeout": "MEMFILTER_SESSION_TIMEOUT",
    },
):
    """Where Kafka is, and how the consumer groups (worker and agent runner) fetch."""

    bootstrap: str = "127.0.0.1:9092"
    batch_max: Positive = 1500  # records fetched and handled together
    batch_within: Annotated[float, Meta(ge=0)] = 0.5  # seconds a fetch waits when no record is there (it returns as one comes)
    session_timeout: Seconds = 10.0  # seconds before a silent member's partitions go to the others


class Redis(
    msgspec.Struct,
    frozen=True,
    rename={
        "url": "REDIS_URL",
        "prefix": "MEMFILTER_REDIS_PREFIX",
        "replicas": "MEMFILTER_REDIS_REPLICAS",
        "replica_timeout": "MEMFILTER_REDIS_REPLICA_TIMEOUT",
    },
):
    """Where the history store is."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "mf"
    # a batch commits to Kafka only once its Redis writes are on this many replicas (WAIT)
    replicas: Annotated[int, Meta(ge=0, le=5)] = 0
    replica_timeout: Annotated[float, Meta(gt=0, le=5)] = 1.0  # seconds WAIT waits; then the batch is handled again


class Postgres(
    msgspec.Struct,
    frozen=True,
    rename={
        "url": "POSTGRES_URL",
        "timeout": "MEMFILTER_POSTGRES_TIMEOUT",
        "idle_s": "MEMFILTER_IDLE_S",
        "sink_group": "MEMFILTER_SINK_GROUP",
        "sink_web_port": "MEMFILTER_SINK_WEB_PORT",
    },
):
    """The PostgreSQL tier of history (docs/postgres.md): every thread, as of the log; Redis
    keeps the ones in use. Off without POSTGRES_URL."""

    url: str = ""  # postgresql://USER[:PASSWORD]@HOST:PORT/DB; empty: no PostgreSQL tier, every thread stays in Redis
    timeout: Seconds = 5.0  # seconds a call waits for PostgreSQL: a cold thread's load, a sink's write; then it is refused with the reason
    idle_s: Seconds = 86_400.0  # seconds unused after which `memfilter sink` takes a thread out of Redis (once PostgreSQL holds it)
    sink_group: str = "memfilter-sink"  # `memfilter sink`'s consumer group on persist-messages
    sink_web_port: Port = 6069  # `memfilter sink`'s web server (/metrics, /healthz, /readyz), on MEMFILTER_WEB_BIND


class Topics(
    msgspec.Struct,
    frozen=True,
    rename={
        "requests": "MEMFILTER_TOPIC_REQUESTS",
        "filtered": "MEMFILTER_TOPIC_FILTERED",
        "persist": "MEMFILTER_TOPIC_PERSIST",
        "dlq": "MEMFILTER_TOPIC_DLQ",
        "streams": "MEMFILTER_TOPIC_STREAMS",
        "stops": "MEMFILTER_TOPIC_STOPS",
        "copy_retention_days": "MEMFILTER_COPY_RETENTION_DAYS",
        "log_retention_days": "MEMFILTER_LOG_RETENTION_DAYS",
    },
):
    """The product's topics (docs/contracts: what each carries). The first four hold the
    history's inputs and decisions; `streams` (replies as they are made) and `stops` (a
    client's stop of a reply) are short-lived relays, outside the exactly-once history.

    How long each keeps a record (`retention_ms`) bounds how long message content stays in the
    topics after an erasure (docs/erasure.md): the relays an hour; the copies (`requests`,
    `filtered`, `dlq`) MEMFILTER_COPY_RETENTION_DAYS; `persist`, the history's log,
    MEMFILTER_LOG_RETENTION_DAYS; 0 for ever (the default: audits replay them, rebuilds read the log)."""

    requests: str = "chat-requests"
    filtered: str = "filtered-inputs"
    persist: str = "persist-messages"
    dlq: str = "chat-requests-dlq"
    streams: str = "reply-streams"
    stops: str = "reply-stops"
    copy_retention_days: Annotated[float, Meta(ge=0)] = 0
    log_retention_days: Annotated[float, Meta(ge=0)] = 0

    def all(self) -> tuple[str, ...]:
        return self.requests, self.filtered, self.persist, self.dlq, self.streams, self.stops

    def relays(self) -> tuple[str, str]:
        """The short-lived topics, kept for RELAY_RETENTION_MS."""
        return self.streams, self.stops

    def retention_ms(self) -> dict[str, int]:
        """Each topic's `retention.ms`: -1 keeps its records for ever."""
        days = lambda d: int(d * 86_400_000) if d else -1  # noqa: E731
        copies = days(self.copy_retention_days)
        out = {self.requests: copies, self.filtered: copies, self.dlq: copies, self.persist: days(self.log_retention_days)}
        return out | dict.fromkeys(self.relays(), RELAY_RETENTION_MS)


class Decisions(
    msgspec.Struct,
    frozen=True,
    rename={
        "max_bytes": "MEMFILTER_MAX_BYTES",
        "max_messages": "MEMFILTER_MAX_MESSAGES",
        "history_messages": "MEMFILTER_HISTORY_MESSAGES",
        "edits": "MEMFILTER_EDITS",
        "context_tokens": "MEMFILTER_CONTEXT_TOKENS",
        "token_counter": "MEMFILTER_TOKEN_COUNTER",
        "context_no_history": "MEMFILTER_CONTEXT_NO_HISTORY",
        "reopen_erased": "MEMFILTER_REOPEN_ERASED",
        "concurrent_turns": "MEMFILTER_CONCURRENT_TURNS",
        "turn_wait_s": "MEMFILTER_TURN_WAIT_S",
    },
):
    """How requests are decided: made into the filter's `Policy` (`Settings.policy`)."""

    max_bytes: Positive = 1 << 20
    max_messages: Positive = 1000
    history_messages: Annotated[int, Meta(ge=0, le=1000)] = HISTORY_MESSAGES  # rows of the conversation in each context
    edits: Literal["on", "off"] = "on"  # regenerate and edit supersede rows; off: the stored copy wins (Mastra)
    context_tokens: Annotated[int, Meta(ge=0)] = 0  # the context's token budget; 0: none (rows only)
    token_counter: Literal["estimate", "o200k"] = "estimate"  # how tokens are counted (memfilter.core.tokens)
    # with a budget, when not even the newest whole turn of stored history fits: `send` the
    # request alone (the filtered input says `historyLeftOut`), or `refuse` it (`context-budget`)
    context_no_history: Literal["send", "refuse"] = "send"
    # an erased thread (memfilter forget) stays erased; on: a new conversation's first request may start it again
    reopen_erased: Literal["on", "off"] = "off"
    # a request that arrives while a reply to an earlier one of its thread is being made:
    # `concurrent`, decided at once; `enqueue`, decided once that reply is saved; `interrupt`,
    # the same once that reply is stopped; `reject`, refused (`busy-thread`). A reply counts as
    # being made for MEMFILTER_TURN_WAIT_S after its request at most (a runner that died holds
    # no thread): then what waited is decided without it (docs/delivery.md).
    concurrent_turns: TurnPolicy = "concurrent"
    turn_wait_s: Seconds = 120.0


class Worker(
    msgspec.Struct,
    frozen=True,
    rename={
        "group": "MEMFILTER_GROUP",
        "processed_ttl": "MEMFILTER_PROCESSED_TTL",
        "retry_window": "MEMFILTER_RETRY_WINDOW",
        "web_port": "MEMFILTER_WEB_PORT",
        "web_bind": "MEMFILTER_WEB_BIND",
        "data_dir": "MEMFILTER_DATA_DIR",
        "shutdown_s": "MEMFILTER_SHUTDOWN_S",
        "filtered_format": "MEMFILTER_FILTERED_FORMAT",
    },
):
    """`memfilter worker` (and the commands that read its store: history, replay)."""

    group: str = "memfilter"  # the consumer group, and the Faust app's id
    processed_ttl: Positive = PROCESSED_TTL_S  # seconds: a retry later than this after its original is decided again
    retry_window: Annotated[int, Meta(ge=1, le=1000)] = RETRY_WINDOW  # a thread's last N requests are retry-checked
    web_port: Port = 6066
    web_bind: str = "127.0.0.1"  # 0.0.0.0 in a container; the agent runner's web server binds here too
    data_dir: str = ""  # Faust's data folder; default $TMPDIR/memfilter-<group>
    shutdown_s: Annotated[float, Meta(gt=0, le=600)] = 10.0  # seconds from SIGTERM or SIGINT to exit, at most (the agent runner's too)
    # filtered inputs' format (`memfilter.core.filtered`): 2 writes each contributed message once;
    # 1 writes it in `messages` and again in `context`, for consumers not yet reading 2
    filtered_format: Literal[1, 2] = 2


class Agent(
    msgspec.Struct,
    frozen=True,
    rename={
        "group": "MEMFILTER_AGENT_GROUP",
        "backend": "MEMFILTER_AGENT_BACKEND",
        "model": "MEMFILTER_AGENT_MODEL",
        "base_url": "MEMFILTER_AGENT_BASE_URL",
        "web_port": "MEMFILTER_AGENT_WEB_PORT",
        "openai_api_key": "OPENAI_API_KEY",
        "start": "MEMFILTER_AGENT_START",
        "system": "MEMFILTER_AGENT_SYSTEM",
        "tools": "MEMFILTER_AGENT_TOOLS",
        "temperature": "MEMFILTER_AGENT_TEMPERATURE",
        "top_p": "MEMFILTER_AGENT_TOP_P",
        "max_output_tokens": "MEMFILTER_AGENT_MAX_OUTPUT_TOKENS",
        "seed": "MEMFILTER_AGENT_SEED",
        "stop_sequences": "MEMFILTER_AGENT_STOP_SEQUENCES",
    },
):
    """`memfilter agent`, the reference agent runner."""

    group: str = "memfilter-agent"  # its consumer group on filtered-inputs
    backend: Literal["echo", "openai"] = "echo"
    model: str = "gpt-4o-mini"  # for `openai`
    base_url: str = "https://api.openai.com/v1"  # for `openai`: any OpenAI-compatible endpoint
    web_port: Port = 6067
    openai_api_key: str = ""
    # where a new group (no committed offsets) starts on filtered-inputs: `latest` answers only
    # what comes after it starts, `earliest` the whole backlog (every old input, with a paid model)
    start: Literal["latest", "earliest"] = "latest"
    # what the model is called with (`openai`; None: the endpoint's default, not sent)
    system: str = ""  # a system prompt put first, before the context's own system messages
    tools: str = ""  # a JSON file of tools the model may call (docs/agent.md: Tools)
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    max_output_tokens: Positive | None = None
    seed: int | None = None
    stop_sequences: str = ""  # sequences that end the reply, separated by `|`


class Recall(
    msgspec.Struct,
    frozen=True,
    rename={
        "scope": "MEMFILTER_RECALL",
        "top_k": "MEMFILTER_RECALL_TOP_K",
        "before": "MEMFILTER_RECALL_BEFORE",
        "after": "MEMFILTER_RECALL_AFTER",
        "threshold": "MEMFILTER_RECALL_THRESHOLD",
        "base_url": "MEMFILTER_EMBEDDINGS_BASE_URL",
        "model": "MEMFILTER_EMBEDDINGS_MODEL",
        "api_key": "MEMFILTER_EMBEDDINGS_API_KEY",
        "group": "MEMFILTER_EMBEDDER_GROUP",
        "web_port": "MEMFILTER_EMBEDDER_WEB_PORT",
    },
):
    """Semantic recall (docs/recall.md), with Mastra's options: `memfilter embedder` embeds
    saved messages into PostgreSQL, the agent runner recalls the nearest for each input."""

    # where the agent runner searches: `off`, the input's `thread`, or all its `resource`'s threads (Mastra's default scope)
    scope: Literal["off", "thread", "resource"] = "off"
    top_k: Positive = 4  # matches recalled (Mastra's `topK`)
    before: Annotated[int, Meta(ge=0)] = 1  # messages before each match, from its thread (Mastra's `messageRange`)
    after: Annotated[int, Meta(ge=0)] = 1  # messages after each match
    threshold: float | None = None  # matches scored below it (cosine) are not recalled
    base_url: str = "https://api.openai.com/v1"  # an OpenAI-compatible embeddings endpoint
    model: str = "text-embedding-3-small"
    api_key: str = ""  # empty: OPENAI_API_KEY
    group: str = "memfilter-embedder"  # `memfilter embedder`'s consumer group on persist-messages
    web_port: Port = 6070  # `memfilter embedder`'s web server (/metrics, /healthz, /readyz), on MEMFILTER_WEB_BIND


class WorkingMemory(
    msgspec.Struct,
    frozen=True,
    rename={"scope": "MEMFILTER_WORKING_MEMORY", "template": "MEMFILTER_WORKING_MEMORY_TEMPLATE", "schema": "MEMFILTER_WORKING_MEMORY_SCHEMA"},
):
    """Working memory (docs/working-memory.md), with Mastra's options: a document per resource
    or per thread, kept up to date by the model through the agent runner's `updateWorkingMemory`
    tool and given to it in every filtered input's context."""

    scope: Literal["off", "resource", "thread"] = "off"  # whose document: the resource's (Mastra's default) or the thread's
    template: str = ""  # a Markdown file: the document's template (empty: Mastra's default)
    schema: str = ""  # a JSON Schema file: the document is JSON of this schema, merged on each update (instead of a template)

    def read(self) -> Any:
        """The document's template (`memfilter.core.working_memory.Template`), or None when off;
        SettingError names a file that will not do."""
        if self.scope == "off":
            return None
        from memfilter.core.working_memory import template_of

        if self.template and self.schema:
            raise SettingError(
                "MEMFILTER_WORKING_MEMORY_TEMPLATE and MEMFILTER_WORKING_MEMORY_SCHEMA are both set: a document has a template or a schema; set one"
            )
        try:
            if self.schema:
                schema = msgspec.json.decode(Path(self.schema).read_bytes())
                if not isinstance(schema, dict):
                    raise SettingError(f"MEMFILTER_WORKING_MEMORY_SCHEMA={self.schema!r} is not a JSON Schema object")
                return template_of(schema=schema)
            return template_of(markdown=Path(self.template).read_text() if self.template else None)
        except (OSError, msgspec.DecodeError) as e:
            name = "MEMFILTER_WORKING_MEMORY_SCHEMA" if self.schema else "MEMFILTER_WORKING_MEMORY_TEMPLATE"
            raise SettingError(f"{name}={self.schema or self.template!r} cannot be read: {e}") from None


class Gateway(
    msgspec.Struct,
    frozen=True,
    rename={
        "port": "MEMFILTER_GATEWAY_PORT",
        "bind": "MEMFILTER_GATEWAY_BIND",
        "auth": "MEMFILTER_GATEWAY_AUTH",
        "jwt_key": "MEMFILTER_GATEWAY_JWT_KEY",
        "jwks_url": "MEMFILTER_GATEWAY_JWKS_URL",
        "issuer": "MEMFILTER_GATEWAY_ISSUER",
        "audience": "MEMFILTER_GATEWAY_AUDIENCE",
        "resource_claim": "MEMFILTER_GATEWAY_RESOURCE_CLAIM",
        "leeway_s": "MEMFILTER_GATEWAY_LEEWAY_S",
        "jwks_refresh_s": "MEMFILTER_GATEWAY_JWKS_REFRESH_S",
        "resource_header": "MEMFILTER_GATEWAY_RESOURCE_HEADER",
        "cors_origins": "MEMFILTER_GATEWAY_CORS_ORIGINS",
        "outcome_s": "MEMFILTER_GATEWAY_OUTCOME_S",
        "reply_s": "MEMFILTER_GATEWAY_REPLY_S",
        "max_in_flight": "MEMFILTER_GATEWAY_MAX_IN_FLIGHT",
        "caller_rate": "MEMFILTER_GATEWAY_CALLER_RATE",
        "caller_burst": "MEMFILTER_GATEWAY_CALLER_BURST",
        "caller_in_flight": "MEMFILTER_GATEWAY_CALLER_IN_FLIGHT",
        "address": "MEMFILTER_GATEWAY_ADDRESS",
    },
):
    """`memfilter gateway`, the HTTP backend of `useChat`."""

    port: Port = 6068
    bind: str = "127.0.0.1"  # loopback unless told otherwise, as the worker's web server
    # who the caller is: `jwt` (a bearer token, verified: the resource is its `sub`), or `header`
    # (a header a proxy in front sets, trusted as it is: behind a proxy or on loopback only)
    auth: Literal["jwt", "header"] = "jwt"
    jwt_key: str = ""  # for `jwt`: an HS256 secret, or a PEM public key (RS256, ES256, EdDSA)
    # for `jwt`, instead of a fixed key: the identity provider's keys (its JWKS, as its OpenID
    # configuration's `jwks_uri` names it), fetched, cached, fetched again on a token of an
    # unknown key id (at most every JWKS_MIN_REFETCH_S) and every `jwks_refresh_s`
    jwks_url: str = ""
    issuer: str = ""  # for `jwt`: the `iss` a token must carry (none checked when empty)
    audience: str = ""  # for `jwt`: an `aud` a token must carry (none checked when empty)
    resource_claim: str = "sub"  # for `jwt`: the claim that names the caller's resource
    leeway_s: Annotated[float, Meta(ge=0, le=300)] = 30.0  # for `jwt`: clock skew allowed on `exp`, `nbf`, `iat`
    jwks_refresh_s: Seconds = 3600.0  # for `jwks_url`: the keys fetched again this often
    resource_header: str = "X-Memfilter-Resource"  # for `header`
    # the origins of pages on other sites that may call the API routes from a browser (CORS),
    # comma-separated: `https://app.example.com,https://staging.example.com`; none: same origin only
    cors_origins: str = ""
    outcome_s: Seconds = 15.0  # seconds a request waits for the worker's decision
    reply_s: Seconds = 120.0  # seconds a request waits for the agent's saved reply
    max_in_flight: Positive = 256  # requests waiting at once, per gateway; more are answered 503
    # per caller (resource), per gateway (`memfilter.gateway.limits`): requests a second, a burst
    # of them, and requests held open at once; more are answered 429 with Retry-After. A person
    # chatting sends far fewer; a caller flooding at this share costs the others nothing
    # measurable (benchmarks/gateway_fairness.py: 0.99 of the calm first-token p50 and p90)
    caller_rate: Annotated[float, Meta(gt=0)] = 0.5
    caller_burst: Positive = 10
    caller_in_flight: Positive = 8
    # the URL the other gateways reach this one at (http://10.1.2.3:6068): the gateways with one
    # share the outcome topics' partitions among themselves, and forward a request to the one
    # whose share its thread is in (`memfilter.gateway.shards`); none: this gateway reads them all
    address: str = ""

    def origins(self) -> list[str]:
        """MEMFILTER_GATEWAY_CORS_ORIGINS, one origin each."""
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]


class Stack(
    msgspec.Struct,
    frozen=True,
    rename={
        "dir": "MEMFILTER_STACK_DIR",
        "kafka_port": "MEMFILTER_KAFKA_PORT",
        "controller_port": "MEMFILTER_CONTROLLER_PORT",
        "redis_port": "MEMFILTER_REDIS_PORT",
        "postgres_port": "MEMFILTER_POSTGRES_PORT",
        "partitions": "MEMFILTER_PARTITIONS",
        "maven_settings": "MEMFILTER_MAVEN_SETTINGS",
        "host": "MEMFILTER_STACK_HOST",
    },
):
    """`memfilter stack`: the local Kafka, Redis and PostgreSQL."""

    dir: str = ""  # default: .stack/ in a checkout, else ~/.local/state/memfilter/stack
    kafka_port: Port = 9092
    controller_port: Port = 9093
    redis_port: Port = 6379
    postgres_port: Port = 5432
    partitions: Positive | None = None  # None: 8 for topics `stack up` makes, existing ones as they are
    maven_settings: str = ""
    # the address the services listen on and are reached at: loopback, or a host's own address
    # where the stack runs in a network namespace (the Jepsen tier's hosts)
    host: str = "127.0.0.1"


PARTS: dict[str, type[msgspec.Struct]] = {
    "kafka": Kafka,
    "redis": Redis,
    "postgres": Postgres,
    "topics": Topics,
    "decisions": Decisions,
    "worker": Worker,
    "agent": Agent,
    "recall": Recall,
    "working_memory": WorkingMemory,
    "gateway": Gateway,
    "stack": Stack,
}
SECRET = "MEMFILTER_SECRET"  # keys server-assigned message ids and signs the processor's persist events


def variables(part: type[msgspec.Struct]) -> list[str]:
    """The environment variables of a part, in field order."""
    return [f.encode_name for f in msgspec.structs.fields(part)]


VARIABLES = [name for part in PARTS.values() for name in variables(part)] + [SECRET]


class Settings(msgspec.Struct, frozen=True):
    kafka: Kafka = Kafka()
    redis: Redis = Redis()
    postgres: Postgres = Postgres()
    topics: Topics = Topics()
    decisions: Decisions = Decisions()
    worker: Worker = Worker()
    agent: Agent = Agent()
    recall: Recall = Recall()
    working_memory: WorkingMemory = WorkingMemory()
    gateway: Gateway = Gateway()
    stack: Stack = Stack()
    secret_text: str = ""

    @classmethod
    def from_env(cls, env: Any = os.environ) -> Settings:
        """The settings in `env`; SettingError names the first variable that will not do."""
        parts = {name: _part(part, env) for name, part in PARTS.items()}
        kafka, redis, worker, stack = parts["kafka"], parts["redis"], parts["worker"], parts["stack"]
        if not _BOOTSTRAP.match(kafka.bootstrap):
            raise SettingError(f"KAFKA_BOOTSTRAP_SERVERS={kafka.bootstrap!r} is not valid: expected host:port[,host:port...]")
        if not redis.url.startswith((*REDIS_SCHEMES, *CLUSTER_SCHEMES)):
            raise SettingError(
                f"REDIS_URL={redis.url!r} is not valid: expected redis://HOST:PORT/DB (or rediss://, unix://), "
                "or redis+cluster://HOST:PORT[,HOST:PORT...] (nodes of a Redis Cluster)"
            )
        if parts["postgres"].url and not parts["postgres"].url.startswith(("postgresql://", "postgres://")):
            raise SettingError(f"POSTGRES_URL={without_password(parts['postgres'].url)!r} is not valid: expected postgresql://USER[:PASSWORD]@HOST:PORT/DB")
        if parts["decisions"].token_counter == "o200k" and importlib.util.find_spec("bpe_openai") is None:
            raise SettingError("MEMFILTER_TOKEN_COUNTER=o200k needs the bpe-openai package (the o200k_base encoding, offline): pip install 'memfilter[tokens]'")
        if parts["gateway"].jwks_url and not parts["gateway"].jwks_url.startswith(("http://", "https://")):
            raise SettingError(f"MEMFILTER_GATEWAY_JWKS_URL={parts['gateway'].jwks_url!r} is not valid: expected an http:// or https:// URL")
        if parts["gateway"].address and not parts["gateway"].address.startswith(("http://", "https://")):
            raise SettingError(
                f"MEMFILTER_GATEWAY_ADDRESS={parts['gateway'].address!r} is not valid: expected the http:// URL the other gateways reach this one at"
            )
        for origin in parts["gateway"].origins():
            if not re.fullmatch(r"https?://[^/\s]+", origin):
                raise SettingError(f"MEMFILTER_GATEWAY_CORS_ORIGINS names {origin!r}: expected origins, scheme://host[:port] each, no path, comma-separated")
        if not parts["recall"].base_url.startswith(("http://", "https://")):
            raise SettingError(f"MEMFILTER_EMBEDDINGS_BASE_URL={parts['recall'].base_url!r} is not valid: expected an http:// or https:// URL")
        if not parts["agent"].base_url.startswith(("http://", "https://")):
            raise SettingError(f"MEMFILTER_AGENT_BASE_URL={parts['agent'].base_url!r} is not valid: expected an http:// or https:// URL")
        parts["working_memory"].read()  # a template that will not do stops the command now
        parts["worker"] = msgspec.structs.replace(worker, data_dir=worker.data_dir or os.path.join(tempfile.gettempdir(), f"memfilter-{worker.group}"))
        parts["stack"] = msgspec.structs.replace(stack, dir=str(Path(stack.dir or _default_stack_dir()).resolve()))
        return cls(**parts, secret_text=env.get(SECRET, ""))

    @property
    def policy(self) -> Policy:
        d = self.decisions
        budget = Budget(d.context_tokens, COUNTERS[d.token_counter], d.context_no_history) if d.context_tokens else None
        limits = Limits(max_bytes=d.max_bytes, max_messages=d.max_messages)
        return Policy(limits, d.history_messages, d.edits == "on", budget, d.reopen_erased == "on", d.concurrent_turns, int(d.turn_wait_s * 1000))

    @property
    def secret(self) -> bytes:
        return self.secret_text.encode()


def _part(part: type[msgspec.Struct], env: Any) -> Any:
    given = {name: env[name] for name in variables(part) if name in env}
    try:
        return msgspec.convert(given, part, strict=False)
    except msgspec.ValidationError as e:
        detail, _, where = str(e).partition(" - at `$.")
        name = where.rstrip("`")
        raise SettingError(f"{name}={given.get(name)!r} is not valid: {detail[0].lower()}{detail[1:]}") from None


def without_password(url: str) -> str:
    """A service's URL as logs and errors show it: its password starred."""
    parts = urlsplit(url)
    return url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1)


def _default_stack_dir() -> Path:
    """`.stack/` in a checkout (where the tests and `deploy/` scripts expect it); for an
    installed package, a folder of the user's state, as XDG says."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").exists():
        return checkout / ".stack"
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "memfilter" / "stack"

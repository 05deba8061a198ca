"""Every setting of the product, from the environment: one typed object, checked when made.

Each environment variable in the README's settings table is one field of `Settings`, with its
type, bounds and default. `Settings.from_env()` converts and checks them all with msgspec (the
same library that checks the wire types), so a bad value stops a command before it starts,
with one line that names the variable and what it takes:

    MEMFILTER_MAX_MESSAGES='abc' is not valid: expected `int`, got `str`

Every command reads its settings here and nowhere else; nothing else in the environment
changes what the product does.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from streams.filter import HISTORY_MESSAGES, Limits
from streams.history import CLUSTER_SCHEMES, PROCESSED_TTL_S, RETRY_WINDOW
from streams.processor import Topics

Port = Annotated[int, Meta(ge=1, le=65535)]
Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0)]

# Field -> environment variable. The field names are what the code reads.
VARIABLES = {
    "bootstrap": "KAFKA_BOOTSTRAP_SERVERS",
    "redis_url": "REDIS_URL",
    "group": "MEMFILTER_GROUP",
    "redis_prefix": "MEMFILTER_REDIS_PREFIX",
    "redis_replicas": "MEMFILTER_REDIS_REPLICAS",
    "redis_replica_timeout": "MEMFILTER_REDIS_REPLICA_TIMEOUT",
    "topic_requests": "MEMFILTER_TOPIC_REQUESTS",
    "topic_filtered": "MEMFILTER_TOPIC_FILTERED",
    "topic_persist": "MEMFILTER_TOPIC_PERSIST",
    "topic_dlq": "MEMFILTER_TOPIC_DLQ",
    "max_bytes": "MEMFILTER_MAX_BYTES",
    "max_messages": "MEMFILTER_MAX_MESSAGES",
    "batch_max": "MEMFILTER_BATCH_MAX",
    "batch_within": "MEMFILTER_BATCH_WITHIN",
    "session_timeout": "MEMFILTER_SESSION_TIMEOUT",
    "processed_ttl": "MEMFILTER_PROCESSED_TTL",
    "retry_window": "MEMFILTER_RETRY_WINDOW",
    "history_messages": "MEMFILTER_HISTORY_MESSAGES",
    "edits": "MEMFILTER_EDITS",
    "secret_text": "MEMFILTER_SECRET",
    "web_port": "MEMFILTER_WEB_PORT",
    "web_bind": "MEMFILTER_WEB_BIND",
    "data_dir": "MEMFILTER_DATA_DIR",
    "stack_dir": "MEMFILTER_STACK_DIR",
    "kafka_port": "MEMFILTER_KAFKA_PORT",
    "controller_port": "MEMFILTER_CONTROLLER_PORT",
    "redis_port": "MEMFILTER_REDIS_PORT",
    "partitions": "MEMFILTER_PARTITIONS",
    "maven_settings": "MEMFILTER_MAVEN_SETTINGS",
    "agent_group": "MEMFILTER_AGENT_GROUP",
    "agent_backend": "MEMFILTER_AGENT_BACKEND",
    "agent_model": "MEMFILTER_AGENT_MODEL",
    "agent_base_url": "MEMFILTER_AGENT_BASE_URL",
    "agent_web_port": "MEMFILTER_AGENT_WEB_PORT",
    "openai_api_key": "OPENAI_API_KEY",
}

# Read by `memfilter agent` only
AGENT_VARIABLES = {"MEMFILTER_AGENT_GROUP", "MEMFILTER_AGENT_BACKEND", "MEMFILTER_AGENT_MODEL", "MEMFILTER_AGENT_BASE_URL", "MEMFILTER_AGENT_WEB_PORT", "OPENAI_API_KEY"}
# Read by `memfilter stack` only
STACK_VARIABLES = {"MEMFILTER_STACK_DIR", "MEMFILTER_KAFKA_PORT", "MEMFILTER_CONTROLLER_PORT", "MEMFILTER_REDIS_PORT", "MEMFILTER_PARTITIONS", "MEMFILTER_MAVEN_SETTINGS"}

_BOOTSTRAP = re.compile(r"^[^\s,:]+:\d{1,5}(,[^\s,:]+:\d{1,5})*$")


class SettingError(ValueError):
    """A setting that will not do: one line naming the variable and the fix."""


class Settings(msgspec.Struct, frozen=True, rename=VARIABLES):
    # Kafka and Redis: every command
    bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    topic_requests: str = "chat-requests"
    topic_filtered: str = "filtered-inputs"
    topic_persist: str = "persist-messages"
    topic_dlq: str = "chat-requests-dlq"
    redis_prefix: str = "mf"
    # a batch commits to Kafka only once its Redis writes are on this many replicas (WAIT)
    redis_replicas: Annotated[int, Meta(ge=0, le=5)] = 0
    redis_replica_timeout: Annotated[float, Meta(gt=0, le=5)] = 1.0  # seconds WAIT waits; then the batch is handled again
    # the worker
    group: str = "memfilter"  # the Faust app id, and so the consumer group
    max_bytes: Positive = 1 << 20
    max_messages: Positive = 1000
    batch_max: Positive = 1500  # records fetched and handled together
    batch_within: Annotated[float, Meta(ge=0)] = 0.05  # seconds a fetch waits to fill a batch
    session_timeout: Seconds = 10.0  # seconds before a silent worker's partitions go to the others
    processed_ttl: Positive = PROCESSED_TTL_S  # seconds: a retry later than this after its original is decided again
    retry_window: Annotated[int, Meta(ge=1, le=1000)] = RETRY_WINDOW  # a thread's last N requests are retry-checked
    history_messages: Annotated[int, Meta(ge=0, le=1000)] = HISTORY_MESSAGES  # rows of the conversation in each context
    edits: Literal["on", "off"] = "on"  # regenerate and edit supersede rows; off: the stored copy wins (Mastra)
    secret_text: str = ""  # keys server-assigned message ids and signs the processor's persist events
    web_port: Port = 6066
    web_bind: str = "127.0.0.1"  # 0.0.0.0 in a container
    data_dir: str = ""  # Faust's data folder; default $TMPDIR/memfilter-<group>
    # `memfilter stack`
    stack_dir: str = ""  # default: .stack/ in a checkout, else ~/.local/state/memfilter/stack
    kafka_port: Port = 9092
    controller_port: Port = 9093
    redis_port: Port = 6379
    partitions: Positive | None = None  # None: 8 for topics `stack up` makes, existing ones as they are
    maven_settings: str = ""
    # `memfilter agent`
    agent_group: str = "memfilter-agent"  # its consumer group on filtered-inputs
    agent_backend: Literal["echo", "openai"] = "echo"
    agent_model: str = "gpt-4o-mini"  # for `openai`
    agent_base_url: str = "https://api.openai.com/v1"  # for `openai`: any OpenAI-compatible endpoint
    agent_web_port: Port = 6067
    openai_api_key: str = ""

    @classmethod
    def from_env(cls, env=os.environ) -> Settings:
        """The settings in `env`; SettingError names the first variable that will not do."""
        given = {name: env[name] for name in VARIABLES.values() if name in env}
        try:
            settings = msgspec.convert(given, cls, strict=False)
        except msgspec.ValidationError as e:
            detail, _, where = str(e).partition(" - at `$.")
            name = where.rstrip("`")
            raise SettingError(f"{name}={given.get(name)!r} is not valid: {detail[0].lower()}{detail[1:]}") from None
        if not _BOOTSTRAP.match(settings.bootstrap):
            raise SettingError(f"KAFKA_BOOTSTRAP_SERVERS={settings.bootstrap!r} is not valid: expected host:port[,host:port...]")
        if not settings.redis_url.startswith(("redis://", "rediss://", "unix://", *CLUSTER_SCHEMES)):
            raise SettingError(
                f"REDIS_URL={settings.redis_url!r} is not valid: expected redis://HOST:PORT/DB (or rediss://, unix://), "
                "or redis+cluster://HOST:PORT[,HOST:PORT...] (nodes of a Redis Cluster)"
            )
        return msgspec.structs.replace(
            settings,
            data_dir=settings.data_dir or os.path.join(tempfile.gettempdir(), f"memfilter-{settings.group}"),
            stack_dir=str(Path(settings.stack_dir or _default_stack_dir()).resolve()),
        )

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_requests, self.topic_filtered, self.topic_persist, self.topic_dlq)

    @property
    def limits(self) -> Limits:
        return Limits(max_bytes=self.max_bytes, max_messages=self.max_messages)

    @property
    def secret(self) -> bytes:
        return self.secret_text.encode()


def _default_stack_dir() -> Path:
    """`.stack/` in a checkout (where the tests and `deploy/` scripts expect it); for an
    installed package, a folder of the user's state, as XDG says."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "pyproject.toml").exists():
        return checkout / ".stack"
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "memfilter" / "stack"

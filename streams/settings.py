"""The worker's settings, all from the environment (names in the README's settings table)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from streams.filter import Limits
from streams.history import PROCESSED_TTL_S
from streams.processor import Topics


@dataclass(frozen=True)
class WorkerSettings:
    bootstrap: str
    redis_url: str
    group: str  # the Faust app id, and so the consumer group
    redis_prefix: str
    topics: Topics
    limits: Limits
    batch_max: int  # records fetched and handled together (requests are decided in lanes of ~100)
    batch_within: float  # seconds a batch waits to fill
    web_port: int
    web_bind: str  # address the web server listens on (0.0.0.0 in a container)
    data_dir: str
    session_timeout: float  # seconds before a silent worker's partitions go to the others
    processed_ttl: int  # seconds a thread's processed-request records outlive its last request
    secret: bytes  # MEMFILTER_SECRET: keys server-assigned message ids and signs the processor's persist events

    @classmethod
    def from_env(cls, env=os.environ) -> WorkerSettings:
        group = env.get("MEMFILTER_GROUP", "memfilter")
        return cls(
            bootstrap=env.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092"),
            redis_url=env.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
            group=group,
            redis_prefix=env.get("MEMFILTER_REDIS_PREFIX", "mf"),
            topics=Topics(
                requests=env.get("MEMFILTER_TOPIC_REQUESTS", "chat-requests"),
                filtered=env.get("MEMFILTER_TOPIC_FILTERED", "filtered-inputs"),
                persist=env.get("MEMFILTER_TOPIC_PERSIST", "persist-messages"),
                dlq=env.get("MEMFILTER_TOPIC_DLQ", "chat-requests-dlq"),
            ),
            limits=Limits(
                max_bytes=int(env.get("MEMFILTER_MAX_BYTES", 1 << 20)),
                max_messages=int(env.get("MEMFILTER_MAX_MESSAGES", 1000)),
            ),
            batch_max=int(env.get("MEMFILTER_BATCH_MAX", 1500)),
            batch_within=float(env.get("MEMFILTER_BATCH_WITHIN", 0.05)),
            web_port=int(env.get("MEMFILTER_WEB_PORT", 6066)),
            web_bind=env.get("MEMFILTER_WEB_BIND", "127.0.0.1"),
            data_dir=env.get("MEMFILTER_DATA_DIR", os.path.join(tempfile.gettempdir(), f"memfilter-{group}")),
            session_timeout=float(env.get("MEMFILTER_SESSION_TIMEOUT", 10)),
            processed_ttl=int(env.get("MEMFILTER_PROCESSED_TTL", PROCESSED_TTL_S)),
            secret=env.get("MEMFILTER_SECRET", "").encode(),
        )

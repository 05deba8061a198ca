"""`memfilter stack`'s address (MEMFILTER_STACK_HOST): what it prints for the parts to reach is
where its services listen, loopback unless told."""

from __future__ import annotations

from pathlib import Path

from memfilter import settings
from memfilter.stack import Settings


def stack(**env: str) -> Settings:
    return Settings.of(settings.Settings.from_env({"MEMFILTER_STACK_DIR": "/tmp/s", **env}))


class TestTheStackIsReachedWhereItListens:
    def test_by_default_everything_is_on_loopback(self):
        s = stack()
        assert (s.host, s.bootstrap, s.redis_url) == ("127.0.0.1", "127.0.0.1:9092", "redis://127.0.0.1:6379/0")
        assert s.postgres_url.endswith("@127.0.0.1:5432/postgres")

    def test_a_host_of_its_own_names_every_service_there(self):
        s = stack(MEMFILTER_STACK_HOST="169.254.7.2", MEMFILTER_KAFKA_PORT="19092")
        assert (s.bootstrap, s.redis_url) == ("169.254.7.2:19092", "redis://169.254.7.2:6379/0")
        assert s.postgres_url.endswith("@169.254.7.2:5432/postgres") and s.dir == Path("/tmp/s")

    def test_a_replicated_stack_on_a_host_names_each_broker_and_node_there(self):
        s = Settings.of(settings.Settings.from_env({"MEMFILTER_STACK_HOST": "169.254.7.2"}), brokers=3, redis_cluster=True)
        assert s.bootstrap == "169.254.7.2:9092,169.254.7.2:9094,169.254.7.2:9096"
        assert s.redis_url.startswith("redis+cluster://169.254.7.2:6379,169.254.7.2:6380")

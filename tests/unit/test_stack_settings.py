"""`memfilter stack`'s addresses (MEMFILTER_STACK_HOST, and `Settings.hosts` for processes on
hosts of their own): what it prints for the parts to reach is where its services listen,
loopback unless told."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from memfilter import settings
from memfilter.stack import Running, Settings, _kafka_properties


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


class TestProcessesOnHostsOfTheirOwn:
    """`Settings.hosts`: each process of the stack on an address of its own (the Jepsen tier's hosts)."""

    def replicated(self) -> Settings:
        s = Settings.of(settings.Settings.from_env({"MEMFILTER_STACK_DIR": "/tmp/s"}), brokers=3, redis_cluster=True)
        return dataclasses.replace(s, hosts=tuple((name, f"169.254.7.{n}") for n, name in enumerate(s.names(), start=2)))

    def test_each_broker_node_and_postgresql_is_named_at_its_own_address(self):
        s = self.replicated()
        assert s.bootstrap == "169.254.7.2:9092,169.254.7.3:9094,169.254.7.4:9096"
        assert s.redis_url == "redis+cluster://" + ",".join(f"169.254.7.{5 + i}:{6379 + i}" for i in range(6))
        assert s.postgres_url.endswith("@169.254.7.11:5432/postgres")

    def test_each_broker_listens_at_its_address_and_knows_the_quorum_at_theirs(self):
        s = self.replicated()
        props = _kafka_properties(s, 1, Path("/tmp/s/kafka-2/data"))
        assert "listeners=PLAINTEXT://169.254.7.3:9094,CONTROLLER://169.254.7.3:9095" in props
        assert "controller.quorum.voters=1@169.254.7.2:9093,2@169.254.7.3:9095,3@169.254.7.4:9097" in props

    def test_the_record_keeps_the_addresses_so_status_and_exports_name_them(self):
        s = self.replicated()
        record = Running({}, s.kafka_port, s.controller_port, s.redis_port, 3, True, s.postgres_port, s.host, [list(h) for h in s.hosts])
        again = Running(**json.loads(json.dumps(dataclasses.asdict(record))))
        assert again.settings(Settings.of(settings.Settings.from_env({"MEMFILTER_STACK_DIR": "/tmp/s"}))) == s
        assert "export KAFKA_BOOTSTRAP_SERVERS=169.254.7.2:9092,169.254.7.3:9094,169.254.7.4:9096" in again.exports(s, "x")

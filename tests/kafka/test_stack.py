"""The local stack: real Kafka and Redis answer, Faust works on them, and failures are clear.

Smoke tests run on the session's stack (see conftest). Failure tests provoke each failure on
a throwaway stack folder and check: one line naming the cause, a non-zero exit, and no
process of that folder left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.structs import TopicPartition
from pipeline import REPO, free_port, read
from stacks import memfilter, stack_env

from memfilter.client import Client
from memfilter.settings import Topics

TOPICS = Topics().all()


def processes_of(folder: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(folder) in cmd and "pytest" not in cmd:
            found.append(f"{proc.name}: {cmd[:120]}")
    return found


def one_line_failure(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.startswith("memfilter stack up:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


async def with_admin(exports: str, call):
    """`call(admin)` with an admin client of the stack whose `stack up` printed `exports`."""
    bootstrap = dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())["KAFKA_BOOTSTRAP_SERVERS"]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return await call(admin)
    finally:
        await admin.close()


def configs_settle(exports: str, topics: list[str], check, timeout: float = 15) -> dict[str, dict[str, str]]:
    """The topics' configs (name -> value) as the broker describes them, once `check` holds of
    them or `timeout` has passed: a broker applies a change of configs from the controller's
    log a moment after the change is answered (KRaft), and describes the old ones until then."""
    deadline = time.monotonic() + timeout
    while True:
        described = asyncio.run(with_admin(exports, lambda admin: admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics])))
        # each resource: (error code, error message, resource type, name, config entries (name, value, ...))
        configs = {r[3]: dict((c[0], c[1]) for c in r[4]) for d in described for r in d.resources}
        if check(configs) or time.monotonic() > deadline:
            return configs
        time.sleep(0.2)


class TestTheStackAnswers:
    @pytest.mark.parametrize("topic", TOPICS)
    def test_each_topic_round_trips_a_keyed_record_through_aiokafka(self, services, topic):
        async def round_trip():
            producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap, acks="all")
            await producer.start()
            value = uuid.uuid4().hex.encode()
            try:
                sent = await producer.send_and_wait(topic, value, key=b"thread-1", headers=[("h", b"1")])
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer(bootstrap_servers=services.bootstrap, enable_auto_commit=False)
            await consumer.start()
            try:
                tp = TopicPartition(topic, sent.partition)
                consumer.assign([tp])
                consumer.seek(tp, sent.offset)
                record = await asyncio.wait_for(consumer.getone(), 20)
            finally:
                await consumer.stop()
            return value, record

        value, record = asyncio.run(round_trip())
        assert (record.key, record.value, list(record.headers)) == (b"thread-1", value, [("h", b"1")])

    def test_topics_have_the_configured_partitions(self, services):
        async def partitions():
            admin = AIOKafkaAdminClient(bootstrap_servers=services.bootstrap)
            await admin.start()
            try:
                return {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(list(TOPICS))}
            finally:
                await admin.close()

        assert asyncio.run(partitions()) == dict.fromkeys(TOPICS, 8)

    def test_up_makes_the_topics_the_settings_name(self, services):
        """Topic names are set in one place: `stack up` makes the ones the workers will read."""
        names = {f"MEMFILTER_TOPIC_{kind}": f"custom-{kind.lower()}-{uuid.uuid4().hex[:8]}" for kind in ("REQUESTS", "FILTERED", "PERSIST", "DLQ")}
        up = memfilter("stack", "up", env=stack_env(**names))
        assert up.returncode == 0, up.stderr
        described = asyncio.run(with_admin(up.stdout, lambda admin: admin.describe_topics(list(names.values()))))
        assert {t["topic"]: len(t["partitions"]) for t in described} == dict.fromkeys(names.values(), 8)

    def test_up_keeps_each_topics_records_as_long_as_the_settings_say_also_on_topics_made_before(self, services):
        """The bound on how long content stays in the topics after an erasure (docs/erasure.md)."""
        names = {
            f"MEMFILTER_TOPIC_{kind}": f"kept-{kind.lower()}-{uuid.uuid4().hex[:8]}" for kind in ("REQUESTS", "FILTERED", "PERSIST", "DLQ", "STREAMS", "STOPS")
        }
        first = memfilter("stack", "up", env=stack_env(**names))
        assert first.returncode == 0, first.stderr
        persist = names["MEMFILTER_TOPIC_PERSIST"]  # an operator's own config of a topic, as docs/erasure.md suggests
        asyncio.run(
            with_admin(first.stdout, lambda admin: admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, persist, configs={"segment.ms": "3600000"})]))
        )
        configs_settle(first.stdout, [persist], lambda configs: configs[persist]["segment.ms"] == "3600000")
        again = memfilter("stack", "up", env=stack_env(**names, MEMFILTER_COPY_RETENTION_DAYS="30", MEMFILTER_LOG_RETENTION_DAYS="0.5"))
        assert again.returncode == 0, again.stderr
        days = 86_400_000
        wanted = {
            names["MEMFILTER_TOPIC_REQUESTS"]: str(30 * days),
            names["MEMFILTER_TOPIC_FILTERED"]: str(30 * days),
            names["MEMFILTER_TOPIC_DLQ"]: str(30 * days),
            names["MEMFILTER_TOPIC_PERSIST"]: str(days // 2),
            names["MEMFILTER_TOPIC_STREAMS"]: "3600000",
            names["MEMFILTER_TOPIC_STOPS"]: "3600000",
        }
        configs = configs_settle(again.stdout, list(names.values()), lambda configs: {t: c["retention.ms"] for t, c in configs.items()} == wanted)
        assert {t: c["retention.ms"] for t, c in configs.items()} == wanted
        assert configs[persist]["segment.ms"] == "3600000"  # kept: Kafka's AlterConfigs would reset what it is not given

    def test_a_redis_lua_script_and_a_pipeline(self, services):
        async def redis_round_trip():
            r = aioredis.from_url(services.redis_url)
            key = f"smoke:{uuid.uuid4().hex}"
            try:
                incr_by = r.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
                assert await incr_by(keys=[key], args=[5]) == 5
                async with r.pipeline(transaction=True) as pipe:
                    results = await pipe.incr(key).get(key).delete(key).execute()
                return results
            finally:
                await r.aclose()

        assert asyncio.run(redis_round_trip()) == [6, b"6", 1]

    def test_a_faust_worker_joins_a_group_and_consumes_one_event(self, services, tmp_path):
        """A Faust worker on the real broker: it joins its group and its agent gets an event."""
        app = tmp_path / "smoke_app.py"
        app.write_text(
            textwrap.dedent(f"""
            import faust, redis
            app = faust.App("smoke-{uuid.uuid4().hex[:8]}", broker="kafka://{services.bootstrap}",
                            web_enabled=False, store="memory://", datadir="{tmp_path}/data")
            topic = app.topic("chat-requests", key_serializer="raw", value_serializer="raw")
            store = redis.Redis.from_url("{services.redis_url}")

            @app.agent(topic)
            async def record(stream):
                async for event in stream.events():
                    store.set(b"faust-smoke:" + event.key, event.value)
            if __name__ == "__main__":
                app.main()
        """)
        )
        key = uuid.uuid4().hex.encode()
        worker = subprocess.Popen(
            [sys.executable, str(app), "worker", "-l", "warn", "--without-web"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        try:
            got = asyncio.run(self._publish_until_seen(services, key))
        finally:
            worker.terminate()
            output = worker.communicate(timeout=30)[0].decode(errors="replace")
        assert got == b"faust says hi", output[-2000:]

    @staticmethod
    async def _publish_until_seen(services, key: bytes) -> bytes | None:
        """Publish one event once the worker's group has partitions, then wait for its effect."""
        r = aioredis.from_url(services.redis_url)
        producer = AIOKafkaProducer(bootstrap_servers=services.bootstrap)
        await producer.start()
        try:
            deadline = time.monotonic() + 90
            sent_at = None
            while time.monotonic() < deadline:
                if sent_at is None or time.monotonic() - sent_at > 10:
                    # Re-sent until seen: the first may land before the worker's group has joined
                    # and is then still consumed (a new group starts from the earliest offset).
                    await producer.send_and_wait("chat-requests", b"faust says hi", key=key)
                    sent_at = time.monotonic()
                value = await r.get(b"faust-smoke:" + key)
                if value is not None:
                    return value
                await asyncio.sleep(0.2)
            return None
        finally:
            await producer.stop()
            await r.aclose()


@pytest.fixture(scope="class")
def second_stack(tmp_path_factory):
    """A stack of its own folder and free ports, for what needs a stack besides the session's."""
    folder = tmp_path_factory.mktemp("second") / "stack"
    ports = {k: str(free_port()) for k in ("MEMFILTER_KAFKA_PORT", "MEMFILTER_CONTROLLER_PORT", "MEMFILTER_REDIS_PORT", "MEMFILTER_POSTGRES_PORT")}
    env = stack_env(MEMFILTER_STACK_DIR=str(folder), MEMFILTER_PARTITIONS="2", **ports)
    up = memfilter("stack", "up", env=env)
    assert up.returncode == 0, up.stderr
    yield env, up
    down = memfilter("stack", "down", env=env)
    assert down.returncode == 0 and processes_of(folder) == []


@pytest.mark.xdist_group("second-stack")  # the class shares one stack of its own
class TestStackUpIsIdempotent:
    def test_up_again_reuses_the_running_stack(self, second_stack):
        env, first = second_stack
        before = memfilter("stack", "status", env=env).stdout
        assert before.startswith("running from")
        again = memfilter("stack", "up", env=env)
        assert again.returncode == 0
        assert again.stdout == first.stdout
        assert "already running" in again.stderr
        assert memfilter("stack", "status", env=env).stdout == before

    def test_status_exits_0_when_everything_runs_and_3_when_nothing_does(self, second_stack, tmp_path):
        env, _ = second_stack
        assert memfilter("stack", "status", env=env).returncode == 0
        stopped = memfilter("stack", "status", env={**env, "MEMFILTER_STACK_DIR": str(tmp_path / "none")})
        assert stopped.returncode == 3 and stopped.stdout.startswith("stopped")

    def test_a_service_that_died_is_named_by_status_and_started_again_by_up_with_its_data(self, second_stack):
        env, first = second_stack
        exports = dict(line.removeprefix("export ").split("=", 1) for line in first.stdout.splitlines())
        redis_pid = int(memfilter("stack", "status", env=env).stdout.split("redis  running  pid ")[1].split()[0])
        asyncio.run(self._redis(exports["REDIS_URL"], "set", "kept", "yes"))
        time.sleep(1.5)  # appendfsync everysec
        os.kill(redis_pid, 9)
        while Path(f"/proc/{redis_pid}").exists() and "zombie" not in Path(f"/proc/{redis_pid}/status").read_text():
            time.sleep(0.1)

        partly = memfilter("stack", "status", env=env)
        assert partly.returncode == 3
        assert partly.stdout.startswith("partly running") and "kafka  running" in partly.stdout and "redis  stopped" in partly.stdout

        again = memfilter("stack", "up", env=env)
        assert again.returncode == 0, again.stderr
        assert "started redis again" in again.stderr and again.stdout == first.stdout
        assert memfilter("stack", "status", env=env).returncode == 0
        assert asyncio.run(self._redis(exports["REDIS_URL"], "get", "kept")) == b"yes"

    def test_up_with_another_shape_than_the_running_stack_is_refused_before_anything_starts(self, second_stack):
        env, _ = second_stack
        result = memfilter("stack", "up", "--brokers", "3", "--redis-cluster", env=env)
        assert result.returncode == 1
        assert "has 1 broker and one Redis, not 3 brokers and a Redis Cluster" in one_line_failure(result)
        assert memfilter("stack", "status", env=env).returncode == 0

    def test_up_with_another_partition_count_than_the_topics_have_is_refused(self, second_stack):
        env, _ = second_stack
        result = memfilter("stack", "up", "--partitions", "4", env=env)
        assert result.returncode == 1
        assert "the stack's topics have [2] partitions, not 4" in one_line_failure(result)

    def test_a_worker_through_a_broker_restart_logs_each_repeated_error_once_per_10_s(self, second_stack, tmp_path):
        env, first = second_stack
        exports = dict(line.removeprefix("export ").split("=", 1) for line in first.stdout.splitlines())
        log = tmp_path / "worker.log"
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "memfilter", "worker", "--web-port", str(free_port())],
                env={**env, **exports, "MEMFILTER_GROUP": f"restart-{uuid.uuid4().hex[:6]}"},
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        try:
            self._wait_for(log, "memfilter worker ready", 1)
            kafka_pid = int(memfilter("stack", "status", env=env).stdout.split("kafka  running  pid ")[1].split()[0])
            before = len(log.read_text().splitlines())
            os.kill(kafka_pid, 9)
            time.sleep(15)
            assert memfilter("stack", "up", env=env).returncode == 0
            assert asyncio.run(self._answered(exports["KAFKA_BOOTSTRAP_SERVERS"])) == ["after-restart"]
            assert worker.poll() is None
        finally:
            worker.terminate()
            worker.wait(30)
        during = log.read_text().splitlines()[before:]
        print(f"\n{len(during)} log lines while the broker was away:\n" + "\n".join(line[:200] for line in during))
        assert len(during) < 40 and any("more like it in the last" in line for line in during)

    @staticmethod
    async def _answered(bootstrap: str) -> list[str]:
        """Publish a request; the request ids of the filtered inputs that come out."""
        thread = f"restart-{uuid.uuid4().hex[:6]}"
        content = {"format": 2, "parts": [{"type": "text", "text": "still there?"}]}
        body = {"requestId": "after-restart", "threadId": thread, "resourceId": "u", "messages": [{"id": f"{thread}-u", "role": "user", "content": content}]}
        async with Client(bootstrap) as client:
            await client.publish([body])
        found = await read(bootstrap, ["filtered-inputs"], lambda rs: any(r.key == thread.encode() for r in rs), timeout=120)
        return [json.loads(r.value)["requestId"] for r in found if r.key == thread.encode()]

    @staticmethod
    def _wait_for(log: Path, text: str, times: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while log.read_text().count(text) < times:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

    @staticmethod
    async def _redis(url: str, *command: str):
        client = aioredis.from_url(url)
        try:
            return await client.execute_command(*command)
        finally:
            await client.aclose()

    def test_a_stack_of_another_folder_on_the_same_ports_is_named(self, second_stack, tmp_path):
        env, _ = second_stack
        other = {**env, "MEMFILTER_STACK_DIR": str(tmp_path / "stack")}
        line = one_line_failure(memfilter("stack", "up", env=other))
        assert "held by a stack of another folder" in line and env["MEMFILTER_STACK_DIR"] in line
        assert processes_of(tmp_path) == []


class TestFailuresAreOneLineAndLeaveNothingRunning:
    def test_no_java(self, tmp_path):
        env = stack_env(MEMFILTER_STACK_DIR=str(tmp_path / "stack"), PATH=str(tmp_path))
        line = one_line_failure(memfilter("stack", "up", env=env))
        assert "no `java` on PATH" in line
        assert processes_of(tmp_path) == []

    def test_maven_unreachable(self, tmp_path):
        settings = tmp_path / "settings.xml"
        settings.write_text(
            textwrap.dedent(f"""
            <settings>
              <localRepository>{tmp_path}/m2</localRepository>
              <mirrors><mirror><id>nowhere</id><mirrorOf>*</mirrorOf><url>http://127.0.0.1:9/</url></mirror></mirrors>
            </settings>
        """)
        )
        ports = {k: str(free_port()) for k in ("MEMFILTER_KAFKA_PORT", "MEMFILTER_CONTROLLER_PORT", "MEMFILTER_REDIS_PORT", "MEMFILTER_POSTGRES_PORT")}
        env = stack_env(MEMFILTER_STACK_DIR=str(tmp_path / "stack"), MEMFILTER_MAVEN_SETTINGS=str(settings), **ports)
        line = one_line_failure(memfilter("stack", "up", env=env))
        assert "Maven could not fetch the Kafka jars" in line
        assert processes_of(tmp_path) == []

    def test_a_port_taken_by_another_program(self, tmp_path):
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            env = stack_env(
                MEMFILTER_STACK_DIR=str(tmp_path / "stack"),
                MEMFILTER_KAFKA_PORT=str(free_port()),
                MEMFILTER_CONTROLLER_PORT=str(free_port()),
                MEMFILTER_REDIS_PORT=str(port),
            )
            line = one_line_failure(memfilter("stack", "up", env=env))
        assert f"port {port} for Redis is taken by pid {os.getpid()}" in line
        assert "MEMFILTER_REDIS_PORT" in line
        assert processes_of(tmp_path) == []

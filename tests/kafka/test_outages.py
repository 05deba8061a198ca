"""A worker started before Kafka or Redis answers waits for them, not ready meanwhile and saying
what it waits for, and works once they answer; a running worker and agent runner wait out a
Kafka outage the same way, and a batch whose transaction the outage failed is handled again
in-process: an orchestrator's restarts are not needed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import asyncpg
from aiokafka import AIOKafkaConsumer
from factories import msg
from pipeline import Pipeline, free_port, publish, read, redis_config, wait_for_line
from stacks import memfilter, stack_env, start_redis

from memfilter.client import Client


def request(thread: str, request_id: str) -> dict:
    return {"requestId": request_id, "threadId": thread, "resourceId": "r-out", "messages": [msg(f"{thread}-u1")]}


def not_ready(port: int) -> str:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
    except urllib.error.HTTPError as e:
        return e.read().decode()
    raise AssertionError("ready while waiting")


def readiness(port: int, timeout: float = 30) -> str:
    """`/readyz`'s answer once it is ready, or the last one after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as reply:
                return reply.read().decode()
        except urllib.error.HTTPError as e:
            if time.monotonic() > deadline:
                return e.read().decode()
        time.sleep(0.5)


def answered(pipeline: Pipeline, thread: str, request_id: str) -> list[str]:
    async def go():
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            await client.publish([request(thread, request_id)])
        return await read(pipeline.bootstrap, [pipeline.topics.filtered], lambda rs: len(rs) >= 1, timeout=90)

    return [json.loads(r.value)["requestId"] for r in asyncio.run(go())]


def test_a_worker_started_before_kafka_waits_saying_so_and_works_once_kafka_answers(services, tmp_path):
    ports = {
        "MEMFILTER_KAFKA_PORT": str(free_port()),
        "MEMFILTER_CONTROLLER_PORT": str(free_port()),
        "MEMFILTER_REDIS_PORT": str(free_port()),
        "MEMFILTER_POSTGRES_PORT": str(free_port()),
    }
    pipeline = Pipeline(f"127.0.0.1:{ports['MEMFILTER_KAFKA_PORT']}", services.redis_url)
    env = stack_env(MEMFILTER_STACK_DIR=str(tmp_path / "stack"), MEMFILTER_PARTITIONS="2", **ports, **pipeline.settings_env())
    try:
        worker = pipeline.start_worker()
        log = wait_for_line(pipeline.log_path(0), f"memfilter worker: waiting for Kafka at {pipeline.bootstrap}")
        assert worker.poll() is None and "Traceback" not in log, log[-2000:]
        assert "waiting for Kafka" in not_ready(worker.web_port)
        up = memfilter("stack", "up", env=env)  # Kafka on that port, with the pipeline's topics
        assert up.returncode == 0, up.stderr
        wait_for_line(pipeline.log_path(0), "memfilter worker ready", timeout=120)
        assert answered(pipeline, "out-k", "out-k1") == ["out-k1"]
    finally:
        pipeline.stop_all()
        memfilter("stack", "down", env=env)


def test_a_worker_started_before_redis_waits_saying_so_and_works_once_redis_answers(services, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    pipeline = Pipeline(services.bootstrap, url)
    asyncio.run(pipeline.create_topics())
    server = None
    try:
        worker = pipeline.start_worker()
        log = wait_for_line(pipeline.log_path(0), "Redis unavailable while taking an owner epoch")
        assert worker.poll() is None and "Traceback" not in log, log[-2000:]
        assert "Redis not answering" in not_ready(worker.web_port)
        server = start_redis(*redis_config(tmp_path, port))
        wait_for_line(pipeline.log_path(0), "memfilter worker ready", timeout=60)
        assert answered(pipeline, "out-r", "out-r1") == ["out-r1"]
    finally:
        pipeline.stop_all()
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(10)


def stack_pids(env: dict[str, str]) -> dict[str, int]:
    lines = memfilter("stack", "status", env=env).stdout.splitlines()[1:]
    return {name: int(pid) for name, state, _, pid, *_ in (line.split() for line in lines) if state == "running"}


def committed_request_ids(pipeline: Pipeline, expected: int, timeout: float = 90) -> list[str]:
    """The request ids of the committed filtered inputs, once `expected` are there (or the time is up)."""

    async def go():
        consumer = AIOKafkaConsumer(
            pipeline.topics.filtered, bootstrap_servers=pipeline.bootstrap, auto_offset_reset="earliest", isolation_level="read_committed"
        )
        await consumer.start()
        ids: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(ids) < expected and time.monotonic() < deadline:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    ids += [json.loads(r.value)["requestId"] for r in records]
            await asyncio.sleep(2)  # anything more (a second copy) would come by now
            for records in (await consumer.getmany(timeout_ms=500)).values():
                ids += [json.loads(r.value)["requestId"] for r in records]
        finally:
            await consumer.stop()
        return ids

    return asyncio.run(go())


def publish_one(pipeline: Pipeline, thread: str, request_id: str) -> None:
    async def go():
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            await client.publish([request(thread, request_id)])

    asyncio.run(go())


def test_a_worker_and_an_agent_wait_out_a_kafka_outage_with_a_batch_in_flight_and_answer_everything_once(services, tmp_path):
    """Kafka is SIGKILLed while the worker holds a decided batch (Redis stalled under it, then
    resumed), so the batch's transaction meets a dead broker; Kafka comes back 20 s later. Its
    transaction then completes, or fails and is handled again in-process (the module header of
    `memfilter.runtime.loop`). Then the broker hangs (SIGSTOP) for a while. Meanwhile the worker
    and the agent runner say they wait for Kafka (log and `/readyz`); afterwards both are up and
    ready, and every request is answered once. Last, the sink waits out Kafka killed while it
    holds a save the workers have not applied (it asks the workers' group for its offsets until
    a broker answers), then writes it to PostgreSQL."""
    ports = {
        "MEMFILTER_KAFKA_PORT": str(free_port()),
        "MEMFILTER_CONTROLLER_PORT": str(free_port()),
        "MEMFILTER_REDIS_PORT": str(free_port()),
        "MEMFILTER_POSTGRES_PORT": str(free_port()),
    }
    bootstrap, redis_url = f"127.0.0.1:{ports['MEMFILTER_KAFKA_PORT']}", f"redis://127.0.0.1:{ports['MEMFILTER_REDIS_PORT']}/0"
    pipeline = Pipeline(bootstrap, redis_url)
    env = stack_env(MEMFILTER_STACK_DIR=str(tmp_path / "stack"), MEMFILTER_PARTITIONS="2", **ports, **pipeline.settings_env())
    try:
        up = memfilter("stack", "up", env=env)
        assert up.returncode == 0, up.stderr
        worker, agent = pipeline.start_worker(), pipeline.start_agent()
        wait_for_line(worker.log_path, "memfilter worker ready", timeout=60)
        publish_one(pipeline, "kill-a", "kill-a1")
        assert committed_request_ids(pipeline, 1) == ["kill-a1"]

        pids = stack_pids(env)
        os.kill(pids["redis"], signal.SIGSTOP)  # the next batch is decided and held there
        publish_one(pipeline, "kill-b", "kill-b1")
        wait_for_line(worker.log_path, "Redis unavailable while handling a batch", timeout=60)
        os.kill(pids["kafka"], signal.SIGKILL)
        os.kill(pids["redis"], signal.SIGCONT)  # its transaction now goes to a broker that is gone

        wait_for_line(worker.log_path, f"memfilter worker: waiting for Kafka at {bootstrap}", timeout=30)
        wait_for_line(agent.log_path, f"memfilter agent: waiting for Kafka at {bootstrap}", timeout=30)
        assert f"waiting for Kafka at {bootstrap}" in not_ready(worker.web_port)
        assert f"waiting for Kafka at {bootstrap}" in not_ready(agent.web_port)
        time.sleep(10)
        assert worker.poll() is None and agent.poll() is None

        again = memfilter("stack", "up", env=env)  # Kafka back, its data kept
        assert again.returncode == 0, again.stderr
        wait_for_line(worker.log_path, f"memfilter worker: Kafka at {bootstrap} answers again", timeout=60)
        wait_for_line(agent.log_path, f"memfilter agent: Kafka at {bootstrap} answers again", timeout=60)
        publish_one(pipeline, "kill-c", "kill-c1")
        assert sorted(committed_request_ids(pipeline, 3)) == ["kill-a1", "kill-b1", "kill-c1"]

        broker = stack_pids(env)["kafka"]
        os.kill(broker, signal.SIGSTOP)  # a broker that hangs rather than refuses
        try:
            wait_for_line(worker.log_path, "(no answer within 5 s)", timeout=30)
            wait_for_line(agent.log_path, "(no answer within 5 s)", timeout=30)
            assert "no answer within 5 s" in not_ready(worker.web_port)
        finally:
            os.kill(broker, signal.SIGCONT)
        publish_one(pipeline, "kill-d", "kill-d1")
        ids = committed_request_ids(pipeline, 4)
        log, agent_log = worker.log_path.read_text(), agent.log_path.read_text()
        assert sorted(ids) == ["kill-a1", "kill-b1", "kill-c1", "kill-d1"], log[-3000:]
        assert worker.poll() is None and agent.poll() is None, log[-3000:] + agent_log[-3000:]
        assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
        assert "Traceback" not in agent_log and "unexpected error" not in agent_log, agent_log[-3000:]
        assert readiness(worker.web_port) == readiness(agent.web_port) == "ready\n"

        postgres_url = f"postgresql://memfilter@127.0.0.1:{ports['MEMFILTER_POSTGRES_PORT']}/postgres"
        sink = pipeline.start_sink(POSTGRES_URL=postgres_url)
        wait_for_line(sink.log_path, f"memfilter sink: {pipeline.topics.persist} into", timeout=60)  # its web server listens
        assert readiness(sink.web_port) == "ready\n"
        os.kill(worker.pid, signal.SIGSTOP)  # the workers' group commits nothing more: the sink holds the save below
        try:
            save = {"requestId": "saved-by-a-service", "threadId": "kill-a", "resourceId": "r-out", "messages": [msg("kill-a-saved", role="assistant")]}
            asyncio.run(publish(pipeline.bootstrap, pipeline.topics.persist, [(b"kill-a", json.dumps(save).encode(), None)]))
            time.sleep(3)  # the sink has it, and asks for the workers' offsets
            os.kill(stack_pids(env)["kafka"], signal.SIGKILL)
            group = pipeline.settings_env()["MEMFILTER_GROUP"]  # the workers'
            wait_for_line(sink.log_path, f"memfilter sink: Kafka did not give group {group}'s committed offsets", timeout=60)
            assert f"reading group {group}'s committed offsets" in not_ready(sink.web_port) and sink.poll() is None
            assert memfilter("stack", "up", env=env).returncode == 0
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        deadline = time.monotonic() + 90
        while "kill-a-saved" not in asyncio.run(postgres_ids(postgres_url, pipeline.prefix, "kill-a")):
            assert time.monotonic() < deadline and sink.poll() is None, sink.log_path.read_text()[-3000:]
            time.sleep(1)
        assert "Traceback" not in sink.log_path.read_text(), sink.log_path.read_text()[-3000:]
    finally:
        pipeline.stop_all()
        memfilter("stack", "down", env=env)


async def postgres_ids(url: str, schema: str, thread: str) -> list[str]:
    """The ids of a thread's messages in PostgreSQL (none before the sink made its tables)."""
    connection = await asyncpg.connect(url)
    try:
        return [r["id"] for r in await connection.fetch(f'SELECT id FROM "{schema}".mastra_messages WHERE thread_id = $1', thread)]
    except asyncpg.UndefinedTableError:
        return []
    finally:
        await connection.close()


def test_a_gateway_whose_redis_is_down_answers_503_unavailable_and_keeps_no_callers_hold(services, tmp_path):
    """Found on a host of its own (tests/jepsen, the gateway cut from Redis): a Redis error
    while a thread's route read its owner was a 500, and each resume kept one of its caller's
    MEMFILTER_GATEWAY_CALLER_IN_FLIGHT holds for good, so the caller was refused 429 ever after."""
    conf, url = redis_config(tmp_path)
    server = start_redis(conf, url)
    pipeline = Pipeline(services.bootstrap, url)
    asyncio.run(pipeline.create_topics())
    try:
        port = pipeline.start_gateway("redis-down", MEMFILTER_GATEWAY_AUTH="header", MEMFILTER_GATEWAY_CALLER_IN_FLIGHT="2")
        server.kill()
        server.wait(10)

        def get(path: str) -> tuple[int, dict]:
            call = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"X-Memfilter-Resource": "r-down"})
            try:
                with urllib.request.urlopen(call, timeout=30) as answer:
                    return answer.status, {}
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read() or b"{}")

        answers = [get("/api/chat/t-down/stream") for _ in range(4)] + [get("/api/threads/t-down/messages")]
        assert all(status == 503 and body["error"]["code"] == "unavailable" for status, body in answers), answers
        assert "Redis did not answer" in answers[0][1]["error"]["message"]
        server = start_redis(conf, url)
        assert get("/api/chat/t-down/stream")[0] == 204  # nothing being made, and no hold of the four left over
    finally:
        pipeline.stop_all()
        server.send_signal(signal.SIGTERM)
        server.wait(10)

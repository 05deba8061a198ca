"""A worker started before Kafka or Redis answers waits for them, not ready meanwhile and saying
what it waits for, and works once they answer: an orchestrator's restarts are not needed."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request

from factories import msg
from pipeline import Pipeline, free_port, read, redis_config, wait_for_line
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


def answered(pipeline: Pipeline, thread: str, request_id: str) -> list[str]:
    async def go():
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            await client.publish([request(thread, request_id)])
        return await read(pipeline.bootstrap, [pipeline.topics.filtered], lambda rs: len(rs) >= 1, timeout=90)

    return [json.loads(r.value)["requestId"] for r in asyncio.run(go())]


def test_a_worker_started_before_kafka_waits_saying_so_and_works_once_kafka_answers(services, tmp_path):
    ports = {"MEMFILTER_KAFKA_PORT": str(free_port()), "MEMFILTER_CONTROLLER_PORT": str(free_port()), "MEMFILTER_REDIS_PORT": str(free_port())}
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

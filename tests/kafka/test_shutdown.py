"""SIGTERM or SIGINT ends a worker or an agent runner within MEMFILTER_SHUTDOWN_S in every
state, outages included, with one line saying it stopped; what it had not committed is left to
the next owner, as after a crash."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import threading
import time

from pipeline import WORKER_LOGS, Pipeline, read, redis_config, wait_for_line
from stacks import start_redis

from memfilter.client import Client

SHUTDOWN_S = "3"


def request(thread: str, request_id: str) -> dict:
    content = {"format": 2, "parts": [{"type": "text", "text": "hello"}]}
    return {"requestId": request_id, "threadId": thread, "resourceId": "r-stop", "messages": [{"id": f"{thread}-u", "role": "user", "content": content}]}


def seconds_to_exit(process: subprocess.Popen, sent: signal.Signals, limit: float = 60) -> float:
    start = time.monotonic()
    process.send_signal(sent)
    process.wait(limit)
    return time.monotonic() - start


def test_an_idle_worker_stops_at_once_on_sigint_saying_so_once(services):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    try:
        worker = pipeline.start_worker(MEMFILTER_SHUTDOWN_S=SHUTDOWN_S)
        wait_for_line(pipeline.log_path(0), "memfilter worker ready")
        took = seconds_to_exit(worker, signal.SIGINT)
    finally:
        pipeline.stop_all()
    log = pipeline.log_path(0).read_text()
    assert took < float(SHUTDOWN_S) and worker.returncode == 0, log[-2000:]
    assert "-INT-" not in log and log.count("memfilter worker stopped") == 1, log[-2000:]


def test_a_worker_waiting_for_a_hung_redis_stops_within_its_bound_and_the_next_one_answers(services, tmp_path):
    conf, url = redis_config(tmp_path)
    server = start_redis(conf, url)
    pipeline = Pipeline(services.bootstrap, url)
    asyncio.run(pipeline.create_topics())
    try:
        worker = pipeline.start_worker(MEMFILTER_SHUTDOWN_S=SHUTDOWN_S)
        wait_for_line(pipeline.log_path(0), "memfilter worker ready")
        server.send_signal(signal.SIGSTOP)

        async def publish() -> None:
            async with Client(pipeline.bootstrap, pipeline.topics) as client:
                await client.publish([request("stop-1", "stop-r1")])

        asyncio.run(publish())
        wait_for_line(pipeline.log_path(0), "Redis unavailable while handling a batch")
        took = seconds_to_exit(worker, signal.SIGTERM)
        log = pipeline.log_path(0).read_text()
        server.send_signal(signal.SIGCONT)
        pipeline.start_worker()  # the next owner of the partitions answers what the first left
        filtered = asyncio.run(read(pipeline.bootstrap, [pipeline.topics.filtered], lambda rs: len(rs) >= 1, timeout=90))
    finally:
        server.send_signal(signal.SIGCONT)
        pipeline.stop_all()
        server.terminate()
        server.wait(10)
    assert took < float(SHUTDOWN_S) + 5, log[-2000:]
    assert worker.returncode == 128 + signal.SIGTERM.value
    assert f"memfilter worker stopped: not done within {SHUTDOWN_S} s of SIGTERM" in log, log[-2000:]
    assert [json.loads(r.value)["requestId"] for r in filtered] == ["stop-r1"]


def test_an_agent_waiting_for_a_model_that_never_answers_stops_within_its_bound(services):
    """The model's endpoint accepts connections and never answers."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held: list[socket.socket] = []
    accepting = threading.Thread(target=lambda: [held.append(silent.accept()[0]) for _ in range(16)], daemon=True)
    accepting.start()
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    asyncio.run(pipeline.create_topics())
    try:
        pipeline.start_worker()
        agent = pipeline.start_agent(
            MEMFILTER_SHUTDOWN_S=SHUTDOWN_S,
            MEMFILTER_AGENT_BACKEND="openai",
            MEMFILTER_AGENT_BASE_URL=f"http://127.0.0.1:{silent.getsockname()[1]}/v1",
            OPENAI_API_KEY="sk-test",
        )
        agent_log = WORKER_LOGS / f"memfilter-test-{pipeline.name}-agent1.log"  # after one worker
        wait_for_line(agent_log, "memfilter agent ready")

        async def publish() -> None:
            async with Client(pipeline.bootstrap, pipeline.topics) as client:
                await client.publish([request("stop-2", "stop-r2")])

        asyncio.run(publish())
        deadline = time.monotonic() + 60
        while not held and time.monotonic() < deadline:  # the model is being asked
            time.sleep(0.1)
        assert held, agent_log.read_text()[-2000:]
        took = seconds_to_exit(agent, signal.SIGINT)
        log = agent_log.read_text()
    finally:
        pipeline.stop_all()
        silent.close()
        for connection in held:
            connection.close()
    assert took < float(SHUTDOWN_S) + 5, log[-2000:]
    assert f"memfilter agent stopped: not done within {SHUTDOWN_S} s of SIGINT" in log and "-INT-" not in log, log[-2000:]

"""The command line as a user and an operator meet it: settings, the worker's start, publish,
tail, history and replay, each through the real command (`python -m memfilter`), on the
session's Kafka and Redis where it needs them."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from pipeline import REPO, WORKER_LOGS, Pipeline, free_port, read, redis_config, wait_for_line
from stacks import memfilter

from memfilter.client import Client, InvalidRequest
from memfilter.runtime.logs import Repeats

SAMPLE = REPO / "deploy" / "samples" / "conversation.jsonl"


def one_error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def request(thread: str, text: str, request_id: str | None = None) -> dict:
    content = {"format": 2, "parts": [{"type": "text", "text": text}]}
    body = {"threadId": thread, "resourceId": "user-cli", "messages": [{"id": f"{thread}-u", "role": "user", "content": content}]}
    return {**body, "requestId": request_id} if request_id else body


class TestSettingsAreCheckedAtStart:
    @pytest.mark.parametrize(
        "command, name, value, says",
        [
            (("worker",), "MEMFILTER_MAX_MESSAGES", "abc", "expected `int`, got `str`"),
            (("worker",), "MEMFILTER_WEB_PORT", "x", "expected `int`, got `str`"),
            (("worker",), "MEMFILTER_BATCH_MAX", "0", "expected `int` >= 1"),
            (("worker",), "MEMFILTER_SESSION_TIMEOUT", "-1", "expected `float` > 0.0"),
            (("replay",), "REDIS_URL", "localhost:6379", "expected redis://HOST:PORT/DB"),
            (("publish",), "KAFKA_BOOTSTRAP_SERVERS", "localhost", "expected host:port"),
            (("stack", "status"), "MEMFILTER_KAFKA_PORT", "99999", "expected `int` <= 65535"),
        ],
    )
    def test_a_bad_value_is_one_line_naming_the_variable(self, command, name, value, says):
        result = memfilter(*command, env={**os.environ, name: value})
        assert result.returncode == 2
        line = one_error_line(result)
        assert line.startswith(f"memfilter {command[0]}: {name}={value!r} is not valid: ") and says in line

    def test_a_redis_url_pointing_at_a_web_server_is_one_line_for_a_command(self, services):
        class Hello(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        server = HTTPServer(("127.0.0.1", 0), Hello)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"redis://127.0.0.1:{server.server_port}/0"
            env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": services.bootstrap, "REDIS_URL": url, "MEMFILTER_SECRET": "x" * 16}
            history = memfilter("history", "show", "t1", env=env, timeout=60)
        finally:
            server.shutdown()
        assert history.returncode == 1 and "Redis does not answer as Redis" in one_error_line(history)


class TestAKafkaThatDoesNotAnswer:
    @pytest.mark.parametrize("command", [("tail",), ("replay",), ("history", "rebuild")])  # a worker waits: tests/kafka/test_outages.py
    def test_is_one_line_with_nothing_of_aiokafkas_before_it(self, services, command):
        silent = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": silent, "REDIS_URL": services.redis_url, "MEMFILTER_SECRET": "x" * 16}
        result = memfilter(*command, env=env, timeout=120)
        assert result.returncode == 1
        line = one_error_line(result)
        assert f"Kafka at {silent} does not answer" in line and "set KAFKA_BOOTSTRAP_SERVERS" in line


class TestTheWorkerSaysWhatItDoes:
    def test_it_says_it_started_and_which_tasks_it_took_at_the_default_log_level(self, pipeline):
        pipeline.start_worker()
        log = wait_for_line(pipeline.log_path(0), "memfilter worker ready: 8 tasks [0, 1, 2, 3, 4, 5, 6, 7] (16 partitions of")
        version = importlib.metadata.version("memfilter")
        assert f"memfilter worker {version} starting: group memfilter-{pipeline.name}, Kafka {pipeline.bootstrap}" in log

    def test_a_second_worker_on_the_same_web_port_is_one_line(self, pipeline):
        first = pipeline.start_worker()
        wait_for_line(pipeline.log_path(0), "memfilter worker ready")
        second = pipeline.memfilter("worker", "--web-port", str(first.web_port), timeout=60)
        assert second.returncode == 1
        assert "each worker on a host needs its own port: --web-port or MEMFILTER_WEB_PORT" in one_error_line(second)

    def test_a_hung_redis_is_named_every_time_the_worker_gives_up_waiting_and_nothing_is_lost(self, services, tmp_path):
        conf, url = redis_config(tmp_path)
        server = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL)
        pipeline = Pipeline(services.bootstrap, url)
        asyncio.run(pipeline.create_topics())
        try:
            time.sleep(0.5)
            pipeline.start_worker()
            wait_for_line(pipeline.log_path(0), "memfilter worker ready")
            server.send_signal(signal.SIGSTOP)

            async def publish_and_read():
                async with Client(pipeline.bootstrap, pipeline.topics) as client:
                    await client.publish([request("hung-1", "hello", "hung-r1")])
                await asyncio.sleep(25)  # two of the worker's 10 s waits for an answer
                server.send_signal(signal.SIGCONT)
                return await read(pipeline.bootstrap, [pipeline.topics.filtered], lambda rs: len(rs) >= 1, timeout=60)

            filtered = asyncio.run(publish_and_read())
            log = pipeline.log_path(0).read_text()
        finally:
            server.send_signal(signal.SIGCONT)
            pipeline.stop_all()
            server.terminate()
            server.wait(10)
        assert [json.loads(r.value)["requestId"] for r in filtered] == ["hung-r1"]
        waits = [line for line in log.splitlines() if "Redis unavailable while handling a batch" in line]
        assert len(waits) >= 2 and "()" not in "".join(waits), log[-2000:]
        assert "(no answer within 10 s)" in waits[0]


class TestMissingRelayTopics:
    """An upgraded deployment whose relay topics are not made yet (docs/operations.md: Upgrading)."""

    def test_a_gateway_names_them_in_one_line_and_exits_1(self, pipeline):
        result = pipeline.memfilter(
            "gateway", "--port", str(free_port()), MEMFILTER_TOPIC_STREAMS=f"missing-{pipeline.name}", MEMFILTER_GATEWAY_AUTH="header", timeout=60
        )
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert f"topics missing-{pipeline.name} do not exist on {pipeline.bootstrap}: `memfilter stack up` makes them" in result.stderr

    def test_an_agent_runner_waits_for_them_saying_which(self, pipeline):
        pipeline.start_agent(MEMFILTER_TOPIC_STOPS=f"missing-{pipeline.name}")
        wait_for_line(WORKER_LOGS / f"memfilter-test-{pipeline.name}-agent0.log", f"waiting for topics missing-{pipeline.name}: create them")


class TestRepeatedLogLinesAreHeldBack:
    def test_a_flood_of_one_error_is_one_line_per_window_saying_how_many_were_held_back(self):
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        handler.addFilter(Repeats(window=0.5))
        log = logging.getLogger("test-repeats")
        log.addHandler(handler)
        log.propagate = False
        try:
            for node in range(300):
                log.error("Unable connect to node %d", node % 3)
            log.error("Unable connect to node 1 (another reason)")
            log.warning("another message")
            log.critical("never held back")
            log.critical("never held back")
            time.sleep(0.6)
            log.error("Unable connect to node %d", 7)
        finally:
            log.removeHandler(handler)
        assert lines == [
            "Unable connect to node 0",
            "Unable connect to node 1 (another reason)",
            "another message",
            "never held back",
            "never held back",
            "Unable connect to node 7 [and 299 more like it in the last 1 s]",
        ]


class TestPublish:
    def test_every_bad_request_is_named_by_item_and_nothing_is_sent(self, pipeline, tmp_path):
        good = request("p-1", "hi")
        bad_role = {**request("p-2", "x"), "messages": [{"id": "m", "role": "tool", "content": "x"}]}
        no_thread = {"resourceId": "u", "messages": []}
        array = tmp_path / "requests.json"
        array.write_text(json.dumps([good, bad_role, good, no_thread]))
        result = pipeline.memfilter("publish", str(array))
        assert result.returncode == 1
        errors = result.stderr.strip().splitlines()
        assert [e.split(":")[1].strip() for e in errors[:2]] == ["item 2", "item 4"]
        assert errors[2] == "memfilter publish: 2 invalid requests; nothing published (--skip-invalid sends the valid ones)"

    def test_one_request_is_one_request_and_progress_is_not_written_to_a_pipe(self, pipeline, tmp_path):
        one = tmp_path / "one.jsonl"
        one.write_text(json.dumps(request("p-3", "hi")) + "\n")
        result = pipeline.memfilter("publish", str(one))
        assert result.returncode == 0 and result.stdout.strip() == f"published 1 request to {pipeline.topics.requests}"
        assert "\r" not in result.stderr

    def test_an_empty_input_is_an_error(self, pipeline, tmp_path):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("\n\n")
        result = pipeline.memfilter("publish", str(empty))
        assert result.returncode == 2 and "no requests in the input" in one_error_line(result)


class TestTail:
    @pytest.mark.parametrize("flag", ["--max", "--idle-ms"])
    @pytest.mark.parametrize("value", ["0", "-1"])
    def test_a_count_or_wait_below_one_is_refused_by_the_subcommand(self, flag, value):
        result = memfilter("tail", flag, value)
        assert result.returncode == 2
        assert result.stderr.splitlines()[0].startswith("usage: memfilter tail") and "is not a whole number of 1 or more" in result.stderr

    def test_an_unknown_flag_prints_the_subcommands_usage(self):
        result = memfilter("tail", "--bogus")
        assert result.returncode == 2 and result.stderr.startswith("usage: memfilter tail")

    def test_meta_shows_partition_offset_key_and_headers_and_a_short_wait_still_sees_the_events(self, pipeline):
        asyncio.run(self._publish(pipeline, 3))
        result = pipeline.memfilter("tail", pipeline.topics.requests, "--from-beginning", "--json", "--meta", "--idle-ms", "1")
        events = [json.loads(line) for line in result.stdout.splitlines()]
        assert len(events) == 3
        assert {e["key"] for e in events} == {"m-0", "m-1", "m-2"}
        assert all(e["topic"] == pipeline.topics.requests and e["offset"] >= 0 and e["headers"] == {} for e in events)
        assert {e["value"]["threadId"] for e in events} == {"m-0", "m-1", "m-2"}

    def test_meta_in_text_shows_headers_as_name_value_pairs_not_python(self, pipeline):
        asyncio.run(self._publish(pipeline, 1))
        pipeline.start_worker()
        result = pipeline.memfilter("tail", pipeline.topics.filtered, "--from-beginning", "--meta", "--max", "1", "--idle-ms", "60000")
        first = result.stdout.splitlines()[0]
        assert first.startswith(f"{pipeline.topics.filtered}-") and "key=m-0" in first, result.stdout
        assert "{" not in first and "'" not in first, first

    def test_a_reader_that_goes_away_ends_it_without_a_traceback(self, pipeline):
        asyncio.run(self._publish(pipeline, 1000))  # more than a pipe holds: tail writes into a closed one
        command = f"{sys.executable} -m memfilter tail {pipeline.topics.requests} --from-beginning --json --idle-ms 5000 | head -1"
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=pipeline.env(), cwd=REPO, timeout=60)
        assert len(result.stdout.splitlines()) == 1 and "Traceback" not in result.stderr and result.stderr == ""

    @staticmethod
    async def _publish(pipeline, n: int) -> None:
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            await client.publish([request(f"m-{i}", "hi") for i in range(n)])


class TestClient:
    def test_publish_takes_dicts_and_returns_the_ids_the_filtered_inputs_carry(self, pipeline):
        pipeline.start_worker()

        async def run():
            async with Client(pipeline.bootstrap, pipeline.topics) as client:
                ids = await client.publish([request("c-1", "hi", "c-given"), request("c-2", "hello")])
                filtered = await read(pipeline.bootstrap, [pipeline.topics.filtered], lambda rs: len(rs) >= 2)
            return ids, filtered

        ids, filtered = asyncio.run(run())
        assert ids[0] == "c-given" and ids[1].startswith(f"{pipeline.topics.requests}-")
        assert sorted(json.loads(r.value)["requestId"] for r in filtered) == sorted(ids)

    def test_a_request_the_processor_would_reject_raises_and_nothing_is_sent(self, pipeline):
        tool = {**request("c-3", "x"), "messages": [{"id": "m", "role": "tool", "content": "x"}]}

        async def run():
            async with Client(pipeline.bootstrap, pipeline.topics) as client:
                with pytest.raises(InvalidRequest, match=r"request 1 would be rejected \(schema\)"):
                    await client.publish([request("c-4", "fine"), tool])
            return await read(pipeline.bootstrap, [pipeline.topics.requests], lambda rs: False, timeout=3)

        assert asyncio.run(run()) == []


class TestHistoryPrefixes:
    def test_rebuild_and_drop_refuse_the_prefix_workers_run_on_and_leftovers_can_be_listed_and_dropped(self, pipeline):
        pipeline.start_worker()
        wait_for_line(pipeline.log_path(0), "memfilter worker ready")
        asyncio.run(TestTail._publish(pipeline, 3))

        for action in (("rebuild",), ("drop", "--prefix", pipeline.prefix)):
            refused = pipeline.memfilter("history", *action)
            assert refused.returncode == 1
            assert f"1 worker of group memfilter-{pipeline.name} runs on prefix {pipeline.prefix}; stop it before" in one_error_line(refused)

        leftover = f"{pipeline.prefix}-rebuilt"
        rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", leftover)
        assert rebuilt.returncode == 0, rebuilt.stderr
        listed = pipeline.memfilter("history", "prefixes").stdout
        assert f"{leftover}  " in listed and f"{pipeline.prefix}  " in listed
        dropped = pipeline.memfilter("history", "drop", "--prefix", leftover)
        assert dropped.returncode == 0 and dropped.stdout.startswith(f"dropped prefix {leftover}: ")
        assert f"{leftover}  " not in pipeline.memfilter("history", "prefixes").stdout


class TestReplayCommand:
    def test_a_report_into_a_missing_folder_is_refused_before_anything_is_read(self, pipeline, tmp_path):
        started = time.monotonic()
        result = pipeline.memfilter("replay", "--report", str(tmp_path / "no-such-folder" / "report.json"))
        assert result.returncode == 2 and "cannot write the report" in one_error_line(result)
        assert time.monotonic() - started < 30

    def test_a_request_that_differs_is_named_by_its_request_id(self, pipeline):
        asyncio.run(self._publish_unprocessed(pipeline))
        result = pipeline.memfilter("replay")
        assert "DIFFERENT never-processed (thread r-1, " in result.stdout
        assert "replayed 1 requests: 0 identical, 1 different" in result.stdout

    @staticmethod
    async def _publish_unprocessed(pipeline) -> None:
        async with Client(pipeline.bootstrap, pipeline.topics) as client:
            await client.publish([request("r-1", "hi", "never-processed")])


def run_local_env(services) -> dict[str, str]:
    """`deploy/run-local.sh`'s environment on the test stack, with web ports of its own."""
    return {
        **os.environ,
        "MEMFILTER_STACK_DIR": str(services.stack_dir or REPO / ".stack" / "tests"),
        "MEMFILTER_KAFKA_PORT": services.bootstrap.rsplit(":", 1)[1],
        "MEMFILTER_REDIS_PORT": services.redis_url.rsplit(":", 1)[1].split("/")[0],
        "MEMFILTER_CONTROLLER_PORT": os.environ.get("MEMFILTER_CONTROLLER_PORT", "19093"),
        "MEMFILTER_WEB_PORT": str(free_port()),
        "MEMFILTER_AGENT_WEB_PORT": str(free_port()),
        "MEMFILTER_GATEWAY_PORT": str(free_port()),
        "MEMFILTER_SINK_WEB_PORT": str(free_port()),
    }


@pytest.mark.xdist_group("default-topics")  # run-local uses the default topics, groups and prefix: one at a time
def test_run_local_runs_the_loop_and_shows_what_the_model_saw_and_what_is_stored(services):
    """The whole loop: the client's turns, each answered by the agent, one tool round trip, a
    regenerate and an edit; the stored thread has the client's conversation, then the two
    answers they superseded, marked; PostgreSQL holds the same rows."""
    result = subprocess.run(["bash", "deploy/run-local.sh"], capture_output=True, text=True, env=run_local_env(services), cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "< assistant: echo: Find me a flight from Lisbon to Oslo on May 3." in out
    assert '< assistant: [pickSeat({"flight": "TP1234"}) call]' in out
    assert '> assistant: [pickSeat({"flight": "TP1234"}) result -> ' in out  # the client's answer to the call
    # the model's answer to the result continues the call's message, as useChat keeps it
    assert any(line.startswith('< assistant: [pickSeat({"flight": "TP1234"}) result -> ') and "pickSeat returned" in line for line in out.splitlines())
    assert out.count("    superseded (out of the conversation, still stored): ") == 2
    assert "> user: Thanks. Print my itinerary and the seat map." in out
    stored, held = out.split("--- the thread as it is stored")[1].split("--- the thread as PostgreSQL holds it")
    assert stored.count("(superseded by request ") == 2
    # three answers (the answer to the tool's result continues the call's message) and the two superseded
    assert stored.count("assistant") == 3 + 2 and "Print my itinerary and the seat map." in stored
    held, end = held.split("--- logs")  # the sink wrote the same thread to PostgreSQL
    assert held.count("| assistant |") == 3 + 2 and "(8 rows)" in held
    # not at a terminal: it says its processes stop, and how to stop the stack it leaves running
    assert end.splitlines()[-2:] == [
        "--- not at a terminal: the worker, the agent, the sink and the gateway stop now; run this at a terminal to keep the chat page served",
        "--- the stack keeps running (memfilter stack status); stop it with: .venv/bin/memfilter stack down",
    ]


@pytest.mark.xdist_group("default-topics")  # run-local uses the default topics, groups and prefix: one at a time
def test_run_local_exits_1_when_its_worker_stops(services, tmp_path):
    """`deploy/run-local.sh` on the test stack, with the worker's web port taken: it says the
    worker exited and shows the end of its log, instead of showing earlier runs' events."""
    env = run_local_env(services)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        env["MEMFILTER_WEB_PORT"] = str(holder.getsockname()[1])
        result = subprocess.run(["bash", "deploy/run-local.sh"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "run-local: the worker exited" in result.stderr and "each worker on a host needs its own port" in result.stderr


@pytest.mark.xdist_group("default-topics")  # run-local runs deploy/setup.sh: one at a time
def test_run_local_stops_at_once_with_the_stacks_reason_when_a_port_is_taken(tmp_path):
    """A stack that cannot start stops the script at once, `stack up`'s line (which names the
    setting that moves the port) its last word: no worker waited for, no conversation tried."""
    ports = {k: str(free_port()) for k in ("MEMFILTER_KAFKA_PORT", "MEMFILTER_CONTROLLER_PORT", "MEMFILTER_REDIS_PORT")}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        env = {**os.environ, "MEMFILTER_STACK_DIR": str(tmp_path / "stack"), "MEMFILTER_POSTGRES_PORT": str(taken), **ports}
        result = subprocess.run(["bash", "deploy/run-local.sh"], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"memfilter stack up: port {taken} for PostgreSQL is taken by " in result.stderr and "set MEMFILTER_POSTGRES_PORT" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("memfilter stack up: port "), result.stderr  # its line is the last word
    assert "--- the conversation" not in result.stdout and "stack status" not in result.stdout
    assert not (tmp_path / "stack" / "running.json").exists()

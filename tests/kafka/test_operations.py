"""What operators do with a running processor: audit replay, history rebuild and show, metrics and health.

One stream is processed once for the module (the sample session, 120 interleaved requests, and
a thread whose assistant turn another service saves between two requests); the tests then
replay it, rebuild its history and read the worker's metrics, all on the real Kafka and Redis.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import subprocess
import time

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from pipeline import REPO, Collector, Pipeline, dump, end_offsets, free_port, header, local_get, publish, read, redis_config
from stacks import memfilter
from test_worker_streams import stream

from memfilter.store import reads
from memfilter.store.history import HistoryStore
from memfilter.store.redis_driver import connect

pytestmark = pytest.mark.xdist_group("operations")  # the module's workers and records are shared (`--dist loadgroup`)

SAMPLE = REPO / "deploy" / "samples" / "conversation.jsonl"
CALL = {"state": "call", "toolCallId": "c1", "toolName": "confirm", "args": {"what": "a table for two"}}


def now_ms() -> int:
    return int(time.time() * 1000)


def request(thread: str, k: int, messages: list[dict]) -> tuple[bytes, bytes, int]:
    body = {"requestId": f"{thread}-r{k}", "threadId": thread, "resourceId": "user-ops", "messages": messages}
    return thread.encode(), json.dumps(body).encode(), now_ms()


def user(thread: str, k: int) -> dict:
    return {"id": f"{thread}-u{k}", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": f"message {k}"}]}}


def assistant(thread: str, invocation: dict) -> dict:
    return {"id": f"{thread}-a0", "role": "assistant", "content": {"format": 2, "parts": [{"type": "tool-invocation", "toolInvocation": invocation}]}}


async def a_tool_turn(pipeline: Pipeline, seen: Collector, thread: str, tamper: bool = False) -> None:
    """r0 saves the user message; another service saves the assistant's pending tool call; the
    client then sends the call's result (r1). With `tamper`, the stored call is altered in the
    live history before r1 is processed."""
    t = pipeline.topics
    await publish(pipeline.bootstrap, t.requests, [request(thread, 0, [user(thread, 0)])])
    assert await seen.wait_for(lambda recs: any(r.key == thread.encode() for r in recs if r.topic == t.filtered))
    saved = dict(assistant(thread, CALL), createdAt="2026-11-30T00:00:00.000Z")
    event = {"requestId": f"{thread}-runner", "threadId": thread, "resourceId": "user-ops", "messages": [saved]}
    await publish(pipeline.bootstrap, t.persist, [(thread.encode(), json.dumps(event).encode(), now_ms())])
    client, store = pipeline.store()
    deadline = time.monotonic() + 60
    while len(await reads.thread_rows(store, thread)) < 2:
        assert time.monotonic() < deadline, "the persister did not save the runner's event"
        await asyncio.sleep(0.1)
    if tamper:
        altered = dict(saved, content={"format": 2, "parts": [{"type": "tool-invocation", "toolInvocation": dict(CALL, args={"what": "TAMPERED"})}]})
        await client.hset(store.keys(thread).rows, saved["id"], json.dumps(altered))
    await client.aclose()
    answered = assistant(thread, dict(CALL, state="result", result={"booked": True}))
    await publish(pipeline.bootstrap, t.requests, [request(thread, 1, [user(thread, 0), answered])])
    assert await seen.wait_for(lambda recs: sum(r.key == thread.encode() for r in recs if r.topic == t.filtered) == 2)


async def a_reply_before_its_thread(pipeline: Pipeline, seen: Collector, thread: str) -> None:
    """A reply saved before the thread's first request: refused (`ownership`, no owner yet);
    then two requests. A rebuild or replay must not apply the refused reply after the first
    request (it would then be in the second's context)."""
    t = pipeline.topics
    early = {"requestId": f"{thread}-early", "threadId": thread, "resourceId": "user-ops", "messages": [dict(assistant(thread, CALL), id=f"{thread}-early")]}
    await publish(pipeline.bootstrap, t.persist, [(thread.encode(), json.dumps(early).encode(), now_ms())])
    assert await seen.wait_for(lambda recs: any(r.key == thread.encode() for r in recs if r.topic == t.dlq))
    await publish(pipeline.bootstrap, t.requests, [request(thread, 0, [user(thread, 0)])])
    assert await seen.wait_for(lambda recs: any(r.key == thread.encode() for r in recs if r.topic == t.filtered))
    await publish(pipeline.bootstrap, t.requests, [request(thread, 1, [user(thread, 0), user(thread, 1)])])


@pytest.fixture(scope="module")
def processed(services):
    """The stream, processed by one worker: (pipeline, worker, requests published, end offsets
    of chat-requests after the normal part, before the tampered thread). The sample's last
    request is published twice: the second is a `duplicate`, and a replay must agree."""
    # A Redis database of the module's own: its replays' keys (`replay-*`) are the only ones there.
    pipeline = Pipeline(services.bootstrap, services.redis_url.rsplit("/", 1)[0] + "/7", postgres_url=services.postgres_url)
    t = pipeline.topics

    async def run():
        await pipeline.create_topics()
        worker = pipeline.start_worker()
        async with Collector(pipeline.bootstrap, [t.filtered, t.dlq]) as seen:
            sample = [(json.loads(line)["threadId"].encode(), line.encode(), now_ms()) for line in SAMPLE.read_text().splitlines()]
            await publish(pipeline.bootstrap, t.requests, sample)
            await publish(pipeline.bootstrap, t.requests, stream(threads=40, turns=3, tag="ops"))
            await a_tool_turn(pipeline, seen, "runner-t")
            await a_reply_before_its_thread(pipeline, seen, "early-reply-t")
            await publish(pipeline.bootstrap, t.requests, sample[-1:])  # the same request again: a client's retry
            assert await seen.wait_for(lambda recs: len(recs) >= len(sample) + 120 + 2 + 3 + 1)
            normal_end = await end_offsets(pipeline.bootstrap, t.requests)
            await a_tool_turn(pipeline, seen, "tamper-t", tamper=True)
            return worker, len(sample) + 1 + 120 + 2 + 4, normal_end

    worker, published, normal_end = asyncio.run(run())
    yield pipeline, worker, published, normal_end
    pipeline.stop_all()


class TestReplay:
    def test_a_range_processed_normally_replays_with_no_difference(self, processed, tmp_path):
        pipeline, _, published, normal_end = processed
        report = tmp_path / "report.json"
        result = pipeline.memfilter("replay", "--to", normal_end, "--strict", "--report", str(report))
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip().endswith(f"replayed {published - 2} requests: {published - 2} identical, 0 different")
        assert json.loads(report.read_text())["different"] == 0

    def test_a_stored_row_changed_before_its_request_was_processed_is_named(self, processed, tmp_path):
        pipeline, _, published, normal_end = processed
        report = tmp_path / "report.json"
        result = pipeline.memfilter("replay", "--strict", "--report", str(report))
        assert result.returncode == 1
        assert f"replayed {published} requests: {published - 1} identical, 1 different" in result.stdout
        [difference] = json.loads(report.read_text())["differences"]
        assert difference["requestId"] == "tamper-t-r1" and difference["threadId"] == "tamper-t"
        assert any("TAMPERED" in line and "a table for two" in line for line in difference["diff"])

        only_the_tampered_part = pipeline.memfilter("replay", "--from", normal_end)
        assert only_the_tampered_part.returncode == 0  # differences reported, exit 0 without --strict
        assert "replayed 2 requests: 1 identical, 1 different" in only_the_tampered_part.stdout
        assert "DIFFERENT tamper-t-r1" in only_the_tampered_part.stdout

    def test_a_retry_is_a_duplicate_in_the_replay_too_when_the_range_starts_after_its_original(self, processed):
        pipeline, _, _, normal_end = processed
        letters = asyncio.run(read(pipeline.bootstrap, [pipeline.topics.dlq], until=lambda recs: len(recs) == 2, timeout=10))
        [letter] = [r for r in letters if header(r, "error.type") == "duplicate"]  # the other: the reply refused before its thread
        assert header(letter, "memfilter.duplicate-of")
        partition, offset = int(header(letter, "source.partition")), int(header(letter, "source.offset"))
        only_it = {p: (offset if p == partition else 10**9) for p in range(pipeline.partitions)}
        result = pipeline.memfilter("replay", "--strict", "--from", ",".join(f"{p}:{o}" for p, o in only_it.items()), "--to", f"{offset + 1}")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "replayed 1 requests: 1 identical, 0 different" in result.stdout

    def test_a_missing_topic_or_a_silent_broker_is_one_line_and_exit_1(self, processed):
        pipeline, *_ = processed
        missing = pipeline.memfilter("replay", MEMFILTER_TOPIC_REQUESTS="no-such-topic")
        assert missing.returncode == 1
        assert missing.stderr.strip().splitlines()[-1].startswith("memfilter replay: topic no-such-topic does not exist on ")
        silent = pipeline.memfilter("replay", KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}")
        assert silent.returncode == 1 and silent.stderr.strip().splitlines()[-1].endswith("does not answer; set KAFKA_BOOTSTRAP_SERVERS")

    def test_replay_leaves_no_keys_behind_and_never_touches_the_live_history(self, processed):
        pipeline, *_ = processed

        async def keys():
            client, _ = pipeline.store()
            found = [k async for k in client.scan_iter(match="replay-*")]
            await client.aclose()
            return found

        assert asyncio.run(keys()) == []


class TestHistory:
    def test_rebuild_into_an_empty_redis_restores_every_thread_as_live(self, processed):
        pipeline, *_ = processed
        empty = pipeline.redis_url.rsplit("/", 1)[0] + "/1"  # another database of the same server
        assert asyncio.run(dump(pipeline, pipeline.prefix, empty)) == {}
        result = pipeline.memfilter("history", "rebuild", "--redis-url", empty)
        assert result.returncode == 0, result.stderr
        live, rebuilt = asyncio.run(dump(pipeline, pipeline.prefix)), asyncio.run(dump(pipeline, pipeline.prefix, empty))
        assert len(live) > 130  # rows, order and meta of 44 threads, and the id index
        assert rebuilt == live  # the tampered row too: the processor saved it, altered, with its result
        # with the stack's PostgreSQL (POSTGRES_URL), the rebuild filled it too, and the two agree
        assert asyncio.run(postgres_conversations(pipeline)) == asyncio.run(redis_conversations(pipeline, empty))

        again = pipeline.memfilter("history", "rebuild", "--redis-url", empty)
        assert again.returncode == 0 and asyncio.run(dump(pipeline, pipeline.prefix, empty)) == rebuilt  # idempotent

    def test_show_prints_a_thread_in_save_order(self, processed):
        pipeline, *_ = processed
        shown = pipeline.memfilter("history", "show", "runner-t", "--json")
        assert [json.loads(line)["id"] for line in shown.stdout.splitlines()] == ["runner-t-u0", "runner-t-a0"]
        readable = pipeline.memfilter("history", "show", "ops3").stdout.splitlines()
        assert [line.split()[1] for line in readable] == ["ops3-u0", "ops3-u1", "ops3-u2"]
        missing = pipeline.memfilter("history", "show", "no-such-thread")
        assert missing.returncode == 1 and "no-such-thread has no stored messages" in missing.stderr


async def postgres_conversations(pipeline) -> dict[str, list[str]]:
    """Each thread's conversation as PostgreSQL holds it (message ids in order)."""
    import asyncpg

    conn = await asyncpg.connect(pipeline.postgres_url)
    try:
        threads = await conn.fetch(f'SELECT id FROM "{pipeline.prefix}".mastra_threads')
        rows = await conn.fetch(f'SELECT thread_id, id FROM "{pipeline.prefix}".mastra_messages WHERE position IS NOT NULL ORDER BY position')
    finally:
        await conn.close()
    out: dict[str, list[str]] = {t["id"]: [] for t in threads}
    for r in rows:
        out[r["thread_id"]].append(r["id"])
    return out


async def redis_conversations(pipeline, url: str) -> dict[str, list[str]]:
    """Each thread's conversation as the Redis at `url` holds it."""
    client = connect(url)
    store = HistoryStore(client, pipeline.prefix)
    try:
        return {t: [json.loads(r)["id"] for r in await reads.thread_rows(store, t)] async for batch in reads.thread_batches(store) for t in batch}
    finally:
        await client.aclose()


def sample_value(text: str, name: str, **labels: str) -> float:
    want = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + want + " ") or line == name + want)


class TestMetricsAndHealth:
    def test_metrics_count_what_was_published(self, processed):
        pipeline, worker, published, _ = processed
        status, text = local_get(worker.web_port, "/metrics")
        assert status == 200
        total = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("memfilter_requests_total{"))
        assert total == published
        assert sample_value(text, "memfilter_requests_total", outcome="tool-outcomes") == 2
        assert sample_value(text, "memfilter_requests_total", outcome="duplicate") == 1  # the retry
        assert sample_value(text, "memfilter_dead_letters_total", error_type="duplicate") == 1
        assert sample_value(text, "memfilter_persisted_total") == 2  # the runner's two saves
        assert sample_value(text, "memfilter_end_to_end_seconds_count") == published
        # where batches' time went, a sample a batch and phase (a batch fetched across a
        # rebalance is not handled; an empty fetch can commit a position past markers; a batch
        # with nothing to send leaves its offsets to a later commit)
        phases = {
            p: sample_value(text, "memfilter_batch_phase_seconds_count", phase=p) for p in ("waiting", "previous-commit", "catch-up", "handling", "committing")
        }
        assert phases["handling"] >= 4  # the module's stream came in at least four steps
        assert (
            phases["previous-commit"] == phases["catch-up"] >= phases["handling"] and phases["committing"] >= phases["waiting"]
        )  # each batch of requests commits
        assert 1 <= phases["waiting"] <= phases["catch-up"]  # batches holding requests: their time in Kafka
        assert sample_value(text, "memfilter_batch_phase_seconds_sum", phase="waiting") > 0
        assert sample_value(text, "memfilter_assigned_partitions") == 16
        assert sample_value(text, "process_resident_memory_bytes") > 10_000_000  # the standard collectors too
        assert sample_value(text, "process_cpu_seconds_total") > 0
        assert 'python_info{implementation="CPython"' in text and "python_gc_collections_total" in text

    def test_an_idle_worker_has_no_lag_in_its_metrics_nor_in_its_groups_committed_offsets(self, processed):
        """The last records of a `persist-messages` partition are transaction markers (the
        worker's own commits): committed past them, a `lag > 0` alert clears when idle."""
        pipeline, worker, *_ = processed
        t = pipeline.topics

        def lags() -> list[float]:
            text = local_get(worker.web_port, "/metrics")[1]
            return [float(line.split()[-1]) for line in text.splitlines() if line.startswith("memfilter_consumer_lag{")]

        deadline = time.monotonic() + 30
        while (len(lags()) != 16 or any(lags())) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(lags()) == 16 and not any(lags()), lags()

        async def group_lag() -> dict[str, int]:
            admin = AIOKafkaAdminClient(bootstrap_servers=pipeline.bootstrap)
            await admin.start()
            try:
                committed = await admin.list_consumer_group_offsets(pipeline.env()["MEMFILTER_GROUP"])
            finally:
                await admin.close()
            ends = {}
            for topic in (t.requests, t.persist):
                ends.update(
                    {TopicPartition(topic, int(p)): int(o) for p, o in (x.split(":") for x in (await end_offsets(pipeline.bootstrap, topic)).split(","))}
                )
            return {f"{tp.topic}-{tp.partition}": end - committed[tp].offset for tp, end in ends.items() if end != committed[tp].offset}

        assert asyncio.run(group_lag()) == {}

    def test_readyz_goes_not_ready_when_redis_stops_and_ready_when_it_is_back(self, services, tmp_path):
        conf, url = redis_config(tmp_path)
        server = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL)
        pipeline = Pipeline(services.bootstrap, url)
        asyncio.run(pipeline.create_topics())
        try:
            worker = pipeline.start_worker()
            assert wait_for_status(worker.web_port, "/readyz", 200), "the worker never became ready"
            assert local_get(worker.web_port, "/healthz") == (200, "ok\n")
            server.terminate()
            server.wait(10)
            assert wait_for_status(worker.web_port, "/readyz", 503)
            assert "Redis not answering" in local_get(worker.web_port, "/readyz")[1]
            server = subprocess.Popen(["redis-server", str(conf)], stdout=subprocess.DEVNULL)
            assert wait_for_status(worker.web_port, "/readyz", 200)
        finally:
            pipeline.stop_all()
            server.terminate()
            server.wait(10)


def wait_for_status(port: int, path: str, status: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if local_get(port, path)[0] == status:
                return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def test_fausts_own_environment_variables_do_not_change_the_worker(pipeline):
    """Kubernetes service links inject `WEB_PORT=tcp://10.0.0.1:80`-style variables, which
    Faust reads as its settings: only the worker's documented settings may change it."""
    worker = pipeline.start_worker(WEB_PORT="tcp://10.0.0.1:80", WEB_BIND="0.0.0.0")
    assert wait_for_status(worker.web_port, "/healthz", 200), pipeline.log_path(0).read_text()[-2000:]
    assert worker.poll() is None


class TestCommandLine:
    def test_version_is_printed(self):
        result = memfilter("--version")
        assert result.returncode == 0 and result.stdout.strip() == f"memfilter {importlib.metadata.version('memfilter')}"

    def test_history_show_without_a_thread_says_the_thread_is_required(self):
        result = memfilter("history", "show")
        assert result.returncode == 2 and "the following arguments are required: thread" in result.stderr

    def test_history_rebuild_refuses_a_stray_argument_instead_of_ignoring_it(self):
        result = memfilter("history", "rebuild", "mf-new")
        assert result.returncode == 2 and "unrecognized arguments: mf-new" in result.stderr

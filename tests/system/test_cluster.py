"""Past one machine: three Kafka brokers and a Redis Cluster (three masters, a replica each),
with brokers and Redis masters killed, a failover forced and slots moved under running workers.

Requests here are full echoes of a user-only conversation: turn k of a thread sends u0..uk,
and its `persist-messages` event saves uk alone. So a lost Redis write shows in the very next
request: the echo of a message the store no longer has is saved again. Every check reads with
read_committed, as downstream does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter, defaultdict

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from factories import T0
from pipeline import Collector, Pipeline, dump, publish
from redis.crc import key_slot
from stacks import cluster_env, memfilter

from memfilter.core.filtered import whole
from memfilter.store import reads

pytestmark = [
    pytest.mark.replicated,
    pytest.mark.xdist_group("replicated"),
]  # one replicated stack, whose brokers and nodes these tests kill (`--dist loadgroup`)


def request(thread: str, k: int) -> tuple[bytes, bytes, int]:
    """Turn k of a thread: the whole conversation so far, u0..uk."""
    text = lambda i: {"format": 2, "parts": [{"type": "text", "text": f"question {i}"}]}  # noqa: E731
    messages = [{"id": f"{thread}-u{i}", "role": "user", "content": text(i)} for i in range(k + 1)]
    body = {"requestId": f"{thread}-r{k}", "threadId": thread, "resourceId": "r", "messages": messages}
    return thread.encode(), json.dumps(body).encode(), T0 + k


class Cluster:
    """The replicated test stack's processes, as `memfilter stack status` lists them."""

    def __init__(self):
        self.env = cluster_env()

    def pids(self) -> dict[str, int]:
        lines = memfilter("stack", "status", env=self.env).stdout.splitlines()[1:]
        return {name: int(pid) for name, state, _, pid, *_ in (line.split() for line in lines) if state == "running"}

    def up(self) -> None:
        """Start what was killed (a Redis node rejoins as a replica) and wait for a healthy cluster."""
        done = memfilter("stack", "up", "--brokers", "3", "--redis-cluster", env=self.env)
        assert done.returncode == 0, done.stderr

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        pid = self.pids()[name]
        os.kill(pid, sig)
        while sig == signal.SIGKILL and os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read():
            time.sleep(0.05)

    @staticmethod
    def redis(port: int, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=60).stdout

    def nodes(self) -> list[list[str]]:
        """`CLUSTER NODES` as a node still running sees it."""
        port = next(int(name.split("-")[1]) for name in self.pids() if name.startswith("redis-"))
        return [line.split() for line in self.redis(port, "cluster", "nodes").splitlines()]

    def shard_of(self, key: str) -> tuple[int, int]:
        """The ports of the master serving `key` and of its replica."""
        slot, nodes = key_slot(key.encode()), self.nodes()
        for node in nodes:
            ranges = [r.split("-") for r in node[8:] if not r.startswith("[")]
            if "master" in node[2] and "fail" not in node[2] and any(int(r[0]) <= slot <= int(r[-1]) for r in ranges):
                replica = next(n for n in nodes if n[3] == node[0] and "fail" not in n[2])
                return int(node[1].split(":")[1].split("@")[0]), int(replica[1].split(":")[1].split("@")[0])
        raise AssertionError(f"no master serves slot {slot}")

    def reshard(self, source: str, target: str, slots: int) -> subprocess.Popen:
        """Move `slots` slots from master `source` to master `target` (node ids): started, not awaited."""
        port = next(n[1] for n in self.nodes() if n[0] == source).split(":")[1].split("@")[0]
        return subprocess.Popen(
            [
                "redis-cli",
                "--cluster",
                "reshard",
                f"127.0.0.1:{port}",
                "--cluster-from",
                source,
                "--cluster-to",
                target,
                "--cluster-slots",
                str(slots),
                "--cluster-yes",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def cut_off(self, master: int, replica: int) -> None:
        """The replica stops taking its master's writes: stopped (SIGSTOP), and its link closed
        by the master, so that what the master writes next stays in the master."""
        self.kill(f"redis-{replica}", signal.SIGSTOP)
        assert int(self.redis(master, "client", "kill", "type", "replica")) == 1

    def take_over(self, port: int) -> None:
        """Make the replica on `port` the master of its shard now (its master is gone)."""
        assert self.redis(port, "cluster", "failover", "takeover").strip() == "OK"
        deadline = time.monotonic() + 30
        while "role:master" not in self.redis(port, "info", "replication") or "cluster_state:ok" not in self.redis(port, "cluster", "info"):
            assert time.monotonic() < deadline, "the takeover did not complete"
            time.sleep(0.1)


async def rows_of(pipeline: Pipeline, thread: str, prefix: str | None = None) -> list[str]:
    client, store = pipeline.store()
    store.prefix = prefix or store.prefix
    try:
        return [json.loads(r)["id"] for r in await reads.thread_rows(store, thread)]
    finally:
        await client.aclose()


def filtered_of(records, thread: str) -> list[dict]:
    return [whole(json.loads(r.value)) for r in records if r.key == thread.encode() and r.topic.startswith("filtered-inputs")]


def saved_of(records, thread: str) -> list[list[str]]:
    """The ids each of the thread's `persist-messages` events saves, in order."""
    events = [json.loads(r.value) for r in records if r.key == thread.encode() and r.topic.startswith("persist-messages")]
    return [[m["id"] for m in e["messages"]] for e in events]


def test_the_replicated_stack_is_three_brokers_and_three_masters_with_a_replica_each(cluster_services):
    pids = Cluster().pids()
    assert sorted(n for n in pids if n.startswith("kafka")) == ["kafka-1", "kafka-2", "kafka-3"]
    nodes = Cluster().nodes()
    masters = [n for n in nodes if "master" in n[2]]
    assert len(masters) == 3 and all(sum(n[3] == m[0] for n in nodes) == 1 for m in masters)
    assert all(Cluster.redis(int(n[1].split(":")[1].split("@")[0]), "config", "get", "appendfsync").split() == ["appendfsync", "everysec"] for n in nodes)

    async def replication() -> tuple[set, str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=cluster_services.bootstrap)
        await admin.start()
        try:
            topics = await admin.describe_topics(["chat-requests", "__transaction_state"])
            configs = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, "chat-requests")])
            isr = next(c[1] for c in configs[0].resources[0][4] if c[0] == "min.insync.replicas")
            return {len(p["replicas"]) for t in topics for p in t["partitions"]}, isr
        finally:
            await admin.close()

    assert asyncio.run(replication()) == ({3}, "2")


class TestWaitForAReplica:
    """Why a batch waits for its Redis writes to be on a replica before Kafka commits it: Redis
    replicates asynchronously. A write acknowledged by a master that is failed over before its
    replica has it is lost, while Kafka holds the filtered input that relied on it."""

    def start(self, services, **settings: str) -> tuple[Pipeline, Cluster]:
        pipeline = services.pipeline()
        pipeline.settings = {**pipeline.settings, **settings}
        asyncio.run(pipeline.create_topics())
        pipeline.start_worker()
        return pipeline, Cluster()

    @staticmethod
    async def fail_over(pipeline: Pipeline, cluster: Cluster, got: Collector, thread: str, seconds: float) -> bool:
        """With the worker warmed up, cut the thread's master off from its replica and publish
        the thread's first request; whether its filtered input is committed within `seconds`.
        Then kill the master and have the replica take over."""
        await publish(pipeline.bootstrap, pipeline.topics.requests, [request(f"warm-{thread}", 0)])
        assert await got.wait_for(lambda rs: len(rs) == 2, timeout=120)
        master, replica = cluster.shard_of(f"{pipeline.prefix}:t:{{{thread}}}:meta")
        cluster.cut_off(master, replica)
        try:
            await publish(pipeline.bootstrap, pipeline.topics.requests, [request(thread, 0)])
            committed = await got.wait_for(lambda rs: filtered_of(rs, thread), timeout=seconds)
            cluster.kill(f"redis-{master}")
        finally:
            cluster.kill(f"redis-{replica}", signal.SIGCONT)
        cluster.take_over(replica)
        return committed

    def test_without_it_a_failover_right_after_a_commit_loses_the_write_and_a_rebuild_shows_the_loss(self, cluster_services):
        pipeline, cluster = self.start(cluster_services, MEMFILTER_REDIS_REPLICAS="0")
        thread = f"lost-{uuid.uuid4().hex[:6]}"
        try:

            async def run() -> tuple[list, list, list]:
                async with Collector(pipeline.bootstrap, [pipeline.topics.filtered, pipeline.topics.persist], isolation_level="read_committed") as got:
                    assert await self.fail_over(pipeline, cluster, got, thread, seconds=60)  # acknowledged: committed downstream
                    # The loss is there, and found: the history rebuilt from persist-messages has what the live one lost.
                    stored = await rows_of(pipeline, thread)
                    rebuilt = await asyncio.to_thread(pipeline.memfilter, "history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt")
                    assert rebuilt.returncode == 0, rebuilt.stderr
                    expected = await rows_of(pipeline, thread, f"{pipeline.prefix}-rebuilt")
                    await publish(pipeline.bootstrap, pipeline.topics.requests, [request(thread, 1)])
                    assert await got.wait_for(lambda rs: len(saved_of(rs, thread)) == 2, timeout=120)
                    return stored, expected, saved_of(got.records, thread)

            stored, expected, answers = asyncio.run(run())
        finally:
            pipeline.stop_all()
            cluster.up()
        assert stored == [] and expected == [f"{thread}-u0"]
        # ... and the next request is decided against the gap: u0, saved once already, is saved again.
        assert answers == [[f"{thread}-u0"], [f"{thread}-u0", f"{thread}-u1"]]

    def test_with_it_nothing_acknowledged_is_lost_the_batch_waits_until_a_replica_has_it(self, cluster_services):
        pipeline, cluster = self.start(cluster_services, MEMFILTER_REDIS_REPLICAS="1", MEMFILTER_REDIS_REPLICA_TIMEOUT="0.5")
        thread = f"kept-{uuid.uuid4().hex[:6]}"
        try:

            async def run() -> tuple[bool, bool, list, list]:
                async with Collector(pipeline.bootstrap, [pipeline.topics.filtered, pipeline.topics.persist], isolation_level="read_committed") as got:
                    held = not await self.fail_over(pipeline, cluster, got, thread, seconds=4)  # on no replica: not committed
                    # The new master has no replica until the old one comes back: still held.
                    still_held = not await got.wait_for(lambda rs: filtered_of(rs, thread), timeout=3)
                    await asyncio.to_thread(cluster.up)  # the old master rejoins as the replica
                    assert await got.wait_for(lambda rs: filtered_of(rs, thread), timeout=120)
                    await publish(pipeline.bootstrap, pipeline.topics.requests, [request(thread, 1)])
                    assert await got.wait_for(lambda rs: len(saved_of(rs, thread)) == 2, timeout=120)
                    await asyncio.sleep(1)  # a second copy would be here by now
                    return held, still_held, saved_of(got.records, thread), await rows_of(pipeline, thread)

            held, still_held, answers, stored = asyncio.run(run())
        finally:
            pipeline.stop_all()
            cluster.up()
        assert held and still_held
        assert answers == [[f"{thread}-u0"], [f"{thread}-u1"]]
        assert stored == [f"{thread}-u0", f"{thread}-u1"]
        rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt")
        assert rebuilt.returncode == 0, rebuilt.stderr
        assert asyncio.run(dump(pipeline, f"{pipeline.prefix}-rebuilt")) == asyncio.run(dump(pipeline, pipeline.prefix))
        # The operator's commands run on the cluster too: an audit finds nothing to report, and the thread shows.
        audit = pipeline.memfilter("replay", "--strict")
        assert audit.returncode == 0 and "replayed 3 requests: 3 identical, 0 different" in audit.stdout, audit.stdout + audit.stderr
        shown = pipeline.memfilter("history", "show", thread)
        assert shown.returncode == 0 and "question 0" in shown.stdout and "question 1" in shown.stdout, shown.stderr
        listed = pipeline.memfilter("history", "prefixes").stdout
        assert f"{pipeline.prefix}-rebuilt  " in listed and f"{pipeline.prefix}  " in listed
        dropped = pipeline.memfilter("history", "drop", "--prefix", f"{pipeline.prefix}-rebuilt")
        assert dropped.returncode == 0 and "keys deleted" in dropped.stdout, dropped.stderr
        assert f"{pipeline.prefix}-rebuilt  " not in pipeline.memfilter("history", "prefixes").stdout

    def test_a_request_waiting_for_its_turn_survives_its_masters_failover_and_is_decided_once_after_the_reply(self, cluster_services):
        """MEMFILTER_CONCURRENT_TURNS=enqueue: the second request waits, kept on the thread's master
        and, before its offset is committed, on its replica; the master is killed, the replica
        takes over (the old master back as its replica); the first reply's save then wakes it, and
        it is decided once, after the reply."""
        pipeline, cluster = self.start(cluster_services, MEMFILTER_REDIS_REPLICAS="1", MEMFILTER_CONCURRENT_TURNS="enqueue")
        thread = f"queued-{uuid.uuid4().hex[:6]}"
        now = int(time.time() * 1000)  # the reply being made lapses MEMFILTER_TURN_WAIT_S after its request's record time
        text = {"format": 2, "parts": [{"type": "text", "text": "an answer"}]}
        try:

            async def run() -> tuple[list, list]:
                async with Collector(pipeline.bootstrap, [pipeline.topics.filtered, pipeline.topics.persist], isolation_level="read_committed") as got:
                    for k in (0, 1):  # the first asks for an answer; the second comes before it
                        key, value, _ = request(thread, k)
                        await publish(pipeline.bootstrap, pipeline.topics.requests, [(key, value, now + k)])
                        if k == 0:
                            assert await got.wait_for(lambda rs: filtered_of(rs, thread), timeout=120)
                    await asyncio.sleep(3)  # the second's wait committed, on the replica too
                    assert len(filtered_of(got.records, thread)) == 1
                    master, replica = cluster.shard_of(f"{pipeline.prefix}:t:{{{thread}}}:meta")
                    cluster.kill(f"redis-{master}")
                    cluster.take_over(replica)
                    await asyncio.to_thread(cluster.up)  # the old master rejoins as the replica: writes are replicated again
                    reply = {
                        "requestId": f"{thread}-r0/reply",
                        "threadId": thread,
                        "resourceId": "r",
                        "messages": [{"id": f"{thread}-a0", "role": "assistant", "content": text}],
                    }
                    await publish(pipeline.bootstrap, pipeline.topics.persist, [(thread.encode(), json.dumps(reply).encode(), now + 2)])
                    assert await got.wait_for(lambda rs: len(filtered_of(rs, thread)) == 2, timeout=120)
                    await asyncio.sleep(1)  # a second decision would be here by now
                    return filtered_of(got.records, thread), await rows_of(pipeline, thread)

            decided, stored = asyncio.run(run())
        finally:
            pipeline.stop_all()
            cluster.up()
        assert [d["requestId"] for d in decided] == [f"{thread}-r0", f"{thread}-r1"]
        assert [m["id"] for m in decided[1]["context"]] == [f"{thread}-u0", f"{thread}-a0", f"{thread}-u1"] and not decided[1]["waited"].get("lapsed")
        assert stored == [f"{thread}-u0", f"{thread}-a0", f"{thread}-u1"]


THREADS, TURNS = 1000, 20


async def leaders(bootstrap: str, topics: list[str]) -> Counter:
    """How many of the topics' partitions each broker (node id) leads."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return Counter(p["leader"] for t in await admin.describe_topics(topics) for p in t["partitions"])
    finally:
        await admin.close()


def test_20000_requests_are_answered_once_in_order_and_stored_through_a_broker_kill_a_redis_failover_and_a_reshard(cluster_services):
    """1,000 threads × 20 turns, two workers. During the run: kill -9 of the broker leading the
    most partitions (started again later), kill -9 of a Redis master (its replica takes over;
    started again later, it rejoins as a replica), and a quarter of the slots moved from one
    master to another with `redis-cli --cluster reshard`. A worker that exits is started again
    (`orchestrate`)."""
    pipeline = cluster_services.pipeline()
    asyncio.run(pipeline.create_topics())
    for _ in range(2):
        pipeline.start_worker(MEMFILTER_SESSION_TIMEOUT="6")
    cluster, t = Cluster(), pipeline.topics
    threads = [f"chaos-{i}" for i in range(THREADS)]
    reshard: list[subprocess.Popen] = []
    moved: list[tuple[str, str]] = []  # (from, to) node ids
    exited: list[subprocess.Popen] = []  # workers that exited during the run (started again)
    events: list[str] = []

    async def chaos(turn: int) -> None:
        if turn == 2:
            broker = (await leaders(pipeline.bootstrap, list(t.all()))).most_common(1)[0][0]
            cluster.kill(f"kafka-{broker}")
            events.append(f"killed kafka-{broker}")
        elif turn == 5:
            master, _ = cluster.shard_of(f"{pipeline.prefix}:t:{{{threads[0]}}}:meta")
            cluster.kill(f"redis-{master}")
            events.append(f"killed redis-{master}")
        elif turn == 8:
            await asyncio.to_thread(cluster.up)
            events.append("restarted them")
        elif turn == 11:
            slots = lambda node: sum(int(r.split("-")[-1]) - int(r.split("-")[0]) + 1 for r in node[8:] if not r.startswith("["))  # noqa: E731
            masters = sorted((n for n in cluster.nodes() if "master" in n[2]), key=slots, reverse=True)  # from the one with the most
            moved.append((masters[0][0], masters[1][0]))
            reshard.append(cluster.reshard(*moved[0], 4096))
            events.append("resharding")

    async def orchestrate() -> None:
        """Start a worker again when one exits, as an orchestrator would: a worker whose
        transaction cannot complete (a partition without a leader for longer than the
        producer's request timeout, while its broker is down) exits rather than stall."""
        while True:
            for worker in [w for w in pipeline.workers if w.poll() is not None and w not in exited]:
                exited.append(worker)
                events.append(f"a worker exited ({worker.returncode}) and was started again")
                pipeline.start_worker(MEMFILTER_SESSION_TIMEOUT="6")
            await asyncio.sleep(0.5)

    async def run() -> list:
        orchestrator = asyncio.create_task(orchestrate())
        async with Collector(pipeline.bootstrap, [t.filtered, t.persist, t.dlq], isolation_level="read_committed") as got:
            for turn in range(TURNS):
                await publish(pipeline.bootstrap, t.requests, [request(thread, turn) for thread in threads])
                await chaos(turn)
                if turn in (2, 5, 8, 11):
                    events[-1] += f" at {sum(r.topic == t.filtered for r in got.records)} answered"
                if turn == 11:
                    resharded = asyncio.ensure_future(asyncio.to_thread(reshard[0].communicate, timeout=600))
                    resharded.add_done_callback(lambda _: events.append(f"resharded at {sum(r.topic == t.filtered for r in got.records)} answered"))
                await asyncio.sleep(1)
            answered = lambda rs: sum(r.topic in (t.filtered, t.dlq) for r in rs) >= THREADS * TURNS  # noqa: E731
            assert await got.wait_for(answered, timeout=600), f"{sum(r.topic in (t.filtered, t.dlq) for r in got.records)} answered; {events}"
            out, _ = await resharded
            assert reshard[0].returncode == 0, out[-2000:]
            print("\n" + "; ".join(events))
            await asyncio.sleep(2)  # a second copy of anything would be here by now
            orchestrator.cancel()
            return list(got.records)

    try:
        records = asyncio.run(run())
        alive = [w.poll() is None for w in pipeline.workers if w not in exited]
    finally:
        pipeline.stop_all()
        cluster.up()
        for source, target in moved:  # the slots go back: the next run finds the cluster as this one did
            back = cluster.reshard(target, source, 4096)
            out, _ = back.communicate(timeout=600)
            assert back.returncode == 0, out[-2000:]
    assert alive == [True, True], events
    assert [r for r in records if r.topic == t.dlq] == []
    by_thread = defaultdict(list)
    for r in records:
        by_thread[r.key.decode()].append(r)
    for thread in threads:
        answered = [json.loads(r.value)["requestId"] for r in by_thread[thread] if r.topic == t.filtered]
        assert answered == [f"{thread}-r{k}" for k in range(TURNS)], thread  # each once, in order
        assert saved_of(by_thread[thread], thread) == [[f"{thread}-u{k}"] for k in range(TURNS)], thread  # no write lost
    started = time.monotonic()
    rebuilt = pipeline.memfilter("history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt", timeout=600)
    assert rebuilt.returncode == 0, rebuilt.stderr
    print(f"rebuilt in {time.monotonic() - started:.1f} s: {rebuilt.stdout.strip()}")
    live = asyncio.run(dump(pipeline, pipeline.prefix))
    assert asyncio.run(dump(pipeline, f"{pipeline.prefix}-rebuilt")) == live
    assert all(live[f":t:{{{thread}}}:order"] == [f"{thread}-u{k}".encode() for k in range(TURNS)] for thread in threads)

"""Faults on the product's hosts, and the independent checker's verdict on what came of them.

The stack's processes (Kafka, Redis, PostgreSQL) run on hosts `kafka`, `redis` and `postgres`,
two workers on `worker-1` and `worker-2`, the sink on `sink`, the agent runner on `agent`, the
gateway on `gateway` (`product.py`). For each schedule, the clients (`workload.py`) publish
full-echo turns on fresh threads, straight onto the requests topic and through the gateway
(regenerates and tool calls answered among them), while the schedule's faults come and go; after the last fault heals and
the last turn is published, every acknowledged request must get its outcome within ANSWERED_S,
and the checker (`checker.py`) must find nothing lost, nothing twice, nothing out of order, no
stale decision, and Redis and PostgreSQL holding what the outcomes contributed. Each run prints its report:
the faults and when, what the clients saw, the verdict, the longest a request waited.
"""

from __future__ import annotations

import signal

import pytest
from nemesis import LONG_S
from product import SESSION_TIMEOUT_S
from runs import deployment as deployed
from runs import run, steps, workers_ready


@pytest.fixture(scope="module")
def deployment():
    with deployed() as made:
        yield made


class TestAWorkerCutOff:
    def test_a_worker_cut_from_the_brokers_but_not_from_redis_past_its_session_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        cut = lambda: net.cut("worker-1", "kafka")  # noqa: E731
        run(net, product, steps((5, cut, "worker-1 cut from the broker, not from Redis"), (3 * SESSION_TIMEOUT_S, net.heal, "healed")))

    def test_a_worker_cut_from_everything_past_its_session_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        run(net, product, steps((5, lambda: net.isolate("worker-2"), "worker-2 isolated"), (3 * SESSION_TIMEOUT_S, net.heal, "healed")))


class TestTheAgentRunnerCutOff:
    def test_the_agent_runner_isolated_past_its_session_saves_each_reply_once_and_in_its_turn(self, deployment):
        net, product = deployment
        run(net, product, steps((5, lambda: net.isolate("agent"), "the agent runner isolated"), (3 * SESSION_TIMEOUT_S, net.heal, "healed")))


class TestAWorkerPaused:
    def test_a_worker_paused_past_its_session_timeout_then_woken_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        workers_ready(net, product)
        worker = product.workers["worker-1"]  # the child of `ip netns exec`, which execs it: the worker itself
        pause, wake = (lambda: worker.send_signal(signal.SIGSTOP)), (lambda: worker.send_signal(signal.SIGCONT))
        run(net, product, steps((5, pause, "worker-1 paused (SIGSTOP)"), (3 * SESSION_TIMEOUT_S, wake, "worker-1 woken (SIGCONT)")))


class TestTheGatewayCutOff:
    def test_a_gateway_that_reaches_kafka_but_not_redis_tells_each_caller_what_came_of_its_turn(self, deployment):
        """Its streams waited for Redis to confirm each reply stored: they were cut, with neither
        `finish` nor an `error`, when a read there failed (and a thread's route answered 500)."""
        net, product = deployment
        sent = run(net, product, steps((5, lambda: net.cut("gateway", "redis"), "the gateway cut from Redis, not from Kafka"), (15, net.heal, "healed")))
        assert not [(s.request_id, s.told) for s in sent if s.told is not None and s.told.startswith("cut")]

    def test_a_gateway_isolated_loses_nothing_it_answered(self, deployment):
        net, product = deployment
        run(net, product, steps((5, lambda: net.isolate("gateway"), "the gateway isolated"), (15, net.heal, "healed")))


class TestAWorkerPausedPastTheTransactionTimeout:
    def test_a_worker_paused_past_kafkas_transaction_timeout_then_woken_loses_and_repeats_nothing(self, deployment):
        """Its coordinator aborts a transaction it left open, and the other worker fences it:
        woken, its producers are refused and it rejoins (`memfilter.runtime.loop`)."""
        net, product = deployment
        workers_ready(net, product)
        worker = product.workers["worker-2"]
        pause, wake = (lambda: worker.send_signal(signal.SIGSTOP)), (lambda: worker.send_signal(signal.SIGCONT))
        run(net, product, steps((5, pause, "worker-2 paused (SIGSTOP)"), (LONG_S, wake, "worker-2 woken (SIGCONT)")), seconds=LONG_S + 15)


class TestAWorkersClockJumps:
    def test_a_workers_clock_jumping_an_hour_ahead_then_ten_minutes_behind_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        clock = lambda seconds: lambda: product.clock("worker-1", seconds)  # noqa: E731
        schedule = steps(
            (5, clock(3600), "worker-1's clock an hour ahead"),
            (8, clock(-600), "worker-1's clock ten minutes behind"),
            (8, clock(0), "worker-1's clock right"),
        )
        run(net, product, schedule)


class TestAFullDisk:
    def test_redis_out_of_disk_for_its_append_only_file_then_given_room_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        fill, room = (lambda: product.fill("redis")), (lambda: product.room("redis"))
        run(net, product, steps((5, fill, "Redis's disk full"), (12, room, "Redis's disk has room again")))


class TestALossyLink:
    def test_a_worker_dropping_a_third_of_its_packets_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        run(net, product, steps((3, lambda: net.loss("worker-2", 33), "worker-2 drops 33% of its packets"), (15, net.heal, "healed")))


class TestTheSinkCutOff:
    def test_the_sink_isolated_past_its_session_mid_batch_goes_on_and_writes_everything_to_postgresql(self, deployment):
        """It holds a batch when cut off (the clients never pause), and its group drops it
        meanwhile: healed, it writes the batch and its commit fails (CommitFailedError); it
        reads those records again rather than exit (found by the nemesis, seed 1)."""
        net, product = deployment
        run(net, product, steps((5, lambda: net.isolate("sink"), "the sink isolated"), (25, net.heal, "healed")), seconds=40)


class TestPostgreSQLTrouble:
    def test_postgresql_out_of_disk_then_given_room_and_started_again_loses_nothing_and_the_sink_catches_up(self, deployment):
        """PostgreSQL stops when it cannot write its log (its rule); the workers decide on Redis
        meanwhile, and the sink waits, then writes what it holds back."""
        net, product = deployment
        fill = lambda: product.fill("postgres")  # noqa: E731
        room = lambda: product.room("postgres")  # noqa: E731
        run(net, product, steps((5, fill, "PostgreSQL's disk full"), (12, room, "PostgreSQL's disk has room again; what stopped started again")))

    def test_the_sink_cut_from_postgresql_catches_up_after_the_heal(self, deployment):
        net, product = deployment
        run(net, product, steps((5, lambda: net.cut("sink", "postgres"), "the sink cut from PostgreSQL"), (15, net.heal, "healed")))


class TestSlowAndReorderedLinks:
    def test_a_workers_link_to_the_broker_held_a_second_each_way_then_the_brokers_packets_reordered_lose_and_repeat_nothing(self, deployment):
        """A second each way on the worker's link to the broker (its fetches, produces and
        heartbeats, each a round trip of two seconds, within its session); then every packet
        the broker sends held 1 to 51 ms at random, so that its connections' segments arrive
        out of order (`net.delay`: this kernel has no netem)."""
        net, product = deployment
        held = lambda: (net.delay("worker-1", 1000, "kafka"), net.delay("kafka", 1000, "worker-1"))  # noqa: E731
        reordered = lambda: (net.heal(), net.delay("kafka", 1, jitter=50))  # noqa: E731
        run(
            net,
            product,
            steps(
                (5, held, "worker-1 and the broker's packets to each other held 1 s"),
                (15, reordered, "the broker's packets held 1 to 51 ms each: out of order"),
                (15, net.heal, "healed"),
            ),
        )

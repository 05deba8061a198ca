"""Faults on the replicated stack: three brokers (`kafka-1`..`kafka-3`) and a Redis Cluster
of three masters with a replica each (`redis-6379`..`redis-6384`; which is whose replica is
read when a schedule needs it: failovers change it), each on a host of its own, a worker on each of
`worker-1` and `worker-2` (with MEMFILTER_REDIS_REPLICAS=1, as `memfilter stack up
--redis-cluster` prints it: a batch commits only once its Redis writes are on a replica), the
sink, the agent runner and the gateway. Each
schedule runs as `runs.run` says, and the independent checker must find nothing lost, twice,
out of order or stale."""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable

import pytest
from nemesis import LONG_S
from net import Net
from runs import deployment as deployed
from runs import run, steps

PAUSE_S = 15  # longer than the workers' Kafka sessions (6 s) and Redis Cluster's node timeout (2 s)


@pytest.fixture(scope="module")
def deployment():
    with deployed(replicated=True) as made:
        yield made


def paused(pid: int, what: str, woken: str) -> Callable[[list[str]], Awaitable[None]]:
    """Process `pid` paused (SIGSTOP) 5 s in, for PAUSE_S, then woken."""
    return steps((5, lambda: os.kill(pid, signal.SIGSTOP), what), (PAUSE_S, lambda: os.kill(pid, signal.SIGCONT), woken))


def faulted(net: Net, act: Callable[[], object], what: str) -> Callable[[list[str]], Awaitable[None]]:
    """`act` 5 s in, healed PAUSE_S later."""
    return steps((5, act, what), (PAUSE_S, net.heal, "healed"))


class TestABrokerOrAMasterPaused:
    def test_a_broker_paused_past_the_workers_sessions_then_woken_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        run(net, product, paused(product.pids()["kafka-2"], "broker kafka-2 paused (SIGSTOP)", "broker kafka-2 woken"))

    def test_a_broker_paused_past_kafkas_transaction_timeout_then_woken_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        pid = product.pids()["kafka-3"]
        pause, wake = (lambda: os.kill(pid, signal.SIGSTOP)), (lambda: os.kill(pid, signal.SIGCONT))
        run(net, product, steps((5, pause, "broker kafka-3 paused (SIGSTOP)"), (LONG_S, wake, "broker kafka-3 woken")), seconds=LONG_S + 15)

    def test_a_redis_master_paused_past_the_node_timeout_fails_over_and_nothing_acknowledged_is_lost(self, deployment):
        net, product = deployment
        master, replica = product.pairs()[0]
        what = f"Redis master {master} paused: its replica {replica} takes over"
        run(net, product, paused(product.pids()[master], what, f"{master} woken: it rejoins as a replica"))


class TestPartitions:
    def test_a_worker_cut_from_one_broker_of_three_past_its_session_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        run(net, product, faulted(net, lambda: net.cut("worker-1", "kafka-2"), "worker-1 cut from broker kafka-2"))

    def test_a_broker_cut_from_everyone_past_the_sessions_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        run(net, product, faulted(net, lambda: net.isolate("kafka-3"), "broker kafka-3 isolated"))

    def test_a_redis_master_cut_off_with_a_worker_on_its_side_while_the_cluster_fails_it_over_decides_nothing_stale(self, deployment):
        """worker-1 keeps its brokers and one master alone of the Redis nodes; the other masters
        and its replica fail it over. What worker-1 writes there cannot reach a replica (WAIT),
        so it commits nothing there; after the heal that master is a replica."""
        net, product = deployment
        master, _ = product.pairs()[0]
        minority, majority = [master, "worker-1"], [n for n in product.redis if n != master] + ["worker-2"]
        what = f"{master} (a master) and worker-1 cut from the other Redis nodes and worker-2"
        run(net, product, faulted(net, lambda: net.partition(minority, majority), what))

    def test_halves_each_with_a_worker_a_broker_and_redis_nodes_lose_and_repeat_nothing(self, deployment):
        """The left half holds one master (its replica is on the right, which holds the other
        masters and fails it over) and another master's replica (which cannot)."""
        net, product = deployment
        (m1, r1), (m2, r2), (m3, r3) = product.pairs()
        left, right = ["kafka-1", m1, r2, "worker-1"], ["kafka-2", "kafka-3", m2, m3, r1, r3, "worker-2"]
        run(net, product, faulted(net, lambda: net.partition(left, right), f"halves: {' '.join(left)} | {' '.join(right)}"))

    def test_a_broker_that_bridges_two_sides_which_see_only_it_loses_and_repeats_nothing(self, deployment):
        net, product = deployment
        (m1, r1), (m2, r2), (m3, r3) = product.pairs()
        left, right = ["kafka-2", m1, r2, "worker-1"], ["kafka-3", m2, m3, r1, r3, "worker-2"]
        run(net, product, faulted(net, lambda: net.partition(left, right), f"kafka-1 bridges {' '.join(left)} | {' '.join(right)}"))


class TestSlowAndLossyLinks:
    def test_a_broker_sending_at_256_kbit_a_second_delays_and_loses_nothing(self, deployment):
        """Its replies and its replication wait in its link's queue, up to a second (the delay
        this kernel can make: it has no netem)."""
        net, product = deployment
        run(net, product, faulted(net, lambda: net.slow("kafka-2", 256), "kafka-2 sends at most 256 kbit/s"))

    def test_the_link_between_a_worker_and_a_redis_master_dropping_a_third_of_its_packets_loses_nothing(self, deployment):
        net, product = deployment
        master, _ = product.pairs()[0]
        run(net, product, faulted(net, lambda: net.loss("worker-1", 33, master), f"worker-1 drops 33% of its packets to and from {master}"))


class TestABrokersDisk:
    def test_a_brokers_disk_full_then_given_room_loses_and_repeats_nothing(self, deployment):
        """A broker whose only log folder fails stops (Kafka's rule); given room, it is started
        again, as an operator does."""
        net, product = deployment
        fill = lambda: product.fill("kafka-1")  # noqa: E731
        room = lambda: product.room("kafka-1")  # noqa: E731
        run(net, product, steps((5, fill, "kafka-1's disk full"), (PAUSE_S, room, "kafka-1's disk has room again; what stopped started again")))

    def test_a_brokers_disk_full_then_another_brokers_clock_an_hour_ahead_loses_and_repeats_nothing(self, deployment):
        """The short schedule's draw that once found 915 requests with two outcomes each: kafka-1
        stopped by its full disk and started again, then kafka-2's clock an hour ahead."""
        net, product = deployment
        fill = lambda: product.fill("kafka-1")  # noqa: E731
        room = lambda: product.room("kafka-1")  # noqa: E731
        clock = lambda seconds: lambda: product.clock("kafka-2", seconds)  # noqa: E731
        schedule = steps(
            (1, fill, "kafka-1's disk full"),
            (8, room, "kafka-1's disk has room again; what stopped started again"),
            (1, clock(3600), "kafka-2's clock an hour ahead"),
            (8, clock(0), "kafka-2's clock right"),
        )
        run(net, product, schedule, seconds=40)


class TestABrokersClockJumps:
    def test_a_brokers_clock_jumping_an_hour_ahead_then_ten_minutes_behind_loses_and_repeats_nothing(self, deployment):
        """Kafka times sessions and transactions by the wall clock: an hour ahead, the broker
        finds every session and transaction it coordinates expired; behind, none expires."""
        net, product = deployment
        clock = lambda seconds: lambda: product.clock("kafka-1", seconds)  # noqa: E731
        schedule = steps(
            (5, clock(3600), "kafka-1's clock an hour ahead"),
            (PAUSE_S, clock(-600), "kafka-1's clock ten minutes behind"),
            (PAUSE_S, clock(0), "kafka-1's clock right"),
        )
        run(net, product, schedule, seconds=40)

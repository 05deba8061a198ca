"""Seeded random schedules (`nemesis.py`) on the replicated stack, each process on a host of its
own: every fault kind the harness makes, drawn from the seed, and the independent checker's
verdict. The short schedule (every kind once, seed 1) runs in CI. MEMFILTER_JEPSEN_SEEDS picks
the seeds of the long ones ("1-20", "3,7"; none unless set) and MEMFILTER_JEPSEN_SECONDS their
length (default 600); a run is repeated by its seed. The reports are in `runs.REPORTS`."""

from __future__ import annotations

import os

import pytest
from nemesis import each_kind_s, nemesis
from runs import deployment as deployed
from runs import run


def seeds(text: str) -> list[int]:
    """ "1-3,7" -> [1, 2, 3, 7]"""
    ranges = (part.split("-") for part in text.split(",") if part)
    return [n for r in ranges for n in range(int(r[0]), int(r[-1]) + 1)]


@pytest.fixture(scope="module")
def deployment():
    with deployed(replicated=True) as made:
        yield made


def test_every_fault_kind_once_loses_repeats_reorders_and_decides_stale_nothing(deployment):
    net, product = deployment
    run(net, product, nemesis(net, product, 1, None), seconds=each_kind_s(net, product), name="each-kind")


if SEEDS := seeds(os.environ.get("MEMFILTER_JEPSEN_SEEDS", "")):  # the long runs exist only when asked for (none is a skip)
    SECONDS = float(os.environ.get("MEMFILTER_JEPSEN_SECONDS", "600"))

    @pytest.mark.timeout(SECONDS + 600)
    @pytest.mark.parametrize("seed", SEEDS)
    def test_a_seeded_random_schedule_loses_repeats_reorders_and_decides_stale_nothing(deployment, seed):
        net, product = deployment
        run(net, product, nemesis(net, product, seed, SECONDS), seconds=SECONDS, name=f"seed-{seed}")

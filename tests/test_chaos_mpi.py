"""Chaos, as failures happen at scale: kill -9 of a rank at a random moment (after the first
checkpoint, a random 0-1.5 s later) under ``python -m mpips.launch --restarts 2``, one trial
per case; the harness and the benchmark that runs many trials is benchmarks/chaos.py (its
figures: docs/guide/failures.md). Every trial must end at its target with exit 0 within the
deadline, in place where the mode survives the death, else after a restart that lost no
more than the checkpoint interval; the model must still train (digits: test accuracy
>= 0.9, 0.97-0.99 undisturbed). The seed is in each failure message."""

import random
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import chaos  # noqa: E402

pytestmark = pytest.mark.launcher

CASES = [  # (mode, victim, survived in place)
    ("async", "chief", True),
    ("sync_replicas", "worker", True),
    ("sync", "replica", False),
    ("async", "node", False),  # the second of two emulated nodes: its ranks and MPI proxy
    ("async", "far", True),  # a worker on the second of two emulated nodes
]


@pytest.mark.parametrize("mode,victim,in_place", CASES, ids=[f"{m}-{v}" for m, v, _ in CASES])
def test_a_random_rank_killed_at_a_random_moment_ends_at_the_target(
    tmp_path, mode, victim, in_place
):
    seed = random.randrange(10**6)
    o = chaos.trial(tmp_path, mode, victim, seed)
    said = (
        f"seed {seed}, killed {o.killed}, exit {o.code}, global_step {o.global_step}, "
        f"{o.seconds:.0f} s:\n{o.output[-3000:]}"
    )
    assert o.killed, said
    assert o.passed and o.seconds < chaos.DEADLINE, said
    assert o.accuracy is not None and o.accuracy >= 0.9, said
    assert o.recover_s is not None, said  # the line saying the run goes on was seen
    if in_place:
        assert o.restarts == 0, said
        assert "with 1 rank(s) lost" in o.output, said
    else:
        assert o.restarts >= 1, said
        # resumed from the last checkpoint committed before the kill: at most the
        # interval (1 s) and a commit's latency of training lost
        assert o.lost_steps == 0 and o.lost_s is not None, said
        assert o.lost_s <= chaos.EVERY_SECS + 2.0, said

"""The training mode as an object (mpips.modes), without MPI: which mode a job runs in, what
each mode answers to start-up, the hooks and the result, and that choosing it leaves the
Job as it was."""

import copy
from dataclasses import asdict

import pytest

import mpips
from mpips import modes
from mpips.run.hooks import StepInfo

MODES = ["async", "sync", "sync_replicas", "hybrid"]


def job(mode: str, extra: str = ""):
    return mpips.parse_job(f'[train]\nmode = "{mode}"\nsteps = 5\n{extra}')


@pytest.mark.parametrize("name", MODES)
def test_select_gives_the_jobs_mode_and_leaves_the_job_alone(name):
    j = job(name)
    before = copy.deepcopy(asdict(j))
    mode = modes.select(j, 3)
    assert mode.name == name and not mode.single
    assert isinstance(mode, modes.MODES[name])
    assert asdict(j) == before


@pytest.mark.parametrize("name", ["async", "sync_replicas", "hybrid"])
def test_one_process_is_a_single_sync_replica_and_the_job_says_what_it_said(name):
    j = job(name, "max_staleness = 2\n" if name == "async" else "")
    before = copy.deepcopy(asdict(j))
    mode = modes.select(j, 1)
    assert isinstance(mode, modes.Sync) and mode.single and mode.max_staleness is None
    assert asdict(j) == before
    assert not modes.select(job("sync"), 1).single  # sync already: nothing to say


def test_only_async_keeps_its_staleness_bound():
    assert modes.select(job("async", "max_staleness = 2\n"), 3).max_staleness == 2
    assert modes.select(job("sync"), 3).max_staleness is None


def test_the_run_records_the_effective_job_on_a_copy():
    """The manifest's mode and model, and the digest, are the run's: a one-process run of an
    async job records sync, a model of your own its factory's name; the caller's Job keeps
    what it said."""
    from mpips.training import as_run

    class Mine(mpips.Model):
        pass

    j = job("async", "max_staleness = 2\n")
    run = as_run(j, modes.select(j, 1), Mine)
    assert (run.train.mode, run.train.max_staleness) == ("sync", None)
    assert run.model.kind.endswith("Mine") and j.model.kind == "mlp"
    assert (j.train.mode, j.train.max_staleness) == ("async", 2)
    assert as_run(j, modes.select(j, 3)) == j


def test_what_each_mode_answers():
    a, s, r, h = (modes.select(job(n), 3) for n in MODES)
    assert [m.ps_holds_variables for m in (a, s, r, h)] == [True, False, True, True]
    assert [m.dense_on_ps for m in (a, s, r, h)] == [True, True, True, False]
    assert [m.chief_holds_dense for m in (a, s, r, h)] == [False, True, False, True]
    assert [m.trains_tables for m in (a, s, r, h)] == [True, False, False, True]
    assert [m.takes_clip_norm for m in (a, s, r, h)] == [True, True, False, False]
    assert [m.chief_speaks_for_all for m in (a, s, r, h)] == [False, True, True, True]
    assert [m.has_staleness for m in (a, s, r, h)] == [True, False, False, False]
    assert [m.ps_applies(False) for m in (a, s, r, h)] == [False, False, True, False]
    assert all(m.ps_applies(True) for m in (a, s, r, h))


def test_each_mode_says_its_step_line():
    info = StepInfo(7, 0.5, 0, 3, 1, 2)
    notes = {n: modes.select(job(n), 3).step_note(info) for n in MODES}
    assert notes["async"] == notes["hybrid"] == "(update 3 of this worker, pulled 2 steps earlier)"
    assert notes["sync"] == "(mean over all replicas' batches)"
    assert "replicas_to_aggregate" in notes["sync_replicas"]


def test_the_sync_replicas_average_is_applied_once_a_step_has_its_gradients():
    """The policy the store hands each gradient of a step to (store.StepPolicy)."""
    import numpy as np

    from mpips.modes.engines.replicas_worker import Averager

    var = np.zeros(3)

    class Held:
        def held(self, task):
            return {"w": var}, {}

    applied = []

    def sgd(v, g, slots, lr, t):
        applied.append(t)
        v -= lr * g

    avg = Averager(Held(), 0, sgd, (), 2)
    assert not avg.add({"w": np.ones(3)})
    assert avg.add({"w": 3 * np.ones(3)})
    avg.apply(0.5, 4)
    assert applied == [5] and np.allclose(var, -1.0)  # the mean (2) times lr, once
    assert not avg.add({"w": np.ones(3)})  # the next step starts from nothing

"""``mpips eval`` and ``predict`` in process (the fast tier): a checkpoint written by a
one-process run is evaluated to the run's own final metrics, and its predictions agree;
the run leaves the caller's Job as it was."""

import copy

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpips
from mpips.errors import ConfigError
from mpips.run import evaluation


def test_a_checkpoint_evaluates_to_the_runs_own_metrics_and_predicts_the_same(tmp_path):
    job = mpips.load_job(None)
    job.train.steps, job.train.progress = 40, False
    job.checkpoint.dir = str(tmp_path / "ckpt")
    job.train.mode = "async"  # one process trains it as a single sync replica, on a copy
    given = copy.deepcopy(job)
    result = mpips.train(job, comm=MPI.COMM_SELF)
    assert job == given, "mpips.train changed the caller's Job"
    assert result.global_step == 40 and result.test_metrics

    metrics, step, manifest = evaluation.evaluate(job)
    assert step == 40 and manifest.name == "ckpt-40.json"
    for name, value in result.test_metrics.items():
        assert abs(metrics[name] - value) < 1e-6, (name, metrics[name], value)

    info = evaluation.restore_model(job)[3]
    with h5py.File(info.path) as f:  # the file's rows as they are: predict scales them
        x, y = f["test/x"][()], f["test/y"][()]
    np.save(tmp_path / "x.npy", x)
    rows, step = evaluation.predict(job, str(tmp_path / "x.npy"), str(tmp_path / "p.npy"))
    probabilities = np.load(tmp_path / "p.npy")
    assert rows == len(y) and step == 40 and probabilities.shape == (len(y), 10)
    accuracy = float((probabilities.argmax(axis=1) == y).mean())
    assert abs(accuracy - metrics["accuracy"]) < 1e-6

    with pytest.raises(ConfigError, match="written as a .npy file"):
        evaluation.predict(job, str(tmp_path / "x.npy"), str(tmp_path / "p.csv"))

"""The port of TensorFlow 1.x's mnist_replica.py (jobs/mnist_replica.py and its two job files,
docs/migrating-from-tensorflow.md): the model computes TF's loss and gradients, and both
jobs run as the guide shows them, with TF's global-step semantics (200 global steps: 200
updates async, 200 aggregated steps of 2 gradients with sync_replicas)."""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import run_train
from shared_runs import place_fashion_mnist

import mpips

ROOT = Path(__file__).resolve().parent.parent


def port():
    """jobs/mnist_replica.py, imported as the job file's model.kind does."""
    spec = importlib.util.spec_from_file_location("mnist_replica", ROOT / "jobs/mnist_replica.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tf_cross_entropy(model, params, x, y):
    """TF's -reduce_sum(y_ * log(clip_by_value(softmax, 1e-10, 1))), in float64."""
    probs = model.forward(params, x)[1]
    return -np.log(np.clip(probs[np.arange(len(y)), y], 1e-10, 1.0)).sum()


def test_the_port_writes_the_gradients_of_tfs_summed_cross_entropy():
    m = port()
    model = m.MnistReplica(6, 3, hidden_units=5)
    rng = np.random.default_rng(0)
    params = {k: v.astype(np.float64) for k, v in model.initial_values(0).items()}
    params["hid_b"] += 0.1  # no ReLU at its kink
    x, y = rng.random((8, 6)), rng.integers(0, 3, 8)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    loss = model.loss_and_grads(params, x, y, grads)
    assert loss == pytest.approx(tf_cross_entropy(model, params, x, y) / 8)  # mpips logs the mean
    for name, value in params.items():
        numeric = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            old = value[i]
            value[i] = old + 1e-6
            up = tf_cross_entropy(model, params, x, y)
            value[i] = old - 1e-6
            numeric[i] = (up - tf_cross_entropy(model, params, x, y)) / 2e-6
            value[i] = old
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-5, atol=1e-7, err_msg=name)


def test_below_the_clip_an_example_passes_no_gradient_and_inits_are_truncated():
    m = port()
    model = m.MnistReplica(2, 2, hidden_units=1)
    params = {
        "hid_w": np.ones((2, 1)),
        "hid_b": np.zeros(1),
        "sm_w": np.array([[60.0, -60.0]]),
        "sm_b": np.zeros(2),
    }
    x, y = np.array([[1.0, 0.0], [0.0, 0.1]]), np.array([1, 1])  # row 0: p(1) = e^-120
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    model.loss_and_grads(params, x, y, grads)
    alone = {k: np.zeros_like(v) for k, v in params.items()}
    model.loss_and_grads(params, x[1:], y[1:], alone)
    for name in params:
        np.testing.assert_allclose(grads[name], alone[name], err_msg=name)
    w = m.MnistReplica(784, 10).initial_values(0)["hid_w"]
    assert w.dtype == np.float32 and np.abs(w).max() <= 2 / 28
    assert 0.85 / 28 < w.std() < 0.9 / 28  # a N(0, 1/28) cut at 2 stddev: 0.88 / 28


@pytest.mark.launcher
def test_the_port_runs_async_and_sync_replicas_with_tfs_global_steps(tmp_path, fashion_mnist):
    """TF's default cluster (1 ps, 2 workers), each job file as the guide runs it (on the
    data converted once a session)."""
    place_fashion_mnist(fashion_mnist, tmp_path)
    r = run_train(tmp_path, 3, str(ROOT / "jobs/mnist_replica.toml"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = r.result
    # async: 200 global steps are 200 updates in all, of 100 examples each
    assert res["global_step"] == 200 and sum(s["updates"] for s in res["staleness"]) == 200
    assert res["total_examples"] == 200 * 100
    assert res["test_accuracy"] >= 0.7, r.stdout[-3000:]
    assert res["test_metrics"]["cross_entropy"] == pytest.approx(10000 * res["test_loss"])
    r = run_train(tmp_path, 3, str(ROOT / "jobs/mnist_replica_sync.toml"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    res = r.result
    # sync_replicas: 200 global steps, each the mean of both workers' gradients
    assert res["global_step"] == 200 and res["total_examples"] == 2 * 200 * 100
    assert [(s["updates"], s["dropped"]) for s in res["staleness"]] == [(200, 0), (200, 0)]
    assert "[/job:ps/task:0] aggregated 200 steps of 2 gradients each" in r.stdout
    assert res["test_accuracy"] >= 0.78, r.stdout[-3000:]


def test_the_guide_shows_the_shipped_code():
    page = (ROOT / "docs/migrating-from-tensorflow.md").read_text()
    start = page.index("## Worked example: TensorFlow's `mnist_replica.py`")
    section = page[start : page.index("\n## ", start + 1)]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert code in (ROOT / "jobs/mnist_replica.py").read_text()
    for job in ("jobs/mnist_replica.toml", "jobs/mnist_replica_sync.toml"):
        assert f"mpirun -n 3 python -m mpips train {job}" in section
        mpips.load_job(str(ROOT / job))  # a valid job file

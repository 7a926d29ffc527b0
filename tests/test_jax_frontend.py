"""mpips.jax: a pure JAX loss function trained by mpips equals JAX's own SGD loop (one process
step for step, one async worker, sync replicas as one process with W x the batch), its
variables named by pytree paths."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import need, run_train, streams
from test_optimizers_mpi import read_ckpt

import mpips
from mpips.errors import ConfigError
from mpips.run.hooks import Hook

jax = need("jax")
jnp = pytest.importorskip("jax.numpy")
mj = pytest.importorskip("mpips.jax")

NET = """
import jax
import jax.numpy as jnp
import mpips.jax


def init(key):
    k0, k1 = jax.random.split(key)
    return {
        "hidden": {"kernel": jax.random.normal(k0, (64, 16)) * 0.1, "bias": jnp.zeros(16)},
        "out": {"kernel": jax.random.normal(k1, (16, 10)) * 0.1, "bias": jnp.zeros(10)},
    }


def loss(params, x, y):
    h = jax.nn.relu(x @ params["hidden"]["kernel"] + params["hidden"]["bias"])
    z = h @ params["out"]["kernel"] + params["out"]["bias"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(z), y.astype(jnp.int32)[:, None], 1).mean()
    return nll, {"accuracy": jnp.mean(jnp.argmax(z, 1) == y)}


def build(data):
    return mpips.jax.Model(loss, init)
"""

JOB = """
[model]
kind = "net:build"
init_seed = 7
[data]
builtin = "digits"
[optimizer]
learning_rate = 0.1
[train]
mode = "{mode}"
steps = {steps}
batch_size = 16
seed = 3
log_every = 0
[checkpoint]
dir = "runs/j"
"""


def namespace():
    """NET's functions, defined here as the job's file defines them."""
    scope: dict = {}
    exec(compile(NET, "net.py", "exec"), scope)  # (the test's own source text)
    return scope


def write(tmp_path, mode: str, steps: int) -> mpips.Job:
    (tmp_path / "net.py").write_text(NET)
    text = JOB.format(mode=mode, steps=steps)
    (tmp_path / "job.toml").write_text(text)
    return mpips.parse_job(text)


def plain_loop(job: mpips.Job, workers: int, steps: int, sync: bool):
    """JAX's own SGD on each step's batches (concatenated over the workers): the
    parameters after every step, by mpips's names."""
    net = namespace()
    params = net["init"](jax.random.PRNGKey(job.model.init_seed))
    grad = jax.jit(jax.grad(lambda p, x, y: net["loss"](p, x, y)[0]))
    lr, out = job.optimizer.learning_rate, []
    for xs, ys in streams(job, workers, steps, sync):
        g = grad(params, jnp.asarray(np.concatenate(xs)), jnp.asarray(np.concatenate(ys)))
        params = jax.tree_util.tree_map(lambda p, d: p - lr * d, params, g)
        leaves = jax.tree_util.tree_flatten_with_path(params)[0]
        out.append({mj.leaf_name(path): np.asarray(v) for path, v in leaves})
    return out


def assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-4, atol=2e-6, err_msg=name)


class EachStep(Hook):
    def __init__(self):
        self.values = []

    def after_step(self, run, info):
        self.values.append(run.variables())


def test_variables_are_named_by_pytree_paths():
    model = mj.Model(namespace()["loss"], namespace()["init"])
    assert [(s.name, s.shape) for s in model.variables()] == [
        ("hidden/bias", (16,)),
        ("hidden/kernel", (64, 16)),
        ("out/bias", (10,)),
        ("out/kernel", (16, 10)),
    ]


def test_integer_leaves_are_refused():
    with pytest.raises(ConfigError, match="parameter 'count' is int32"):
        mj.Model(lambda p, x, y: (0.0, {}), lambda key: {"count": jnp.zeros(3, jnp.int32)})


def test_one_process_equals_a_plain_jax_loop_step_for_step(tmp_path, monkeypatch):
    from mpi4py import MPI

    monkeypatch.chdir(tmp_path)
    job = write(tmp_path, "sync", 10)
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = EachStep()
    result = mpips.train(job, [hook], comm=MPI.COMM_SELF)
    assert result.global_step == 10 and "accuracy" in result.test_metrics
    want = plain_loop(job, 1, 10, sync=True)
    for step in range(10):
        assert_equal(hook.values[step], want[step])


@pytest.mark.launcher
@pytest.mark.parametrize(("mode", "ranks", "workers"), [("async", 2, 1), ("sync", 2, 2)])
def test_under_mpiexec_equals_jax_on_the_same_batches(tmp_path, mode, ranks, workers):
    """One async worker (1 PS task + 1 worker) equals JAX's loop on its batches; two sync
    replicas equal it on the concatenation of theirs."""
    job = write(tmp_path, mode, 12)
    r = run_train(tmp_path, ranks, "job.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    variables, _, _ = read_ckpt(tmp_path / "runs/j/ckpt-12.json")
    assert_equal(variables, plain_loop(job, workers, 12, sync=mode == "sync")[-1])


@pytest.mark.launcher
def test_the_shipped_jax_mlp_trains(tmp_path):
    """jobs/jax_mlp.toml as shipped (the reference MLP in JAX on the built-in digits, async,
    1 PS + 2 workers)."""
    import shutil

    from conftest import ROOT

    for name in ("jax_mlp.py", "jax_mlp.toml"):
        shutil.copy(ROOT / "jobs" / name, tmp_path / name)
    r = run_train(tmp_path, 3, "jax_mlp.toml", timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.result["global_step"] == 600 and r.result["test_accuracy"] > 0.9, r.result

"""mpips.jax, a JAX user's first mistakes: a loss that does not return ``(loss, metrics)``
is one line naming the user's file (exit 2), not a traceback through JAX and mpips;
``mpips predict`` on a model made without ``predict=`` is refused in one line (exit 2) as a
native model without ``predict`` is; and the guide's snippet that loads a ``ckpt export``
back into the user's pytree works. In process, but for the one ``python -m mpips train``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, need, run_train
from test_optimizers_mpi import read_ckpt

import mpips
from mpips.cli import main
from mpips.errors import ConfigError

NET = """
import jax
import jax.numpy as jnp
import mpips.jax


def init(key):
    return {"out": {"kernel": jax.random.normal(key, (64, 10)) * 0.1, "bias": jnp.zeros(10)}}


def per_example(params, x, y):
    z = x @ params["out"]["kernel"] + params["out"]["bias"]
    return -jnp.take_along_axis(jax.nn.log_softmax(z), y.astype(jnp.int32)[:, None], 1)[:, 0]


def loss(params, x, y):
    return per_example(params, x, y).mean(), {}


def losses(params, x, y):
    return per_example(params, x, y), {}


def predict(params, x):
    return jax.nn.softmax(x @ params["out"]["kernel"] + params["out"]["bias"])


def build(data, predicting=False):
    return mpips.jax.Model(loss, init, predict if predicting else None)


def build_per_example(data):
    return mpips.jax.Model(losses, init)
"""

JOB = """
[model]
kind = "hjnet:{factory}"
[data]
builtin = "digits"
[train]
mode = "sync"
steps = {steps}
batch_size = 16
log_every = 0
[checkpoint]
dir = "runs/h"
"""


def jax_or_skip():
    """jax and mpips.jax, or a skip (a failure under CI, which installs the extra)."""
    jax = need("jax")
    return jax, pytest.importorskip("mpips.jax")


def write(folder: Path, factory: str = "build", steps: int = 2) -> mpips.Job:
    """The network module and a job naming ``factory`` in ``folder``."""
    (folder / "hjnet.py").write_text(NET)
    text = JOB.format(factory=factory, steps=steps)
    (folder / "job.toml").write_text(text)
    return mpips.parse_job(text)


def line_of(name: str) -> int:
    """The line NET defines function ``name`` on (as the module file holds it)."""
    return NET.splitlines().index(next(s for s in NET.splitlines() if f"def {name}(" in s)) + 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A folder with the network, its job and a checkpoint of two steps (one process)."""
    jax_or_skip()
    from mpi4py import MPI

    folder = tmp_path_factory.mktemp("jax")
    job = write(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.syspath_prepend(str(folder))
        mpips.train(job, comm=MPI.COMM_SELF)
    return folder


def test_a_loss_per_example_is_refused_in_one_line_naming_the_users_file(tmp_path, monkeypatch):
    """(loss, metrics) with a loss per example: the first step says where the loss is
    defined, what it returned and what to return; nothing of JAX's own error."""
    jax_or_skip()
    from mpi4py import MPI

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = write(tmp_path, "build_per_example")
    with pytest.raises(ConfigError) as e:
        mpips.train(job, comm=MPI.COMM_SELF)
    said = str(e.value)
    assert said.startswith(f"hjnet.py:{line_of('losses')}: losses returned (loss, metrics) with ")
    assert "loss a float32[16] array (a loss per example? take its mean)" in said
    assert "must return (loss, metrics)" in said and "\n" not in said
    assert "Gradient only defined" not in said


def test_a_loss_returned_alone_is_refused_by_a_step_and_by_an_evaluation():
    """The scalar alone (no metrics): refused at the first step, and by an evaluation that
    comes first (``mpips eval`` of a checkpoint), each naming this file and line."""
    jax, mj = jax_or_skip()
    jnp = jax.numpy

    def alone(params, x, y):
        return jnp.mean((x @ params["w"] - y[:, None]) ** 2)

    where = f"tests/{Path(__file__).name}:{alone.__code__.co_firstlineno}"
    model = mj.Model(alone, lambda key: {"w": jnp.zeros((4, 1))})
    params = model.initial_values(0)
    x, y = np.ones((3, 4), np.float32), np.zeros(3, np.float32)
    grads = {"w": np.zeros((4, 1), np.float32)}
    want = re.escape(
        f"{where}: alone returned a float32 scalar (the loss alone: return (loss, {{}}))"
    )
    with pytest.raises(ConfigError, match=want):
        model.evaluate(params, x, y)
    with pytest.raises(ConfigError, match=want):
        model.loss_and_grads(params, x, y, grads)


@pytest.mark.parametrize(
    ("returns", "said"),
    [
        ("(loss, 3)", "with metrics a Python int"),
        ("(loss, {'rows': x.sum(axis=1)})", "with metric 'rows' a float32[3] array (reduce it)"),
        ("(loss, {}, {})", "returned a tuple of 3 (a float32 scalar, a dict, a dict)"),
    ],
)
def test_other_returns_are_said_as_what_came_back(returns, said):
    """Metrics that are no dict, a metric that is not a scalar, a triple."""
    jax, mj = jax_or_skip()
    jnp = jax.numpy
    scope = {"jnp": jnp}
    exec(f"def f(params, x, y):\n    loss = (x @ params['w']).mean()\n    return {returns}", scope)
    model = mj.Model(scope["f"], lambda key: {"w": jnp.zeros((4, 1))})
    with pytest.raises(ConfigError, match=re.escape(said)):
        model.evaluate(model.initial_values(0), np.ones((3, 4), np.float32), np.zeros(3))


def test_mpips_train_says_a_loss_per_example_in_one_line_exit_2(tmp_path):
    """``python -m mpips train`` (one process): exit 2 and a single line on stderr."""
    jax_or_skip()
    write(tmp_path, "build_per_example")
    r = run_train(tmp_path, None, "job.toml", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stdout + r.stderr
    assert len(lines) == 1 and lines[0].startswith("mpips: error"), r.stderr
    assert f"hjnet.py:{line_of('losses')}: losses returned" in lines[0]


def test_predict_refuses_a_model_made_without_predict_in_one_line(trained, monkeypatch, capsys):
    """As a native model without predict (exit 2, one line, no output written); with
    ``predict=`` the same checkpoint predicts."""
    monkeypatch.chdir(trained)
    monkeypatch.syspath_prepend(str(trained))
    np.save("rows.npy", np.ones((3, 64), np.float32))
    args = ["predict", "job.toml", "--input", "rows.npy", "--input-scaled", "--output"]
    assert main([*args, "none.npy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "mpips: error: mpips.jax.model.Model does not implement predict(params, x)"
    ), err
    assert "mpips.jax.Model takes predict=" in err[0]
    assert not Path("none.npy").exists()
    text = Path("job.toml").read_text()
    Path("predicting.toml").write_text(text + "[model.args]\npredicting = true\n")
    assert main(["predict", "predicting.toml", *args[2:], "p.npy"]) == 0, capsys.readouterr()
    p = np.load("p.npy")
    assert p.shape == (3, 10) and np.allclose(p.sum(axis=1), 1, atol=1e-5)


def export_snippet() -> str:
    """The guide's code block under "Loading an export"."""
    text = (ROOT / "docs/guide/jax.md").read_text()
    section = text[text.index("## Loading an export") :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_guides_snippet_loads_an_export_into_the_users_pytree(trained, monkeypatch, capsys):
    """``ckpt export`` then the guide's lines, as written, with the job's ``init`` and
    ``loss``: the pytree holds the checkpoint's values and the loss takes it."""
    jax, mj = jax_or_skip()
    monkeypatch.chdir(trained)
    assert main(["ckpt", "export", "runs/h", "model.h5"]) == 0, capsys.readouterr()
    scope: dict = {}
    exec(compile(NET, "hjnet.py", "exec"), scope)
    scope.update(x=np.ones((2, 64), np.float32), y=np.zeros(2, np.int32))
    exec(compile(export_snippet(), "jax.md", "exec"), scope)
    variables, _, _ = read_ckpt(trained / "runs/h/ckpt-2.json")
    leaves = jax.tree_util.tree_flatten_with_path(scope["params"])[0]
    got = {mj.leaf_name(path): np.asarray(v) for path, v in leaves}
    assert sorted(got) == sorted(variables) == ["out/bias", "out/kernel"]
    for name, value in variables.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)

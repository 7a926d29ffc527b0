"""mpips.torch hardened (issue 50): every rank builds the same module whatever the factory
imports (torch, numpy and Python's generators seeded first); a loss that is a sum is refused,
not trained to chance; float64 and float16 modules train; a torch.compile'd module has the
plain module's names (checkpoints and exports interchangeable); BatchNorm's statistics are
made anew with the final variables at the end of a run and in ``ckpt export``."""

from __future__ import annotations

import functools
import itertools
import json
import random
import textwrap
import types

import numpy as np
import pytest
from conftest import need, run_mpi, run_py
from test_optimizers_mpi import read_ckpt

import mpips
from mpips.data.batches import batches, load_split, open_dataset, resolve_path, worker_rows
from mpips.errors import ConfigError, MpipsError
from mpips.models.contract import build_from_factory, import_factory

torch = need("torch")
mt = pytest.importorskip("mpips.torch")
F = torch.nn.functional
DIGITS = open_dataset(resolve_path("", "digits"))


def one_process(tmp_path, monkeypatch, build, steps=40, **train):
    """``build`` trained in this process (one sync replica) on the built-in digits."""
    from mpi4py import MPI

    monkeypatch.chdir(tmp_path)
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in train.items())
    job = mpips.parse_job(
        textwrap.dedent(f"""
        [model]
        kind = "x:y"
        [data]
        builtin = "digits"
        [optimizer]
        learning_rate = 0.5
        [train]
        mode = "sync"
        steps = {steps}
        batch_size = 32
        seed = 2
        log_every = 0
        progress = false
        """)
        + extra
        + '[checkpoint]\ndir = "runs/h"\nevery_steps = 20\n'
    )
    return mpips.train(job, comm=MPI.COMM_SELF, model=build)


def mlp(inputs=64, classes=10, norm=False):
    layers = [torch.nn.Linear(inputs, 16)] + ([torch.nn.BatchNorm1d(16)] if norm else [])
    return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(16, classes))


# -- item 3: the same module on every rank, whatever the factory imports -------------------

LATE = """
import random

import numpy as np


def build(data):
    import torch  # (the first import of torch in a fresh process: inside the factory)

    import mpips.torch

    net = torch.nn.Linear(data.num_inputs, data.num_classes)
    net.register_buffer("drawn", torch.tensor([np.random.rand(), random.random()]))
    return mpips.torch.Model(net, torch.nn.CrossEntropyLoss())
"""

BUILD = """
import json, sys, types
import numpy as np
from mpips.models.contract import build_from_factory, import_factory
assert "torch" not in sys.modules
factory = import_factory("late_torch_factory:build", "job.toml")
data = types.SimpleNamespace(num_inputs=6, num_classes=3)
print(json.dumps(build_from_factory(factory, data, np, {}, "late", 5).fingerprints()))
"""


def test_a_factory_that_imports_torch_itself_builds_the_same_module_everywhere(
    tmp_path, monkeypatch
):
    """A fresh process whose factory imports torch (and draws from numpy's and Python's
    generators) builds what this process builds: torch imported inside the factory is
    seeded (the factory is called once more), and so are numpy's and Python's."""
    (tmp_path / "late_torch_factory.py").write_text(LATE)
    (tmp_path / "job.toml").write_text("")
    r = run_py(["-c", BUILD], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    monkeypatch.syspath_prepend(str(tmp_path))
    data = types.SimpleNamespace(num_inputs=6, num_classes=3)
    here = build_from_factory(import_factory("late_torch_factory:build"), data, np, {}, "late", 5)
    assert json.loads(r.stdout) == here.fingerprints()
    assert set(here.fingerprints()) == {"weight", "bias", "drawn"}


def test_numpy_and_pythons_generators_are_seeded_before_the_factory():
    drawn = []

    def build(data):
        drawn.append((np.random.rand(), random.random(), float(torch.rand(1))))
        return mt.Model(mlp(), torch.nn.CrossEntropyLoss())

    for _ in range(2):
        np.random.rand(3), random.random(), torch.rand(2)  # the streams moved on
        build_from_factory(build, None, np, {}, "build", 7)
    assert drawn[0] == drawn[1]
    build_from_factory(build, None, np, {}, "build", (1 << 62) - 1)  # any init_seed


# -- item 4: a loss that is not the batch's mean -------------------------------------------


@pytest.mark.parametrize(
    "loss",
    [
        torch.nn.CrossEntropyLoss(reduction="sum"),
        torch.nn.MSELoss(reduction="none"),
        functools.partial(F.cross_entropy, reduction="sum"),
    ],
)
def test_a_torch_loss_that_is_not_the_mean_is_refused_at_once(loss):
    with pytest.raises(ConfigError, match=r"reduction='(sum|none)'; .* use reduction=\"mean\""):
        mt.Model(mlp(), loss)
    mt.Model(mlp(), torch.nn.KLDivLoss(reduction="batchmean"))  # (KL's mean over the batch)


def test_a_loss_function_that_sums_is_refused_at_the_first_step():
    """A plain function returning the batch's sum doubles on the batch twice over: refused
    at the first step (once, without gradients); the mean passes."""
    x = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
    y = np.arange(8) % 10
    for loss, refused in (
        (lambda z, t: F.cross_entropy(z, t, reduction="sum"), True),
        (lambda z, t: F.cross_entropy(z, t), False),
        (lambda z, t: (z - 1).pow(2).sum(dim=1).mean(), False),  # a sum over outputs: a mean
    ):
        model = mt.Model(mlp(), loss)
        params = model.initial_values(0)
        grads = {k: np.zeros_like(v) for k, v in params.items()}
        if refused:
            with pytest.raises(ConfigError, match="it is the batch's sum, not its mean"):
                model.loss_and_grads(params, x, y, grads)
        else:
            model.loss_and_grads(params, x, y, grads)


def test_a_sum_loss_ends_the_run_at_start_up_with_exit_2(tmp_path, monkeypatch):
    def build(data):
        return mt.Model(mlp(), torch.nn.CrossEntropyLoss(reduction="sum"))

    with pytest.raises(MpipsError, match="reduction='sum'") as e:
        one_process(tmp_path, monkeypatch, build)
    assert e.value.exit_code == 2


# -- item 5: float64 and half modules ------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_float64_and_float16_modules_train_end_to_end(tmp_path, monkeypatch, dtype):
    """The batch (float32 data) is cast to the parameters' dtype: the run trains and its
    checkpoint holds that dtype."""

    def build(data):
        torch.manual_seed(0)
        return mt.Model(mlp().to(getattr(torch, dtype)), torch.nn.CrossEntropyLoss())

    result = one_process(tmp_path, monkeypatch, build, steps=20)
    assert result.test_accuracy > 0.3, result.test_accuracy  # (chance: 0.1)
    variables, _, _ = read_ckpt(tmp_path / "runs/h/ckpt-20.json")
    assert {v.dtype.name for v in variables.values()} == {dtype}


def test_a_batch_in_the_parameters_dtype_is_not_copied():
    model = mt.Model(mlp(), torch.nn.CrossEntropyLoss())
    x = np.ones((4, 64), np.float32)
    assert model._inputs(x)[0].data_ptr() == x.ctypes.data  # a view of the batch
    model = mt.Model(mlp().double(), torch.nn.CrossEntropyLoss())
    assert model._inputs(x)[0].dtype == torch.float64


# -- item 7: torch.compile -----------------------------------------------------------------


def test_a_compiled_module_has_the_plain_modules_names(tmp_path, monkeypatch):
    """Variables, state and the export are named as the plain module names them: its
    checkpoint's export loads into the plain module strictly."""
    from mpips.checkpoint import Checkpoint
    from mpips.torch.export import export_state_dict

    def build(data):
        torch.manual_seed(0)
        return mt.Model(torch.compile(mlp(norm=True), backend="eager"), F.cross_entropy)

    model = build(None)
    plain = mlp(norm=True)
    assert [v.name for v in model.variables()] == [n for n, _ in plain.named_parameters()]
    assert set(model.state()) == set(plain.state_dict()) - {v.name for v in model.variables()}
    assert set(model.fingerprints()) == set(plain.state_dict())
    from mpips.torch.model import plain_name  # (what an export of an older checkpoint uses)

    assert plain_name("_orig_mod._orig_mod.0.weight") == "0.weight"
    result = one_process(tmp_path, monkeypatch, build, steps=4)
    out = export_state_dict(Checkpoint(tmp_path / "runs/h/ckpt-4.json"), tmp_path / "m.pt", None)
    plain.load_state_dict(torch.load(out))  # strict
    plain.eval()
    x, y = load_split(DIGITS, "test")
    with torch.no_grad():
        accuracy = float((plain(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
    assert accuracy == pytest.approx(result.test_accuracy, abs=1e-6)


# -- item 8: BatchNorm's statistics made anew ----------------------------------------------

BN_NET = """
import torch
import mpips.torch


def build(data):
    net = torch.nn.Sequential(
        torch.nn.Linear(data.num_inputs, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
        torch.nn.Linear(16, data.num_classes),
    )
    return mpips.torch.Model(net, torch.nn.CrossEntropyLoss())
"""

BN_JOB = """
[model]
kind = "bn_recompute:build"
[data]
builtin = "digits"
[optimizer]
learning_rate = 0.1
[train]
mode = "async"
steps = 60
batch_size = 32
seed = 4
log_every = 0
recompute_batch_norm = 5
[checkpoint]
dir = "runs/bn"
"""


def first(n: int, stream) -> list:
    """The inputs of the first ``n`` (epoch, x, y) batches of a stream."""
    out = [torch.from_numpy(x) for _, x, _ in itertools.islice(stream, n)]
    stream.close()  # (a streamed part's reader stops)
    return out


def recomputed(values: dict, loader: list) -> dict:
    """PyTorch's own statistics of the final weights (``values``) on ``loader``'s batches:
    torch.optim.swa_utils.update_bn."""
    net = mlp(norm=True)
    net.load_state_dict({k: torch.from_numpy(np.asarray(values[k])) for k in net.state_dict()})
    torch.optim.swa_utils.update_bn(loader, net)
    return {k: v.numpy() for k, v in net.state_dict().items() if k.startswith("1.running")}


def assert_statistics(got: dict, want: dict) -> None:
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_one_process_run_ends_with_the_final_weights_statistics(tmp_path, monkeypatch):
    """(A checkpoint at the last step already, every_steps: it is written again.)"""

    def build(data):
        torch.manual_seed(0)
        return mt.Model(mlp(norm=True), F.cross_entropy)

    one_process(tmp_path, monkeypatch, build, steps=40, recompute_batch_norm=3)
    variables, _, _ = read_ckpt(tmp_path / "runs/h/ckpt-40.json")
    x, y = load_split(DIGITS, "train")
    assert_statistics(variables, recomputed(variables, first(3, batches(x, y, 32, 2, 0))))
    assert variables["1.num_batches_tracked"] == 3


def test_recompute_batch_norm_needs_batch_statistics(tmp_path, monkeypatch):
    def build(data):
        return mt.Model(mlp(), F.cross_entropy)

    with pytest.raises(MpipsError, match="keeps no BatchNorm running statistics") as e:
        one_process(tmp_path, monkeypatch, build, recompute_batch_norm=3)
    assert e.value.exit_code == 2


@pytest.mark.launcher
def test_an_async_run_and_an_export_recompute_the_statistics(tmp_path, monkeypatch, capsys):
    """The chief's statistics at the end of an async run are those of the final weights on
    its first 5 batches (checkpointed, and evaluated with); an export makes them anew from
    the job's train split."""
    from mpips.cli import main
    from mpips.data.batches import train_part

    (tmp_path / "bn_recompute.py").write_text(BN_NET)
    (tmp_path / "job.toml").write_text(BN_JOB)
    r = run_mpi(
        3, ["-m", "mpips", "train", "--no-progress", "--result", "r.json", "job.toml"], tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "recomputed the BatchNorm statistics (2 values) from 5 training batches" in r.stdout
    variables, _, _ = read_ckpt(tmp_path / "runs/bn/ckpt-60.json")
    x, y = load_split(DIGITS, "train", worker_rows(DIGITS.rows["train"], 2, 0))
    assert_statistics(variables, recomputed(variables, first(5, batches(x, y, 32, 4, 0))))
    net = mlp(norm=True)
    net.load_state_dict({k: torch.from_numpy(np.asarray(variables[k])) for k in net.state_dict()})
    net.eval()
    x_test, y_test = load_split(DIGITS, "test")
    with torch.no_grad():
        accuracy = float((net(torch.from_numpy(x_test)).argmax(1).numpy() == y_test).mean())
    result = json.loads((tmp_path / "r.json").read_text())
    assert accuracy == pytest.approx(result["test_accuracy"], abs=1e-6)

    monkeypatch.chdir(tmp_path)
    export = ["ckpt", "export", "runs/bn", "m.pt", "--recompute-batch-norm", "3"]
    assert main(export) == 2  # (no --job: the export needs the job's model and data)
    assert "--job JOB" in capsys.readouterr().err
    assert main([*export, "--job", "job.toml"]) == 0
    exported = {k: v.numpy() for k, v in torch.load(tmp_path / "m.pt").items()}
    part = train_part(DIGITS, (0, DIGITS.rows["train"]), 3 * 32, 1)  # (the whole split)
    assert_statistics(exported, recomputed(variables, first(3, part.batches(32, 4, 0))))
    assert exported["0.weight"].shape == (16, 64) and len(exported) == len(net.state_dict())

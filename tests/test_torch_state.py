"""mpips.torch's buffers and frozen parameters: each worker keeps its own, the chief's go
into every checkpoint under their state_dict names (so an export loads strictly), a resumed
run gives them back to every worker, and a module built differently on one rank is refused
by name."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import need, run_mpi, run_py, run_train
from test_optimizers_mpi import read_ckpt

import mpips
from mpips.data.batches import load_split, open_dataset, resolve_path

torch = need("torch")
mt = pytest.importorskip("mpips.torch")

NET = """
import os
import torch
import mpips.torch


def net():
    m = torch.nn.Sequential(
        torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
        torch.nn.Linear(16, 10),
    )
    m[3].bias.requires_grad_(False)  # a frozen parameter: kept, not trained
    return m


def build(data):
    return mpips.torch.Model(net(), torch.nn.CrossEntropyLoss())


def build_unseeded(data):
    if os.environ.get("PMI_RANK") == "2":
        torch.manual_seed(99)  # this rank builds another module
    return build(data)
"""

JOB = """
[model]
kind = "bnnet:{factory}"
[data]
builtin = "digits"
[optimizer]
learning_rate = 0.1
[train]
mode = "{mode}"
steps = {steps}
batch_size = 32
log_every = 0
[checkpoint]
dir = "runs/bn"
"""
KEPT = ["1.running_mean", "1.running_var", "1.num_batches_tracked", "3.bias"]


def write(tmp_path, mode="async", steps=100, factory="build"):
    (tmp_path / "bnnet.py").write_text(NET)  # (a name no other test imports)
    (tmp_path / "job.toml").write_text(JOB.format(mode=mode, steps=steps, factory=factory))


def module():
    scope: dict = {}
    exec(compile(NET, "bnnet.py", "exec"), scope)  # (the test's own source text)
    return scope["net"]()


def test_state_is_the_buffers_and_frozen_parameters():
    torch.manual_seed(0)
    model = mt.Model(module(), torch.nn.CrossEntropyLoss())
    assert [v.name for v in model.variables()] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "3.weight",
    ]
    state = model.state()
    assert sorted(state) == sorted(KEPT)
    state["1.running_mean"][:] = 7.0
    model.load_state(state)
    assert float(model.module[1].running_mean[0]) == 7.0


@pytest.mark.launcher
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_chiefs_buffers_are_checkpointed_exported_and_restored(tmp_path, mode):
    write(tmp_path, mode, 100)
    r = run_train(tmp_path, 3 if mode == "async" else 2, "job.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    variables, _, _ = read_ckpt(tmp_path / "runs/bn/ckpt-100.json")
    assert set(KEPT) <= set(variables)
    assert variables["1.num_batches_tracked"] > 0  # the chief's, trained: not the initial 0
    assert np.any(variables["1.running_mean"] != 0)
    e = run_py(["-m", "mpips", "ckpt", "export", "runs/bn", "m.pt"], tmp_path)
    assert e.returncode == 0, e.stdout + e.stderr
    m = module()
    m.load_state_dict(torch.load(tmp_path / "m.pt"))  # strict: every key, buffers too
    m.eval()
    x, y = load_split(open_dataset(resolve_path("", "digits")), "test")
    with torch.no_grad():
        accuracy = float((m(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
    assert accuracy == pytest.approx(r.result["test_accuracy"], abs=1e-6)
    # resumed: every worker's module starts from the checkpoint's buffers, not afresh
    r = run_train(tmp_path, 3 if mode == "async" else 2, "job.toml", "--steps", "101", "-v")
    assert r.returncode == 0, r.stdout + r.stderr
    restored = r.stdout.count("restored the model's state (4 values) from ckpt-100.json")
    assert restored == (2 if mode == "async" else 2), r.stdout


@pytest.mark.launcher
def test_a_module_built_differently_on_one_rank_is_refused_by_name(tmp_path):
    write(tmp_path, factory="build_unseeded")
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml"], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    said = (r.stdout + r.stderr).count("differs across ranks")
    assert said == 1 and "0.weight" in r.stdout + r.stderr, r.stdout + r.stderr


def test_a_seeded_factory_builds_the_same_module_everywhere(tmp_path, monkeypatch):
    """mpips seeds torch with model.init_seed before the factory: two builds agree."""
    from mpips.models.mlp import build_model

    write(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    job = mpips.load_job(str(tmp_path / "job.toml"))
    info = open_dataset(resolve_path("", "digits"))
    one = build_model(job.model, info, job_file=job.source).fingerprints()
    torch.rand(5)  # the global stream moved on: the seed puts it back
    two = build_model(job.model, info, job_file=job.source).fingerprints()
    assert one == two and "0.weight" in one

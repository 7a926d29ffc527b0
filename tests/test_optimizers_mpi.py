"""Stateful optimizers end to end: one async worker equals a single-process reference;
checkpoints keep slots; bounded staleness holds (plain pytest; each case launches mpiexec)."""

import numpy as np
import pytest
from conftest import read_result, run_mpi
from shared_runs import run_in_turn

from mpips.checkpoint import Checkpoint
from mpips.data.batches import batches, load_split, open_dataset, resolve_path
from mpips.job import parse_job
from mpips.models.mlp import MLP
from mpips.optim import build_optimizer, clip_by_global_norm, learning_rate

pytestmark = pytest.mark.launcher

JOB = """
[model]
hidden = [16]
[data]
builtin = "digits"
[optimizer]
kind = "{kind}"
learning_rate = {lr}
{extra}
[train]
steps = {steps}
batch_size = 32
seed = 3
log_every = 0
progress = false
[checkpoint]
dir = "{ckpt}"
"""
CASES = {
    "sgd": (0.1, 'schedule = "exponential"\ndecay_steps = 20\ndecay_rate = 0.5\nwarmup_steps = 5'),
    "momentum": (0.05, "nesterov = true\nclip_norm = 1.0"),
    "adagrad": (0.1, ""),
    "adam": (0.005, 'schedule = "step"\ndecay_steps = 15'),
    "ftrl": (0.1, "l1 = 0.001\nl2 = 0.001"),
}


def write_job(tmp_path, kind, steps, ckpt="runs/ckpt"):
    lr, extra = CASES[kind]
    text = JOB.format(kind=kind, lr=lr, extra=extra, steps=steps, ckpt=ckpt)
    (tmp_path / "job.toml").write_text(text)
    return parse_job(text)


def reference(job, steps):
    """Single process, same rules, same batches: the sequence one async worker must follow."""
    info = open_dataset(resolve_path("", "digits"))
    x, y = load_split(info, "train")
    model = MLP([64, *job.model.hidden, 10])
    params = model.initial_values(job.model.init_seed)
    opt = build_optimizer(job.optimizer)
    slots = {k: opt.init_slots(v) for k, v in params.items()}
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    stream = batches(x, y, job.train.batch_size, job.train.seed, 0)
    for step in range(steps):
        _, bx, by = next(stream)
        model.loss_and_grads(params, bx, by, grads)
        clip_by_global_norm(list(grads.values()), job.optimizer.clip_norm)
        lr = learning_rate(job.optimizer, step)
        for k in params:
            opt.apply(params[k], grads[k], slots[k], lr, step + 1)
    return params, slots


def read_ckpt(path):
    """(variables, slots ``<variable>/<slot>``, clocks) of a committed checkpoint."""
    ckpt = Checkpoint(path)
    return (*ckpt.read_all(), ckpt.clocks)


STANDIN = "momentum on the GPU stand-in"


@pytest.fixture(scope="module")
def one_worker_runs(tmp_path_factory):
    """Each optimizer's job (1 PS + 1 worker, 50 steps) trained, in two launches rather than
    one each (a launch's start-up is most of a case's time): the CPU ones in turn, and the
    GPU stand-in's (the worker clips its gradients on the device); each case (run_in_turn)."""
    d = tmp_path_factory.mktemp("one_worker")
    cases = {}
    for names, env in (([*CASES], {}), ([STANDIN], {"MPIPS_GPU_STANDIN": "1"})):
        for name in names:
            kind, _, on = name.partition(" on the ")
            text = JOB.format(
                kind=kind, lr=CASES[kind][0], extra=CASES[kind][1], steps=50, ckpt=f"runs/{name}"
            )
            (d / f"{name}.toml").write_text(
                text.replace("[train]", '[train]\ndevice = "gpu"') if on else text
            )
        cases |= run_in_turn(
            d, names, lambda todo, env=env: run_mpi(2, ["in_turn.py", *todo], d, 120, **env)
        )
    return d, cases


@pytest.mark.parametrize("kind", [*CASES, STANDIN])
def test_one_async_worker_equals_single_process_reference(one_worker_runs, kind):
    """(On the GPU stand-in, the worker clips its gradients on the device.)"""
    d, cases = one_worker_runs
    cases[kind].result()  # this case's own run ended (else: its failure alone, by name)
    on = kind == STANDIN
    assert ("computing on the GPU stand-in" in cases[kind].launch.stdout) == on
    job = parse_job((d / f"{kind}.toml").read_text())
    variables, slots, clocks = read_ckpt(d / f"runs/{kind}/ckpt-50.json")
    want, want_slots = reference(job, 50)
    assert clocks == [50]
    for name, value in want.items():
        np.testing.assert_allclose(variables[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert len(slots) == sum(len(s) for s in want_slots.values())
    for name, per_slot in want_slots.items():
        for slot, value in per_slot.items():
            np.testing.assert_allclose(
                slots[f"{name}/{slot}"], value, rtol=1e-5, atol=1e-6, err_msg=f"{name}/{slot}"
            )


@pytest.mark.parametrize("kind", ["adam", "ftrl"])
def test_checkpoint_round_trip_keeps_slots_and_data_position(tmp_path, kind):
    write_job(tmp_path, kind, 20, "runs/straight")
    assert run_mpi(2, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path).returncode == 0
    write_job(tmp_path, kind, 10, "runs/resumed")
    assert run_mpi(2, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path).returncode == 0
    write_job(tmp_path, kind, 20, "runs/resumed")
    r = run_mpi(2, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "restored global_step 10" in r.stdout and "resuming at batch 10" in r.stdout
    assert_same_checkpoints(
        tmp_path / "runs/resumed/ckpt-20.json", tmp_path / "runs/straight/ckpt-20.json"
    )


def assert_same_checkpoints(got_path, want_path):
    """The variables and slots of two checkpoints are the same, bit for bit."""
    for got, want in zip(read_ckpt(got_path)[:2], read_ckpt(want_path)[:2], strict=True):
        assert got.keys() == want.keys() and got
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_restoring_into_another_optimizer_names_the_missing_slot(tmp_path):
    write_job(tmp_path, "sgd", 5)
    assert run_mpi(2, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path).returncode == 0
    write_job(tmp_path, "adam", 10)
    r = run_mpi(2, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path)
    assert r.returncode == 2
    assert "has no optimizer slot 'dense_0/kernel/m'" in r.stderr and "--no-restore" in r.stderr


SLOW = """
import json, time, mpips
class Slow(mpips.Hook):
    def after_step(self, run, info):
        if run.role.task != 2:
            return
        if run.job.train.max_staleness is None and info.local_updates == 3:
            # unbounded: wait until the others have made 40 more updates (an event, not a
            # time), so they run well ahead however loaded the machine is, or all the rest
            # (a late start under load: else the wait ran into its deadline)
            target = min(info.step + 40, run.job.train.steps)
            deadline = time.monotonic() + 60
            while run.global_step() < target and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            time.sleep(0.004)  # bounded: a slow worker the others must wait for
with mpips.abort_on_error():
    job = mpips.load_job("job.toml")
    result = mpips.train(job, hooks=[Slow()])
    if result.role.is_chief:  # as train --result writes it
        json.dump(result.to_json(), open("result.json", "w"))
"""


@pytest.mark.parametrize("bound", [0, 1, None])
def test_bounded_staleness(tmp_path, bound):
    text = JOB.format(kind="adagrad", lr=0.1, extra="", steps=240, ckpt="")
    if bound is not None:
        text = text.replace("progress = false", f"progress = false\nmax_staleness = {bound}")
    (tmp_path / "job.toml").write_text(text)
    (tmp_path / "slow.py").write_text(SLOW)
    r = run_mpi(4, ["slow.py"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    staleness = read_result(tmp_path)["staleness"]  # per worker task, all of them
    assert len(staleness) == 3 and all(s["updates"] for s in staleness), staleness
    leads = {t: s["lead"]["max"] for t, s in enumerate(staleness)}
    if bound is None:
        assert max(leads[0], leads[1]) > 3, leads  # fast workers run ahead of the slow one
    else:
        assert max(leads.values()) <= bound, leads

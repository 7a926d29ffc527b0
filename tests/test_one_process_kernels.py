"""No compile of a fused kernel among a run's steps (issue 43, item 11). A run decides at
start-up, in each process, from the size of one update: where the numpy rule would cost an
update at least optim.PAYS_PER_UPDATE seconds, the kernel is loaded (from numba's cache on
disk, or compiled) before the first step; else the numpy rules run the whole run. Before, a
process started the compile once its numpy rules had taken COMPILE_AFTER seconds: in the
middle of the run, so a short benchmark read the compile as throughput."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpips
from mpips import optim
from mpips.optim import fused

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class KernelWatch(mpips.Hook):
    """Whether the adam kernel was loaded (or loading) at each step, and at the end."""

    def __init__(self):
        self.ready: list[bool] = []
        self.loading: list[bool] = []

    def after_step(self, run, info):
        self.ready.append("adam" in fused.KERNELS.ready)
        self.loading.append("adam" in fused.KERNELS.loaders)


@pytest.fixture
def no_kernel_yet(monkeypatch):
    """This process as if it had never loaded a kernel (the state is put back after)."""
    pytest.importorskip("numba")
    monkeypatch.setattr(fused, "KERNELS", fused.FusedKernels())  # (the old one put back after)
    optim.set_fused_kernels(True)


def one_process(monkeypatch, tmp_path, hidden: int, steps: int) -> KernelWatch:
    """The built-in digits, an MLP with ``hidden`` units, Adam, trained in this process."""
    monkeypatch.chdir(tmp_path)
    job = mpips.load_job(None)
    job.model.hidden = [hidden]
    job.optimizer.kind, job.optimizer.learning_rate = "adam", 0.001
    job.train.steps, job.train.progress, job.checkpoint.dir = steps, False, ""
    watch = KernelWatch()
    mpips.train(job, [watch], comm=MPI.COMM_SELF)
    return watch


def test_a_big_update_has_its_kernel_before_the_first_step(monkeypatch, tmp_path, no_kernel_yet):
    """64-1024-10: 77k elements an update, ~0.4 ms of the numpy Adam rule: the kernel is
    ready at the first step (the old code started its compile some steps in)."""
    watch = one_process(monkeypatch, tmp_path, 1024, 6)
    assert watch.ready == [True] * 6


def test_a_small_update_never_loads_a_kernel_mid_run(monkeypatch, tmp_path, no_kernel_yet):
    """64-16-10: 1.2k elements, ~6 us an update: the numpy rules all along, even once they
    have cost more than COMPILE_AFTER (set to 0 here: the old code began loading at the
    second step)."""
    monkeypatch.setattr(fused, "COMPILE_AFTER", 0.0)
    watch = one_process(monkeypatch, tmp_path, 16, 6)
    assert watch.loading == [False] * 6 and "adam" not in fused.KERNELS.loaders


def test_plan_kernel_weighs_one_update_of_the_numpy_rule(no_kernel_yet, monkeypatch):
    adam = optim.Optimizer("adam", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8})
    least = int(np.ceil(optim.PAYS_PER_UPDATE / optim.NUMPY_SECONDS_PER_ELEMENT["adam"]))
    monkeypatch.setattr(fused, "fused_kernel", lambda name, wait=True: None)  # (no load)
    run, kernel = optim.plan_kernel(adam, least - 1)
    assert kernel is None and run.numpy_only and run == adam
    run, kernel = optim.plan_kernel(adam, least)
    assert kernel == "adam" and not run.numpy_only
    assert optim.plan_kernel(optim.Optimizer("sgd"), 10**9)[1] == "sgd"
    optim.set_fused_kernels(False)
    assert optim.plan_kernel(adam, 10**9) == (adam, None)  # MPIPS_FUSED_KERNELS=0: none at all
    assert optim.await_kernel(None, 0.0)  # nothing planned: nothing to wait for


def test_a_numpy_only_optimizer_starts_no_compile(no_kernel_yet, monkeypatch):
    """However long its numpy rules take; and one this process has is used all the same."""
    monkeypatch.setattr(fused, "COMPILE_AFTER", 0.0)
    numpy_only = optim.Optimizer("sgd", numpy_only=True)
    var, grad = np.ones(4, np.float32), np.full(4, 2, np.float32)
    for t in range(1, 4):
        numpy_only.apply(var, grad, {}, 0.5, t)
    assert var.tolist() == [-2.0] * 4 and not fused.KERNELS.loaders
    optim.fused_kernel("sgd")  # loaded by someone else (another run in this process)
    calls = []
    kernel = fused.KERNELS.ready["sgd"]
    monkeypatch.setitem(fused.KERNELS.ready, "sgd", lambda *a: calls.append(a) or kernel(*a))
    numpy_only.apply(var, grad, {}, 0.5, 4)
    assert len(calls) == 1 and var.tolist() == [-3.0] * 4

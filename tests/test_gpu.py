"""On a real GPU (skipped without cupy and a CUDA device; benchmarks/gpu_check.sh runs them):
the fused update kernels give the numpy rules' bits, and one process trains on the GPU with
its variables there to the CPU's result."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpips
from mpips.optim import Optimizer, set_fused_kernels
from mpips.run.hooks import Hook

pytestmark = pytest.mark.gpu

RULES = [
    ("sgd", {}),
    ("momentum", {"momentum": 0.9, "nesterov": False}),
    ("momentum", {"momentum": 0.9, "nesterov": True}),
    ("adagrad", {"epsilon": 1e-7, "initial_accumulator_value": 0.1}),
    ("adam", {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}),
    ("ftrl", {"l1": 0.01, "l2": 0.001, "initial_accumulator_value": 0.1}),
]


@pytest.mark.parametrize(("kind", "hyper"), RULES)
def test_each_fused_gpu_kernel_gives_the_numpy_rules_bits(kind, hyper):
    import cupy

    from mpips.device import kernels as device_kernels

    rng = np.random.default_rng(0)
    optimizer = Optimizer(kind, hyper)
    var = rng.normal(size=(300, 70)).astype(np.float32)
    slots = optimizer.init_slots(var)
    d_var, d_slots = cupy.asarray(var), {k: cupy.asarray(v) for k, v in slots.items()}
    previous = set_fused_kernels(False)  # the host side: the numpy rules
    try:
        for t in range(1, 6):
            grad = rng.normal(size=var.shape).astype(np.float32)
            optimizer.apply(var, grad, slots, 0.01, t)
            set_fused_kernels(True)
            optimizer.apply(d_var, cupy.asarray(grad), d_slots, 0.01, t)
            set_fused_kernels(False)
    finally:
        set_fused_kernels(previous)
    assert device_kernels._compiled, "the cupy kernel was not used"
    np.testing.assert_array_equal(d_var.get(), var)
    for k, v in slots.items():
        np.testing.assert_array_equal(d_slots[k].get(), v, err_msg=k)


def test_the_fused_softmax_loss_gives_the_array_versions_values():
    """One kernel for the loss and its gradient on the GPU (the array version is 16
    launches): the same values as numpy's, to float32 rounding."""
    import cupy

    from mpips.device import kernels as device_kernels
    from mpips.layers import softmax_cross_entropy

    rng = np.random.default_rng(0)
    z = (rng.normal(size=(1024, 10)) * 5).astype(np.float32)
    y = rng.integers(0, 10, 1024)
    loss, d = softmax_cross_entropy(cupy, cupy.asarray(z), cupy.asarray(y))
    assert "softmax_xent" in device_kernels._compiled and not device_kernels._failed
    ref_loss, ref_d = softmax_cross_entropy(np, z, y)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(d.get(), ref_d, rtol=1e-4, atol=1e-8)


def test_a_gpu_worker_names_its_gpu():
    import cupy

    from mpips.device.backend import Device

    described = Device.select("gpu").describe()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    assert described.startswith(f"GPU 0 ({name}), cupy "), described


class Final(Hook):
    def end(self, run):
        self.variables = run.variables()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_one_process_on_the_gpu_trains_to_the_cpus_variables(tmp_path, monkeypatch, optimizer):
    """The crash of 2026-11-26 (a numpy batch reached the cupy model): one process with
    train.device = "gpu" now trains with its variables on the GPU, to the CPU's values
    (within float32 matrix-product rounding)."""
    monkeypatch.chdir(tmp_path)
    finals = {}
    for device in ("cpu", "gpu"):
        job = mpips.load_job(None)
        job.train.steps, job.train.progress, job.train.device = 20, False, device
        job.optimizer.kind, job.checkpoint.dir = optimizer, ""
        hook = Final()
        mpips.train(job, [hook], comm=MPI.COMM_SELF)
        finals[device] = hook.variables
    for name, value in finals["cpu"].items():
        np.testing.assert_allclose(finals["gpu"][name], value, rtol=1e-3, atol=1e-4)


GPU_JOB = """
[data]
builtin = "digits"
[optimizer]
kind = "{kind}"
learning_rate = {lr}
[train]
mode = "{mode}"
device = "{device}"
steps = 40
progress = false
log_every = 0
zero_copy = false
[checkpoint]
dir = "runs/{device}"
"""


@pytest.mark.launcher
@pytest.mark.parametrize(
    ("mode", "ranks", "kind", "lr"),
    [("async", 2, "sgd", 0.1), ("async", 2, "adam", 0.01), ("sync", 2, "adam", 0.01)],
)
def test_workers_on_the_gpu_train_to_the_cpus_variables(tmp_path, mode, ranks, kind, lr):
    """Under mpiexec, the paths one process does not take: async (1 PS + 1 worker: pulls
    into page-locked buffers, gradients copied out behind backward, SGD deltas scaled on
    the device) and sync with 2 replicas (gradients out as ready, the mean in, the update
    on each device), against the same job on the CPU (copied pulls): equal within float32
    matrix-product rounding."""
    from conftest import run_mpi
    from test_optimizers_mpi import read_ckpt

    finals = {}
    for device in ("cpu", "gpu"):
        (tmp_path / "job.toml").write_text(
            GPU_JOB.format(kind=kind, lr=lr, mode=mode, device=device)
        )
        r = run_mpi(ranks, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path, timeout=180)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        finals[device] = read_ckpt(tmp_path / f"runs/{device}/ckpt-40.json")[0]
    for name, value in finals["cpu"].items():
        np.testing.assert_allclose(finals["gpu"][name], value, rtol=1e-3, atol=1e-4)


@pytest.mark.launcher
@pytest.mark.parametrize("mode", ["async", "hybrid"])
def test_ctr_models_on_the_gpu_train_to_the_cpus_variables(tmp_path, mode):
    """Wide & deep with its tables split over 2 PS tasks and one worker on the GPU: the
    batch's rows copied in and their gradients out, the embedding lookups and their
    gradients as gathers and scatter-adds there (atomic adds: float32 sums in any order),
    async and hybrid (the dense part a replica on the device), against the CPU."""
    from conftest import run_mpi
    from test_ctr_mpi import JOB, small_dataset

    from mpips.checkpoint import Checkpoint

    small_dataset(tmp_path / "s.h5")
    finals = {}
    for device in ("cpu", "gpu"):
        text = JOB.format(model="wide_deep", rule="mod", opt="adagrad", lr=0.3, steps=30)
        text = text.replace("[train]\n", f'[train]\nmode = "{mode}"\ndevice = "{device}"\n')
        (tmp_path / "job.toml").write_text(text.replace('"runs/s"', f'"runs/{device}"'))
        r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--ps", "2"], cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        finals[device], _ = Checkpoint(tmp_path / f"runs/{device}/ckpt-30.json").read_all()
    for name, value in finals["cpu"].items():
        np.testing.assert_allclose(finals["gpu"][name], value, rtol=1e-3, atol=1e-5, err_msg=name)

"""The GPU path without a GPU: ``mpips.device.standin``, a strict stand-in for cupy, fails wherever
cupy would (host and device arrays mixed, implicit conversions) and counts every crossing;
one process trains on it exactly as on the CPU, moving each byte of a step once and making no
buffer after its first step. (Every mode on it under MPI: test_modes_mpi.py.)"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from test_layers import CASES

import mpips
from mpips.device import standin as sx
from mpips.device.arrays import array_module, scatter_add, to_host
from mpips.device.backend import Device, get_xp
from mpips.layers import Sequential
from mpips.optim import clip_by_global_norm
from mpips.run.hooks import Hook


def test_the_standin_refuses_host_arrays_wherever_cupy_does():
    d, h = sx.asarray(np.ones(3, np.float32)), np.ones(3, np.float32)
    mixes = {
        "device + host": lambda: d + h,
        "host + device": lambda: h + d,
        "host * device": lambda: h * d,
        "device += host": lambda: d.__iadd__(h),
        "device + a list": lambda: d + [1, 2, 3],
        "xp function of a host array": lambda: sx.maximum(h, 0),
        "xp function of both": lambda: sx.matmul(d, h),
        "a list with a host array": lambda: sx.concatenate([d, h]),
        "numpy ufunc of a device array": lambda: np.exp(d),
        "np.asarray of a device array": lambda: np.asarray(d),
        "a host index array": lambda: d[np.array([0, 1])],
        "a host array assigned in": lambda: d.__setitem__(slice(None), h),
    }
    for what, mix in mixes.items():
        with pytest.raises(TypeError):
            mix()
            pytest.fail(f"{what} did not raise")
    d[:] = 2.0  # scalars mix freely, as with cupy
    total = (d * np.float32(2) + 1).sum()
    assert isinstance(total, sx.ndarray) and total.ndim == 0 and float(total) == 15.0
    assert sx.maximum(d, 0).shape == (3,) and isinstance(d[sx.asarray(np.array([0]))], sx.ndarray)
    assert array_module(d) is sx and array_module(h) is np and to_host(d).tolist() == [2, 2, 2]


def test_the_standin_counts_each_crossing_and_allocation():
    sx.traffic.reset()
    d = sx.asarray(np.zeros((2, 3), np.float32))  # 24 bytes in, a new device array
    d.set(np.ones((2, 3), np.float32))  # 24 more, into it
    buf = sx.empty((2, 3), np.float32)
    host = np.empty((2, 3), np.float32)
    d.get(out=host)
    t = sx.traffic
    assert (t.h2d_copies, t.h2d_bytes, t.allocations) == (2, 48, 2)
    assert (t.d2h_copies, t.d2h_bytes) == (1, 24) and host.sum() == 6
    with pytest.raises(ValueError):
        d.set(np.ones(5, np.float32))  # another shape
    with pytest.raises(TypeError):
        buf.set(d)  # a device array is not a host array
    scatter_add(sx, buf, sx.asarray(np.array([0, 0])), sx.asarray(np.ones((2, 3), np.float32)))
    # launches, by name: views and empty arrays are none, a reshape that must copy is one
    t.reset()
    d.reshape(-1), d.T, d[0], sx.empty(3), d.ravel(), d.T.reshape(-1)
    (d + 1).sum(), d[sx.asarray(np.array([1]))]
    d[0] = 0
    assert dict(t.launches) == {"copy": 1, "add": 1, "sum": 1, "gather": 1, "setitem": 1}
    # a list index: cupy copies the list in (a new device array), then gathers
    t.reset()
    assert d[[1, 0]].get().tolist() == [[1.0] * 3, [0.0] * 3]
    assert dict(t.launches) == {"gather": 1}
    assert (t.h2d_copies, t.h2d_bytes, t.allocations, t.h2d_pageable) == (1, 16, 1, 16)


def test_gpu_is_the_standin_when_asked(monkeypatch):
    monkeypatch.setenv(sx.ENV, "1")
    assert get_xp("gpu") is sx
    device = Device.select("gpu")
    assert not device.on_host
    host = {"w": np.arange(4, dtype=np.float32)}
    staged = device.stage_in(host)["w"]
    assert isinstance(staged, sx.ndarray) and device.stage_in(host)["w"] is staged
    assert device.describe().startswith("the GPU stand-in") and Device().describe() == "the CPU"


def test_a_run_on_the_gpu_says_where_it_computes(monkeypatch, tmp_path, capsys):
    """The chief's first lines name the device (here the stand-in), so a log shows a GPU
    run is one; a CPU run says nothing of it."""
    one_process("gpu", monkeypatch, tmp_path, "sgd", 0.0)
    assert "computing on the GPU stand-in" in capsys.readouterr().out
    one_process("cpu", monkeypatch, tmp_path, "sgd", 0.0)
    assert "computing on" not in capsys.readouterr().out


class Recorder(Hook):
    """Each step's crossings and allocations (the stand-in's counters, from the end of the
    last step: making the batch counts too), and the final variables."""

    def __init__(self):
        self.steps, self.waits, self.launches, self.params = [], [], [], None

    def begin(self, run):
        sx.traffic.reset()

    def after_step(self, run, info):
        t = sx.traffic
        self.steps.append((t.h2d_bytes, t.d2h_bytes, t.allocations))
        self.waits.append(t.waits)
        self.launches.append(dict(t.launches))
        t.reset()

    def end(self, run):
        self.params = run.variables()


def one_process(
    device: str, monkeypatch, where, optimizer: str, clip: float, on_device=None, steps=12
):
    monkeypatch.setenv(sx.ENV, "1")
    monkeypatch.chdir(where)
    job = mpips.load_job(None)
    job.train.steps, job.train.progress, job.train.device = steps, False, device
    job.optimizer.kind, job.optimizer.clip_norm, job.checkpoint.dir = optimizer, clip, ""
    job.data.on_device = on_device
    recorder = Recorder()
    mpips.train(job, [recorder], comm=MPI.COMM_SELF)
    return recorder, job


@pytest.mark.parametrize("on_device", [None, False])
@pytest.mark.parametrize(("optimizer", "clip"), [("sgd", 0.0), ("momentum", 0.5), ("adam", 0.5)])
def test_one_process_on_the_standin_equals_the_cpu_and_copies_in_only_batches(
    monkeypatch, tmp_path, optimizer, clip, on_device
):
    """`python -m mpips train` with train.device = "gpu" (a numpy batch once reached the
    cupy model and crashed): the same variables as on the CPU, bit for bit, clipped or not;
    the variables and slots stay on the device, so after the first step nothing crosses
    (the data went to the device once: data.on_device unset) or only the batch
    (data.on_device = false), and no buffer is made on the device (but the scratch of the
    array rule for Adam that the stand-in runs: on cupy a fused kernel applies it). 50
    steps: the second epoch's batches too."""
    cpu, _ = one_process("cpu", monkeypatch, tmp_path, optimizer, clip, steps=50)
    gpu, job = one_process("gpu", monkeypatch, tmp_path, optimizer, clip, on_device, steps=50)
    assert cpu.params.keys() == gpu.params.keys()
    for name in cpu.params:
        np.testing.assert_array_equal(cpu.params[name], gpu.params[name], err_msg=name)
    assert len(gpu.steps) == job.train.steps and set(cpu.steps) == {(0, 0, 0)}
    batch = job.train.batch_size * (64 * 4 + 8)  # float32 digits, int64 labels
    scratch = 4 if optimizer == "adam" else 0  # one per variable
    # an epoch: 44 full batches; the second one's order (1437 rows) goes over before its first
    crossed = [0] * 43 + [1437 * 8] + [0] * 5 if on_device is None else [batch] * 49
    made = [scratch + (b == 1437 * 8) for b in crossed]  # (the order: a device array)
    assert [s[0] for s in gpu.steps[1:]] == crossed, gpu.steps
    assert [s[2] for s in gpu.steps[1:]] == made and {s[1] for s in gpu.steps} == {0}
    # the host waits for the device once a step, for the loss: not for the update, nor for
    # the norm of a clip, so the launches of the next step queue behind the update
    assert gpu.waits[1:] == [1] * 49 and set(cpu.waits) == {0}, gpu.waits


def test_a_one_process_step_launches_what_the_model_needs_and_no_more(monkeypatch, tmp_path):
    """The launches of a step (the host time of a GPU step is made of them: ~10-65 us each
    in cupy), counted on the stand-in for the digits MLP 64-64-10 with SGD, by what makes
    them. A change that adds launches to every step fails here (the ~90 matrix products a
    step that blocks of rows once made on an H100 would). On cupy the loss is one fused
    kernel and a mean, and each variable's update one fused kernel: 20 a step."""
    recorder, _ = one_process("gpu", monkeypatch, tmp_path, "sgd", 0.0, steps=6)
    want = {
        "the batch: rows and labels gathered on the device": {"gather": 2},
        "forward: a product and a bias a layer, ReLU between": {
            "matmul": 2,
            "add": 2,
            "maximum": 1,
        },
        "the softmax loss as arrays (cupy: one fused kernel and a mean)": {
            "max": 1,
            "sub": 2,
            "exp": 1,
            "sum": 1,
            "arange": 1,
            "gather": 2,
            "log": 1,
            "mean": 1,
            "truediv": 1,
            "isub": 1,
            "setitem": 1,
            "itruediv": 1,
        },
        "backward: bias and kernel gradients, the hidden input's, ReLU's mask": {
            "sum": 2,
            "matmul": 3,
            "gt": 1,
            "imul": 1,
        },
        "SGD as arrays, 4 variables (cupy: one fused kernel each)": {"mul": 4, "isub": 4},
    }
    total: dict[str, int] = {}
    for part in want.values():
        for name, n in part.items():
            total[name] = total.get(name, 0) + n
    for step, launched in enumerate(recorder.launches[1:], 2):
        assert launched == total, (step, launched, total)
    assert sum(total.values()) == 36


def test_one_process_on_a_device_gives_backward_no_ready_callback(monkeypatch, tmp_path):
    """Alone on a GPU the gradients stay on the device: backward gets no ``ready`` (with
    one, the MLP wrote each kernel's gradient in blocks of rows: ~90 matrix-product
    launches a step on the wide MLP, measured on an H100)."""
    from mpips.models.mlp import MLP

    given = []
    original = MLP.loss_and_grads

    def recording(self, params, x, y, grads, ready=None):
        given.append(ready)
        return original(self, params, x, y, grads, ready)

    monkeypatch.setattr(MLP, "loss_and_grads", recording)
    one_process("gpu", monkeypatch, tmp_path, "sgd", 0.0, steps=3)
    assert given == [None] * len(given) and len(given) >= 3, given


def test_a_part_too_big_for_the_device_stays_on_the_host(monkeypatch, tmp_path):
    """data.on_device unset: a part over a quarter of the device's free memory stays on the
    host and each batch crosses; true puts it there all the same."""
    monkeypatch.setattr(sx._Runtime, "memGetInfo", staticmethod(lambda: (1 << 20, 8 << 20)))
    batch = 32 * (64 * 4 + 8)  # the part: 1437 rows of 264 bytes, 379 KB > 1 MiB / 4
    host, _ = one_process("gpu", monkeypatch, tmp_path, "sgd", 0.0)
    assert {s[0] for s in host.steps[1:]} == {batch}
    forced, _ = one_process("gpu", monkeypatch, tmp_path, "sgd", 0.0, on_device=True)
    assert {s[0] for s in forced.steps[1:]} == {0}
    np.testing.assert_array_equal(host.params["dense_0/kernel"], forced.params["dense_0/kernel"])


def test_which_parts_go_to_the_device(monkeypatch):
    """data.on_device unset: a dense part goes when it fits in a quarter of the free memory
    shared among the workers on its GPU; a model with tables or a prepare() of its own, or
    sparse rows, keep it on the host (their ids are found there); true requires it, with a
    clear error where it cannot be."""
    from types import SimpleNamespace

    import scipy.sparse as sp

    from mpips.data.batches import InMemoryPart
    from mpips.errors import ConfigError
    from mpips.models.contract import Model
    from mpips.models.variables import VariableSpec
    from mpips.run.startup import _on_device

    class Tables(Model):
        def tables(self):
            return [VariableSpec("emb", (10, 2))]

    class Prepares(Model):
        @staticmethod
        def prepare(x):
            return x, None

    monkeypatch.setattr(sx._Runtime, "memGetInfo", staticmethod(lambda: (4000, 8000)))
    job = mpips.load_job(None)
    part = InMemoryPart(np.zeros((9, 10), np.float32), np.zeros(9, np.int64))  # 504 bytes

    def where(model, workers=1, rows=part, forced=None):
        job.data.on_device = forced
        cluster = SimpleNamespace(role="w", local_worker_index=0, local_workers=workers)
        return _on_device(job, cluster, rows, model, sx).xp

    assert where(Model()) is sx and where(Model(), workers=2) is np  # 504 > 4000 / 8
    assert where(Model(), workers=2, forced=True) is sx
    for model in (Tables(), Prepares()):
        assert where(model) is np
        with pytest.raises(ConfigError, match="the part stays on the host with a model with"):
            where(model, forced=True)
    csr = InMemoryPart(sp.csr_matrix(part.x), part.y)
    assert where(Model(), rows=csr) is np
    big = InMemoryPart(np.zeros((100, 10), np.float32), np.zeros(100, np.int64))
    assert where(Model(), rows=big) is np
    with pytest.raises(ConfigError, match="part takes 5.5 KiB, its GPU has 3.9 KiB free"):
        where(Model(), rows=big, forced=True)


def test_staged_gradients_copy_each_row_once_as_backward_says_it_is_ready():
    """A gradient said ready a block of rows at a time (a wide Dense kernel) reaches host
    memory block by block, before the reduction is told; nothing is copied twice."""
    device = Device(sx)
    host = {"w": np.zeros((6, 3), np.float32), "b": np.zeros(3, np.float32)}
    grads = device.mirrors(host)
    grads["w"][...] = sx.asarray(np.arange(18, dtype=np.float32).reshape(6, 3))
    grads["b"][...] = 7.0
    told = []
    staged = device.staged(grads, host)
    ready = staged.ready(lambda name, rows=None: told.append((name, rows, host[name].copy())))
    sx.traffic.reset()
    ready("w", 2)
    assert told[-1][1] == 2 and told[-1][2][:2].sum() == 15 and not told[-1][2][2:].any()
    ready("w", 5)
    assert told[-1][2][:5].sum() == 105 and not told[-1][2][5:].any()
    staged.finish()  # the last row, and the bias never said ready
    np.testing.assert_array_equal(host["w"], np.arange(18).reshape(6, 3))
    assert host["b"].tolist() == [7, 7, 7]
    assert sx.traffic.d2h_bytes == 18 * 4 + 3 * 4 and sx.traffic.d2h_copies == 4
    # no reduction to tell (buckets in shared memory): no callback, and at the end every
    # copy queued, then one wait for them all
    host["w"][...], host["b"][...], sx.traffic.waits = 0, 0, 0
    staged = device.staged(grads, host)
    assert staged.ready(None) is None
    staged.finish()
    np.testing.assert_array_equal(host["w"], np.arange(18).reshape(6, 3))
    assert host["b"].tolist() == [7, 7, 7] and sx.traffic.waits == 1
    on_cpu = Device().staged(host, host)
    assert on_cpu.ready(print) is print and on_cpu.ready(None) is None


def test_the_fused_softmax_loss_compiled_as_c_gives_the_array_versions_values(tmp_path):
    """The fused softmax cross-entropy kernel (device_kernels.SOFTMAX_XENT) cannot run
    without a GPU, but its loop body is plain C: compiled here and run over a batch, it
    gives the array version's loss and gradient (to float32 rounding: exp and the sum's
    order differ), and a label out of range gives a NaN loss (the run stops) rather than a
    read past the row."""
    import ctypes
    import shutil
    import subprocess

    from mpips.device.kernels import SOFTMAX_XENT
    from mpips.layers import softmax_cross_entropy

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = (
        "#include <math.h>\n#include <stddef.h>\n"
        "void xent(long count_, const float *z, const long long *y_, int classes, float rows,"
        " float *d, float *loss_) {\n#define loss (loss_[i])\n"
        "for (ptrdiff_t i = 0; i < count_; i++) { const long long y = y_[i]; "
        f"{SOFTMAX_XENT} }}\n#undef loss\n}}"
    )
    (tmp_path / "x.c").write_text(source)
    lib = tmp_path / "x.so"
    subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", str(tmp_path / "x.c"), "-o", str(lib), "-lm"], check=True
    )
    fn = ctypes.CDLL(str(lib)).xent
    f32 = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
    i64 = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
    fn.argtypes = [ctypes.c_long, f32, i64, ctypes.c_int, ctypes.c_float, f32, f32]
    rng = np.random.default_rng(0)
    z = (rng.normal(size=(257, 10)) * 5).astype(np.float32)
    y = rng.integers(0, 10, 257)
    d, losses = np.empty_like(z), np.empty(257, np.float32)
    fn(257, z, y, 10, 257.0, d, losses)
    loss, grad = softmax_cross_entropy(np, z, y)
    np.testing.assert_allclose(losses.mean(), loss, rtol=1e-5)
    np.testing.assert_allclose(d, grad, rtol=1e-4, atol=1e-8)
    y[3] = 10  # out of range: that row's loss is NaN, the others as they were
    fn(257, z, y, 10, 257.0, d, losses)
    assert np.isnan(losses[3]) and np.isfinite(np.delete(losses, 3)).all()


def test_a_fused_loss_that_fails_falls_back_to_the_array_version_once(monkeypatch):
    """If the fused softmax kernel cannot be compiled or loaded (here: no cupy to compile
    it with), the loss is the array version's, said once, and the kernel is not tried
    again."""
    from mpips.device import kernels as device_kernels
    from mpips.layers import softmax_cross_entropy

    rng = np.random.default_rng(0)
    z, y = rng.normal(size=(8, 3)).astype(np.float32), rng.integers(0, 3, 8)
    expected = softmax_cross_entropy(np, z, y)
    monkeypatch.setattr(device_kernels, "is_cupy", lambda a: True)
    monkeypatch.setattr(device_kernels, "_failed", [])
    with pytest.warns(UserWarning, match="the fused softmax loss failed"):
        loss, d = softmax_cross_entropy(sx, sx.asarray(z), sx.asarray(y))
    assert loss == expected[0] and len(device_kernels._failed) == 1
    np.testing.assert_array_equal(d.get(), expected[1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        softmax_cross_entropy(sx, sx.asarray(z), sx.asarray(y))


def test_the_gpu_kernels_loop_bodies_compiled_as_c_give_the_numpy_rules_bits(tmp_path):
    """The rules' CUDA kernels (Rule.cuda) cannot run without a GPU, but their loop bodies
    are plain C: compiled here with a C compiler (no contraction into fused multiply-adds,
    as --fmad=false on the GPU) and run over the same arrays, each must give the numpy
    rule's bits (a wrong operator, order or slot fails)."""
    import ctypes
    import shutil
    import subprocess

    from test_gpu import RULES

    from mpips import optim
    from mpips.optim import Optimizer, kernel_name, kernel_scalars, set_fused_kernels

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = ["#include <math.h>"]
    for rule in optim.RULES:
        name, (scalars, outputs, body) = rule.name, rule.cuda
        names = [p.split()[1] for p in scalars.split(",")]
        outs = ["var"] + [p.split()[1] for p in outputs.split(",") if p.strip()]
        args = ", ".join(
            ["long count_", "const float *g_"]
            + [f"float {s}" for s in names]
            + [f"float *{o}_" for o in outs]
        )
        defines = "".join(f"#define {o} ({o}_[k_])\n" for o in outs)
        undefs = "".join(f"#undef {o}\n" for o in outs)
        source.append(
            f"void mpips_{name}({args}) {{\n{defines}"
            f"for (long k_ = 0; k_ < count_; k_++) {{ const float g = g_[k_]; {body} }}\n"
            f"{undefs}}}"
        )
    (tmp_path / "k.c").write_text("\n".join(source))
    lib = tmp_path / "k.so"
    flags = ["-O2", "-ffp-contract=off", "-shared", "-fPIC"]  # (no fused multiply-add)
    subprocess.run([cc, *flags, str(tmp_path / "k.c"), "-o", str(lib), "-lm"], check=True)
    so = ctypes.CDLL(str(lib))
    ptr = np.ctypeslib.ndpointer(np.float32, flags="C_CONTIGUOUS")
    rng = np.random.default_rng(0)
    previous = set_fused_kernels(False)  # the numpy rules as the reference
    try:
        for kind, hyper in RULES:
            name = kernel_name(kind, hyper)
            optimizer = Optimizer(kind, hyper)
            var = rng.normal(size=1000).astype(np.float32)
            slots = optimizer.init_slots(var)
            c_var, c_slots = var.copy(), [slots[s].copy() for s in optimizer.slots]
            fn = getattr(so, f"mpips_{name}")
            for t in range(1, 6):
                grad = rng.normal(size=var.shape).astype(np.float32)
                optimizer.apply(var, grad, slots, 0.01, t)
                scalars = kernel_scalars(kind, hyper, 0.01, t)
                fn.argtypes = [ctypes.c_long, ptr, *[ctypes.c_float] * len(scalars)] + [ptr] * (
                    1 + len(c_slots)
                )
                fn(var.size, grad, *[float(s) for s in scalars], c_var, *c_slots)
            np.testing.assert_array_equal(c_var, var, err_msg=name)
            for k, a in zip(optimizer.slots, c_slots, strict=True):
                np.testing.assert_array_equal(a, slots[k], err_msg=f"{name} {k}")
    finally:
        set_fused_kernels(previous)


@pytest.mark.parametrize("case", list(CASES))
def test_every_layer_computes_on_the_device_as_on_the_host(case):
    """The layer library on the stand-in: each case's loss, gradients, metrics and
    predictions equal numpy's, with every array on the device (a layer that reached for a
    host array, or made one from a device array, raises)."""
    layers, in_shape, loss = CASES[case]
    host = Sequential(layers, in_shape, loss, seed=3)
    dev = Sequential(layers, in_shape, loss, seed=3)
    dev.xp = sx
    rng = np.random.default_rng(0)
    n = 6
    if "embedding" in case:
        x = rng.integers(0, 11, (n, *in_shape)).astype(np.float32)
    else:
        x = rng.normal(size=(n, *in_shape)).astype(np.float32)
    y = rng.integers(0, 2 if loss == "logistic" else 3, n)
    params = host.initial_values(0)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    d_params = {k: sx.asarray(v) for k, v in params.items()}
    d_grads = {k: sx.zeros(v.shape, v.dtype) for k, v in params.items()}
    want = host.loss_and_grads(params, x, y, grads)
    got = dev.loss_and_grads(d_params, sx.asarray(x), sx.asarray(y), d_grads)
    assert isinstance(got, float) and got == want
    for name in params:
        np.testing.assert_array_equal(d_grads[name].get(), grads[name], err_msg=name)
    metrics = dev.evaluate(d_params, sx.asarray(x), sx.asarray(y))
    np.testing.assert_equal(  # (NaN equal to NaN: an AUC of a one-class batch)
        {k: float(v) for k, v in metrics.items()},
        {k: float(v) for k, v in host.evaluate(params, x, y).items()},
    )
    np.testing.assert_array_equal(
        sx.asnumpy(dev.predict(d_params, sx.asarray(x))), host.predict(params, x)
    )


OVERLAP_JOB = """
[model]
hidden = [16]
[data]
builtin = "digits"
[optimizer]
kind = "sgd"
learning_rate = 0.1
[train]
mode = "async"
device = "gpu"
steps = 30
batch_size = 32
log_every = 0
zero_copy = false
overlap_pull = {overlap}
[checkpoint]
dir = "runs/p"
"""


@pytest.mark.launcher
@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_pull_takes_the_next_pull_during_backward_one_update_staler(tmp_path, overlap):
    """1 PS + 1 GPU worker (the stand-in): with train.overlap_pull each step's variables were
    pulled during the previous step's backward, before that step's own update was pushed,
    so it is SGD with its gradients one update late (step k at the variables after k - 1
    updates); without, one worker is plain SGD. Every update's delay says so."""
    from conftest import run_mpi
    from test_optimizers_mpi import read_ckpt

    text = OVERLAP_JOB.format(overlap=str(overlap).lower())
    (tmp_path / "job.toml").write_text(text)
    argv = ["-m", "mpips", "train", "job.toml", "--result", "r.json"]
    r = run_mpi(2, argv, cwd=tmp_path, **{sx.ENV: "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    variables, _, _ = read_ckpt(tmp_path / "runs/p/ckpt-30.json")
    delays = json.loads((tmp_path / "r.json").read_text())["staleness"][0]["delay"]
    assert (delays["p50"], delays["max"]) == ((1, 1) if overlap else (0, 0)), delays

    want = delayed_sgd(text, 30, fresh=lambda k: not overlap or k == 0)
    for name, value in want.items():
        np.testing.assert_allclose(variables[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def delayed_sgd(text: str, steps: int, fresh) -> dict[str, np.ndarray]:
    """One worker's SGD on OVERLAP_JOB's data and model in one process: step ``k`` takes its
    gradient at the variables as they are (``fresh(k)``) or as they were one update earlier
    (pulled during the last backward)."""
    from mpips.data.batches import batches, load_split, open_dataset, resolve_path
    from mpips.job import parse_job
    from mpips.models.mlp import MLP
    from mpips.optim import build_optimizer

    job = parse_job(text)
    info = open_dataset(resolve_path("", "digits"))
    stream = batches(*load_split(info, "train"), job.train.batch_size, job.train.seed, 0)
    model = MLP([64, *job.model.hidden, 10])
    params = model.initial_values(job.model.init_seed)
    opt = build_optimizer(job.optimizer)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    before = {k: v.copy() for k, v in params.items()}  # the variables one update ago
    for step in range(steps):
        _, x, y = next(stream)
        model.loss_and_grads(params if fresh(step) else before, x, y, grads)
        before = {k: v.copy() for k, v in params.items()}
        for name in params:
            opt.apply(params[name], grads[name], {}, job.optimizer.learning_rate, 1)
    return params


@pytest.mark.parametrize("clip", [0.5, 1e6])
@pytest.mark.parametrize("odd", [None, 0.0, math.nan, math.inf])
def test_clipping_on_the_device_gives_the_host_bits_without_a_wait(clip, odd):
    """clip_by_global_norm on device gradients: the host's bits (clipped, within the norm,
    all zero, a NaN or an infinity in a gradient) and the norm as a device scalar, with
    no wait for the device."""
    rng = np.random.default_rng(3)
    host = [rng.standard_normal(s).astype(np.float32) for s in [(7, 5), (5,), (300,)]]
    if odd == 0.0:
        host = [np.zeros_like(g) for g in host]
    elif odd is not None:
        host[1][3] = odd
    device = [sx.asarray(g) for g in host]
    sx.traffic.reset()
    with np.errstate(invalid="ignore"):  # (an infinity times 0, on both)
        norm = clip_by_global_norm(device, clip)
        assert sx.traffic.waits == 0 and isinstance(norm, sx.ndarray)
        expected = clip_by_global_norm(host, clip)
    assert float(norm) == expected or (math.isnan(expected) and math.isnan(float(norm)))
    for h, d in zip(host, device, strict=True):
        np.testing.assert_array_equal(d.get(), h)

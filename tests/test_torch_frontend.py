"""mpips.torch: a torch.nn.Module trained by mpips equals PyTorch's own training loop (one
process step for step; sync W replicas as one process with W x the batch; one async
worker as one process), its parameters and gradients alias mpips's buffers (no copies a
step), sparse embeddings move only the rows a batch touches, and a checkpoint exports to a
file that ``load_state_dict(torch.load(...))`` takes."""

from __future__ import annotations

import re
import textwrap

import numpy as np
import pytest
from conftest import need, run_mpi, run_py, run_train, streams
from test_optimizers_mpi import read_ckpt

import mpips
from mpips.data.batches import load_split, open_dataset, resolve_path
from mpips.errors import ConfigError
from mpips.run.hooks import Hook

torch = need("torch")
mt = pytest.importorskip("mpips.torch")

NET = """
import torch
import mpips.torch


def net(inputs=64, hidden=16, classes=10):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes)
    )


def build(data, hidden=16):
    return mpips.torch.Model(
        net(data.num_inputs, hidden, data.num_classes), torch.nn.CrossEntropyLoss()
    )
"""

JOB = """
[model]
kind = "net:build"
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
dir = "runs/t"
"""


def net(inputs=64, hidden=16, classes=10):
    """The network of NET, built the same way (seeded)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, classes)
    )


def write(tmp_path, mode: str, steps: int) -> mpips.Job:
    (tmp_path / "net.py").write_text(NET)
    text = JOB.format(mode=mode, steps=steps)
    (tmp_path / "job.toml").write_text(text)
    return mpips.parse_job(text)


def plain_loop(batches_of_each_step, lr: float):
    """PyTorch's own loop: SGD on the concatenation of each step's batches."""
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for xs, ys in batches_of_each_step:
        opt.zero_grad()
        x, y = torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys))
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    return {n: p.detach().numpy() for n, p in ref.named_parameters()}


def assert_equal(got: dict, want: dict, rtol=2e-4, atol=2e-6) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol, err_msg=name)


# -- one process, in this process ------------------------------------------------------------


class Recorder(torch.nn.Module):
    """The network, recording each training batch it sees."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, x):
        if self.training:
            self.seen.append(x.detach().clone())
        return self.inner(x)


class EachStep(Hook):
    """The variables after every step, and the frontend's binding traffic of each step."""

    def __init__(self, model):
        self.model, self.values, self.traffic = model, [], []

    def before_step(self, run):
        self.model.traffic.reset()

    def after_step(self, run, info):
        t = self.model.traffic
        self.traffic.append((t.views, t.copied_bytes))
        self.values.append(run.variables())


def one_process(tmp_path, monkeypatch, steps=12, optimizer=""):
    from mpi4py import MPI

    monkeypatch.chdir(tmp_path)
    job = write(tmp_path, "sync", steps)
    if optimizer:
        job.optimizer.kind = optimizer
    labels = []

    def loss(outputs, y):
        if outputs.requires_grad:
            labels.append(y.clone())
        return torch.nn.functional.cross_entropy(outputs, y)

    model = mt.Model(Recorder(net()), loss)
    hook = EachStep(model)
    result = mpips.train(job, [hook], comm=MPI.COMM_SELF, model=model)
    return model, hook, labels, result


def test_one_process_equals_a_plain_pytorch_loop_step_for_step(tmp_path, monkeypatch):
    """Same init, same batches, SGD: the variables after every step are PyTorch's."""
    model, hook, labels, result = one_process(tmp_path, monkeypatch)
    seen = model.module.seen
    assert len(seen) == len(labels) == 12 and result.global_step == 12
    ref = net()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step, (x, y) in enumerate(zip(seen, labels, strict=True)):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
        want = {f"inner.{n}": p.detach().numpy() for n, p in ref.named_parameters()}
        assert_equal(hook.values[step], want, rtol=1e-5, atol=1e-6)


def test_a_step_copies_no_parameter_or_gradient(tmp_path, monkeypatch):
    """After the first step binds them, parameters and .grad are views of mpips's buffers:
    a step makes no view anew and copies nothing (the traffic the frontend counts)."""
    model, hook, _, _ = one_process(tmp_path, monkeypatch, steps=6)
    first, *rest = hook.traffic
    assert first[0] == 2 * len(model.variables()) and first[1] == 0, first
    assert rest and set(rest) == {(0, 0)}, hook.traffic


def test_gradients_are_said_ready_as_autograd_finishes_them():
    """ready(name) comes from autograd's post-accumulate hooks, last layer first, once each,
    with the gradient already final in the push buffer when it is said."""
    model = mt.Model(net(), torch.nn.CrossEntropyLoss())
    params = model.initial_values(0)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 64)).astype(np.float32), rng.integers(0, 10, 8)
    said = []
    model.loss_and_grads(
        params, x, y, grads, lambda name, rows=None: said.append((name, grads[name].copy()))
    )
    assert [n for n, _ in said][:2] == ["2.bias", "2.weight"] or [n for n, _ in said][:2] == [
        "2.weight",
        "2.bias",
    ]
    assert sorted(n for n, _ in said) == sorted(params)
    for name, at_the_time in said:
        np.testing.assert_array_equal(at_the_time, grads[name])
    # and the gradients are PyTorch's
    ref = net()
    torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_a_gradient_lands_in_its_buffer_as_autograd_hands_it_over():
    """The push buffers are not zeroed before the forward (then added into: a pass over
    every gradient's bytes more, ~4% of the reference MLP's step, issue 50) but each
    written as autograd hands its gradient over, and .grad is then a view of it: the
    forward sees them as mpips left them, nothing more is copied, the gradients are
    PyTorch's, and a parameter that got none this step (a graph that changes) pushes zeros."""

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.extra, self.use_extra = net(), torch.nn.Linear(64, 10), True

        def forward(self, x):
            return self.inner(x) + (self.extra(x) if self.use_extra else 0)

    model = mt.Model(Branches(), torch.nn.CrossEntropyLoss())
    params = model.initial_values(0)
    grads = {k: np.full_like(v, 7.0) for k, v in params.items()}
    seen = []
    model.module.register_forward_pre_hook(
        lambda *_: seen.append(sorted({float(g.min()) for g in grads.values()}))
    )
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 64)).astype(np.float32), rng.integers(0, 10, 8)
    model.loss_and_grads(params, x, y, grads)
    assert seen == [[7.0]]
    ref = Branches()
    ref.load_state_dict(model.module.state_dict())
    torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-5, atol=1e-7)
    for n, p in model.module.named_parameters():
        assert p.grad.data_ptr() == grads[n].ctypes.data, n
    assert model.traffic.copied_bytes == 0
    for g in grads.values():
        g.fill(7.0)
    model.module.use_extra = False
    model.loss_and_grads(params, x, y, grads)
    assert not grads["extra.weight"].any() and not grads["extra.bias"].any()
    assert (grads["inner.0.weight"] != 7.0).all()


def test_a_gradient_that_arrives_twice_in_a_backward_is_summed():
    """A parameter used inside a reentrant checkpoint and outside it gets its gradient in
    two parts (two backward passes of autograd): the first is written into the buffer, the
    second added to it."""
    from torch.utils.checkpoint import checkpoint

    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)  # (the checkpoint's input needs a gradient: this one has)
            return checkpoint(lambda t: self.lin(torch.tanh(t)), h, use_reentrant=True)

    model = mt.Model(Shared(), torch.nn.CrossEntropyLoss())
    params = model.initial_values(0)
    grads = {k: np.full_like(v, 7.0) for k, v in params.items()}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 8)).astype(np.float32), rng.integers(0, 8, 4)
    model.loss_and_grads(params, x, y, grads)
    ref = Shared()
    torch.nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    for n, p in ref.named_parameters():
        np.testing.assert_allclose(grads[n], p.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_a_parameter_without_a_gradient_is_said_by_name():
    """A parameter the loss does not use is refused at the first step (not pushed as
    zeros): one ConfigError naming it and what to do."""
    module = torch.nn.ModuleDict({"used": torch.nn.Linear(4, 3), "spare": torch.nn.Linear(4, 3)})

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = module

        def forward(self, x):
            return self.m["used"](x)

    model = mt.Model(Net(), torch.nn.CrossEntropyLoss())
    params = model.initial_values(0)
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    with pytest.raises(ConfigError, match=r"m\.spare\.weight, m\.spare\.bias got no gradient"):
        model.loss_and_grads(params, np.ones((2, 4), np.float32), np.array([0, 1]), grads)


def test_parameters_that_are_not_float_are_refused():
    with pytest.raises(ConfigError, match="parameter '0.weight' is torch.bfloat16"):
        mt.Model(net().to(torch.bfloat16), torch.nn.CrossEntropyLoss())


# -- under mpiexec -------------------------------------------------------------------------


@pytest.mark.launcher
def test_sync_replicas_equal_one_process_with_w_times_the_batch(tmp_path):
    """Two sync replicas (the allreduce overlapping backward) equal PyTorch on the
    concatenation of their batches."""
    job = write(tmp_path, "sync", 15)
    r = run_train(tmp_path, 2, "job.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    variables, _, _ = read_ckpt(tmp_path / "runs/t/ckpt-15.json")
    assert_equal(variables, plain_loop(streams(job, 2, 15, sync=True), 0.1))


@pytest.mark.launcher
def test_one_async_worker_equals_one_process(tmp_path):
    """1 PS task + 1 worker, async: PyTorch's loop on that worker's batches."""
    job = write(tmp_path, "async", 15)
    r = run_train(tmp_path, 2, "job.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    variables, _, _ = read_ckpt(tmp_path / "runs/t/ckpt-15.json")
    assert_equal(variables, plain_loop(streams(job, 1, 15, sync=False), 0.1))


@pytest.mark.launcher
@pytest.mark.parametrize("mode", ["async", "sync_replicas"])
def test_export_loads_into_the_module_and_evaluates_as_the_run(tmp_path, mode):
    """ckpt export to a .pt file: load_state_dict(torch.load(...)) takes it (strict), and
    the module then gives the run's own test accuracy."""
    write(tmp_path, mode, 200)
    r = run_train(tmp_path, 3, "job.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    e = run_py(["-m", "mpips", "ckpt", "export", "runs/t", "model.pt"], tmp_path)
    assert e.returncode == 0, e.stdout + e.stderr
    module = net()
    module.load_state_dict(torch.load(tmp_path / "model.pt"))
    info = open_dataset(resolve_path("", "digits"))
    x, y = load_split(info, "test")
    with torch.no_grad():
        accuracy = float((module(torch.from_numpy(x)).argmax(1).numpy() == y).mean())
    assert accuracy == pytest.approx(r.result["test_accuracy"], abs=1e-6)
    assert accuracy > 0.8


@pytest.mark.launcher
def test_a_parameter_without_a_gradient_is_said_once_and_ends_the_job(tmp_path):
    write(tmp_path, "async", 20)
    (tmp_path / "net.py").write_text(
        NET.replace("torch.nn.Linear(hidden, classes)", "torch.nn.Linear(hidden, classes)")
        + textwrap.dedent(
            """
            class Spare(torch.nn.Module):
                def __init__(self, inner):
                    super().__init__()
                    self.inner, self.spare = inner, torch.nn.Linear(2, 2)

                def forward(self, x):
                    return self.inner(x)


            def build_spare(data):
                return mpips.torch.Model(Spare(net()), torch.nn.CrossEntropyLoss())
            """
        )
    )
    text = (tmp_path / "job.toml").read_text().replace("net:build", "net:build_spare")
    (tmp_path / "job.toml").write_text(text)
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml"], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    said = re.findall(r"spare\.weight, spare\.bias got no gradient", r.stdout + r.stderr)
    assert len(said) == 1, r.stdout + r.stderr


def test_the_readme_shows_the_shipped_pytorch_example():
    from conftest import ROOT

    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(import torch\n.*?)```", readme, re.S).group(1)
    assert code == (ROOT / "jobs/torch_net.py").read_text()
    assert "mpirun -n 3 python -m mpips train jobs/torch_net.toml" in readme


@pytest.mark.launcher
def test_the_readme_pytorch_example_trains(tmp_path):
    import shutil

    from conftest import ROOT

    for name in ("torch_net.py", "torch_net.toml"):
        shutil.copy(ROOT / "jobs" / name, tmp_path / name)
    r = run_train(tmp_path, 3, "torch_net.toml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.result["global_step"] == 600 and r.result["test_accuracy"] > 0.9, r.result


class Crossings(Hook):
    """The stand-in device's host/device traffic and the frontend's, each step."""

    def __init__(self, model):
        self.model, self.steps, self.values = model, [], None

    def before_step(self, run):
        from mpips.device import standin

        standin.traffic.reset()
        self.model.traffic.reset()

    def after_step(self, run, info):
        from mpips.device import standin

        t, f = standin.traffic, self.model.traffic
        self.steps.append((t.h2d_bytes, t.d2h_bytes, t.allocations, f.views, f.copied_bytes))

    def end(self, run):
        self.values = run.variables()


def test_on_a_gpu_worker_the_module_computes_on_the_devices_arrays(tmp_path, monkeypatch):
    """train.device = "gpu" on the strict stand-in for cupy: the module's tensors are
    DLPack views of the device arrays, so after the first step only the batch crosses (the
    one replica's variables stay on the device), nothing is allocated, nothing is viewed or
    copied anew; and the variables are the CPU run's."""
    from mpi4py import MPI

    from mpips.device import standin

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(standin.ENV, "1")
    values = {}
    for device in ("cpu", "gpu"):
        job = write(tmp_path, "sync", 8)
        job.train.device, job.checkpoint.dir = device, ""
        model = mt.Model(net(), torch.nn.CrossEntropyLoss())
        hook = Crossings(model)
        mpips.train(job, [hook], comm=MPI.COMM_SELF, model=model)
        values[device] = hook.values
    batch = 16 * (64 * 4 + 8)  # float32 rows, int64 labels
    assert hook.steps[1:] and set(hook.steps[1:]) == {(batch, 0, 0, 0, 0)}, hook.steps
    assert_equal(values["gpu"], values["cpu"], rtol=1e-5, atol=1e-6)


@pytest.mark.launcher
def test_async_gpu_workers_on_the_stand_in(tmp_path):
    """1 PS task + 2 GPU workers (the stand-in): pulls staged in, gradients staged out
    through mpips's own crossings, the module computing on the device arrays."""
    write(tmp_path, "async", 200)
    text = (tmp_path / "job.toml").read_text().replace("[train]", '[train]\ndevice = "gpu"')
    (tmp_path / "job.toml").write_text(text)
    r = run_train(tmp_path, 3, "job.toml", MPIPS_GPU_STANDIN="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU stand-in" in r.stdout and r.result["test_accuracy"] > 0.7, r.result


def test_a_run_starts_from_a_state_dict_the_factory_loads(tmp_path, monkeypatch):
    """A state_dict loaded in the factory (an export of an earlier run, say) is what the
    chief writes to the PS tasks: the run's first pull is those values."""
    from mpi4py import MPI

    monkeypatch.chdir(tmp_path)
    saved = net().state_dict()
    for t in saved.values():
        t.add_(1.0)  # (not what a fresh build makes)
    torch.save(saved, tmp_path / "start.pt")

    def factory(data):
        module = net()
        module.load_state_dict(torch.load(tmp_path / "start.pt"))
        return mt.Model(module, torch.nn.CrossEntropyLoss())

    class First(Hook):
        def begin(self, run):
            self.values = run.variables()

    job = write(tmp_path, "sync", 1)
    job.checkpoint.dir = ""
    first = First()
    mpips.train(job, [first], comm=MPI.COMM_SELF, model=factory)
    assert_equal(first.values, {n: t.numpy() for n, t in saved.items()}, rtol=0, atol=0)

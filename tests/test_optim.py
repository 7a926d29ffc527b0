"""Update rules against independent textbook formulas; the fused kernels against the numpy
rules; schedules; clipping."""

import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from mpips import optim
from mpips.optim import Optimizer, clip_by_global_norm, fused, learning_rate

RNG = np.random.default_rng(0)
GRADS = [RNG.standard_normal(5) for _ in range(4)]
VAR0 = RNG.standard_normal(5)
HYPER = {
    "momentum": 0.9,
    "nesterov": False,
    "epsilon": 1e-7,
    "initial_accumulator_value": 0.1,
    "beta1": 0.9,
    "beta2": 0.999,
    "l1": 0.05,
    "l2": 0.01,
}


def reference(kind, lr, hyper):
    """The same rules as papers/TF write them, one scalar formula at a time (float64)."""
    var, state = VAR0.copy(), {}
    for t, g in enumerate(GRADS, start=1):
        if kind == "sgd":
            var = var - lr * g
        elif kind == "momentum":
            m = hyper["momentum"] * state.get("m", 0) + g
            state["m"] = m
            var = var - lr * (g + hyper["momentum"] * m if hyper["nesterov"] else m)
        elif kind == "adagrad":
            acc = state.get("acc", hyper["initial_accumulator_value"]) + g**2
            state["acc"] = acc
            var = var - lr * g / (np.sqrt(acc) + hyper["epsilon"])
        elif kind == "adam":
            b1, b2 = hyper["beta1"], hyper["beta2"]
            m = b1 * state.get("m", 0) + (1 - b1) * g
            v = b2 * state.get("v", 0) + (1 - b2) * g**2
            state.update(m=m, v=v)
            mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
            # TF folds the bias correction into the step: epsilon scales by 1 / sqrt(1 - b2^t)
            var = var - lr * mhat / (np.sqrt(vhat) + hyper["epsilon"] / np.sqrt(1 - b2**t))
        elif kind == "ftrl":
            n_old = state.get("n", hyper["initial_accumulator_value"])
            n = n_old + g**2
            z = state.get("z", 0) + g - (np.sqrt(n) - np.sqrt(n_old)) / lr * var
            state.update(n=n, z=z)
            var = np.where(
                np.abs(z) <= hyper["l1"],
                0.0,
                -(z - np.sign(z) * hyper["l1"]) / (np.sqrt(n) / lr + 2 * hyper["l2"]),
            )
    return var, state


@pytest.mark.parametrize(
    "kind,nesterov",
    [
        ("sgd", False),
        ("momentum", False),
        ("momentum", True),
        ("adagrad", False),
        ("adam", False),
        ("ftrl", False),
    ],
)
def test_rule_matches_textbook(kind, nesterov):
    hyper = dict(HYPER, nesterov=nesterov)
    opt = Optimizer(kind, hyper)
    var = VAR0.copy()
    slots = opt.init_slots(var)
    for t, g in enumerate(GRADS, start=1):
        opt.apply(var, g, slots, 0.1, t)
    want, state = reference(kind, 0.1, hyper)
    np.testing.assert_allclose(var, want, rtol=1e-10, atol=1e-12)
    if kind == "adagrad":
        np.testing.assert_allclose(slots["accumulator"], state["acc"], rtol=1e-12)
    if kind == "ftrl":
        np.testing.assert_allclose(slots["z"], state["z"], rtol=1e-10)
        np.testing.assert_allclose(slots["n"], state["n"], rtol=1e-12)


def test_ftrl_l1_gives_exact_zeros():
    opt = Optimizer("ftrl", dict(HYPER, l1=10.0))
    var = VAR0.astype(np.float32)
    slots = opt.init_slots(var)
    opt.apply(var, GRADS[0].astype(np.float32), slots, 0.1, 1)
    assert var.dtype == np.float32 and not var.any()


def test_slots_per_optimizer():
    assert Optimizer("sgd").slots == () and not Optimizer("sgd").stateful
    assert Optimizer("adam", HYPER).slots == ("m", "v")
    init = Optimizer("adagrad", HYPER).init_slots(np.zeros(3, np.float32))
    assert init["accumulator"].dtype == np.float32 and (init["accumulator"] == 0.1).all()


# -- the fused kernels (numba) against the numpy rules ------------------------------------

FUSED = [
    ("sgd", {}),
    ("momentum", {"nesterov": False}),
    ("momentum", {"nesterov": True}),
    ("adagrad", {}),
    ("adam", {}),
    ("ftrl", {"l1": 5.0, "l2": 0.01}),  # l1 about the median |z|: some weights 0, not all
]


def numpy_rule(kind, hyper, var, grad, slots, lr, t):
    """The numpy reference functions, called directly (never through a kernel)."""
    h = hyper
    if kind == "sgd":
        optim.apply_sgd(var, grad, lr)
    elif kind == "momentum":
        optim.apply_momentum(var, grad, slots["momentum"], lr, h["momentum"], h["nesterov"])
    elif kind == "adagrad":
        optim.apply_adagrad(var, grad, slots["accumulator"], lr, h["epsilon"])
    elif kind == "adam":
        optim.apply_adam(
            var, grad, slots["m"], slots["v"], lr, t, h["beta1"], h["beta2"], h["epsilon"]
        )
    else:
        optim.apply_ftrl(var, grad, slots["z"], slots["n"], lr, h["l1"], h["l2"])


def random_state(opt, shape, seed=1):
    """A float32 variable, the rule's initial slots, and gradients of several scales."""
    rng = np.random.default_rng(seed)
    var = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    slots = opt.init_slots(var)
    grads = [
        (rng.standard_normal(shape) * s).astype(np.float32) for s in (1.0, 1e-2, 1e-4, 0.3, 3.0)
    ]
    return var, slots, grads


@pytest.mark.parametrize(
    "kind,extra", FUSED, ids=["sgd", "momentum", "nesterov", "adagrad", "adam", "ftrl"]
)
def test_fused_kernel_equals_the_numpy_rule(kind, extra):
    pytest.importorskip("numba")
    hyper = dict(HYPER, **extra)
    opt = Optimizer(kind, hyper)
    var, slots, grads = random_state(opt, (37, 29))  # not a multiple of any vector width
    ref_var, ref_slots = var.copy(), {k: v.copy() for k, v in slots.items()}
    for t, g in enumerate(grads, start=1):  # t > 1: Adam's bias correction moves
        lr = 0.01 * t
        assert optim.fused_apply(kind, hyper, var, g, slots, lr, t), "the kernel did not run"
        numpy_rule(kind, hyper, ref_var, g, ref_slots, lr, t)
        assert var.dtype == np.float32 and all(s.dtype == np.float32 for s in slots.values())
        np.testing.assert_allclose(var, ref_var, rtol=1e-6, atol=1e-9, err_msg=f"step {t}")
        for name in slots:
            np.testing.assert_allclose(slots[name], ref_slots[name], rtol=1e-6, err_msg=name)
    assert not np.array_equal(var, random_state(opt, (37, 29))[0])  # it did update
    if kind == "ftrl":
        assert 0 < np.count_nonzero(var == 0) < var.size  # both sides of the L1 threshold
    # the same bits, not just close: a process switches from the numpy rule to the kernel
    # once it has compiled, and sync replicas or a resumed run must not see the switch
    np.testing.assert_array_equal(var, ref_var)
    for name in slots:
        np.testing.assert_array_equal(slots[name], ref_slots[name])


def test_optimizer_apply_goes_through_the_kernel_once_it_is_compiled(monkeypatch):
    pytest.importorskip("numba")
    opt = Optimizer("adam", HYPER)
    kernel = optim.fused_kernel("adam")  # compiled (or loaded from the cache) here
    assert kernel is not None
    calls = []
    monkeypatch.setitem(fused.KERNELS.ready, "adam", lambda *a: calls.append(a) or kernel(*a))
    var, slots, grads = random_state(opt, (5, 3))
    opt.apply(var, grads[0], slots, 0.1, 1)
    assert len(calls) == 1 and calls[0][0].base is var  # in place, through a flat view


def test_first_updates_run_the_numpy_rule_while_the_kernel_compiles(monkeypatch):
    opt = Optimizer("adam", HYPER)
    release = threading.Event()
    compiling = threading.Thread(target=release.wait)  # a compile that takes its time
    compiling.start()
    monkeypatch.setattr(fused, "KERNELS", fused.FusedKernels())
    fused.KERNELS.loaders["adam"] = compiling
    try:
        var, slots, grads = random_state(opt, (8, 6))
        want, want_slots = var.copy(), {k: v.copy() for k, v in slots.items()}
        numpy_rule("adam", HYPER, want, grads[0], want_slots, 0.1, 1)
        opt.apply(var, grads[0], slots, 0.1, 1)  # returns without waiting for it
        assert compiling.is_alive()
        np.testing.assert_array_equal(var, want)
        np.testing.assert_array_equal(slots["m"], want_slots["m"])
    finally:
        release.set()
        compiling.join()


def test_the_kernel_compiles_only_once_the_numpy_rule_has_cost_as_much(monkeypatch):
    """numba costs ~0.8 s of CPU to load: a process starts compiling a kernel only once the
    numpy rule, applying updates the kernel could apply, has taken COMPILE_AFTER seconds
    (a small model's short run never loads it); the numpy rule runs until the kernel is
    ready, then the kernel. Updates no kernel fits (float64) do not count."""
    pytest.importorskip("numba")
    optim.fused_kernel("sgd")  # (in the cache: the compile below is a load)
    started = []
    real = optim.fused_kernel
    monkeypatch.setattr(fused, "KERNELS", fused.FusedKernels())
    monkeypatch.setattr(
        fused, "fused_kernel", lambda name, wait=True: started.append(name) or real(name, wait)
    )
    ticks = iter(range(1000))  # each numpy rule "takes" a little over a tenth of COMPILE_AFTER
    clock = SimpleNamespace(thread_time=lambda: next(ticks) * optim.COMPILE_AFTER / 9.5)
    monkeypatch.setattr(fused, "time", clock)
    opt = Optimizer("sgd", {})
    var, grad = np.ones(4, np.float32), np.full(4, 2, np.float32)
    wide, wide_grad = var.astype(np.float64), grad.astype(np.float64)
    for t in range(1, 11):
        opt.apply(var, grad, {}, 0.5, t)
        opt.apply(wide, wide_grad, {}, 0.5, t)  # (no kernel for float64: never counted)
    assert started == [] and var.tolist() == wide.tolist() == [-9.0] * 4  # the numpy rule
    opt.apply(var, grad, {}, 0.5, 11)  # due: the compile starts (in the background)
    assert started == ["sgd"] and var.tolist() == [-10.0] * 4
    fused.KERNELS.loaders["sgd"].join()
    calls = []
    kernel = fused.KERNELS.ready["sgd"]
    monkeypatch.setitem(fused.KERNELS.ready, "sgd", lambda *a: calls.append(a) or kernel(*a))
    opt.apply(var, grad, {}, 0.5, 12)
    assert len(calls) == 1 and var.tolist() == [-11.0] * 4


@pytest.mark.launcher
def test_a_short_job_loads_neither_numba_nor_scipy(tmp_path):
    """A small dense job on one node (1 PS + 2 workers, zero copy and the control counters
    in shared memory) loads no numba on any rank (the atomics come from libatomic, and its
    updates are too small for a fused kernel to pay) and no scipy (sparse data only): ~1.3
    s of CPU a process, which a 3-rank job on 2 cores paid at each start before."""
    from conftest import run_mpi

    from mpips.store import atomics

    if atomics.backend_name() != "libatomic":
        pytest.skip("no libatomic here: the atomics come from numba")
    code = (
        "import sys\nimport mpips\n"
        "job = mpips.load_job(None)\n"
        "job.train.steps, job.train.progress, job.checkpoint.dir = 30, False, ''\n"
        "mpips.train(job)\n"
        "got = sorted({m.split('.')[0] for m in sys.modules} & {'numba', 'scipy'})\n"
        "print(f'loaded: {got}', flush=True)\n"
    )
    out = run_mpi(3, ["-c", code], tmp_path, MPIPS_VERBOSE="1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("loaded: []") == 3, out.stdout[-3000:]
    assert "zero copy" in out.stdout or "zero_copy" in out.stdout, out.stdout[-3000:]


@pytest.mark.parametrize(
    "why",
    [
        "float64",
        "strided",
        "read-only slot",
        "read-only gradient",
        "shapes differ",
        "kernels off",
        "numba missing",
    ],
)
def test_numpy_rule_runs_where_no_kernel_fits(monkeypatch, why):
    opt = Optimizer("adam", HYPER)
    var, slots, grads = random_state(opt, (8, 6))
    grad = grads[0]
    if why == "float64":
        var, grad = var.astype(np.float64), grad.astype(np.float64)
        slots = opt.init_slots(var)
    elif why == "strided":
        var, grad = var[:, ::2], grad[:, ::2]
        slots = {k: v[:, ::2] for k, v in slots.items()}
    elif why == "read-only slot":
        slots["m"].flags.writeable = False
    elif why == "read-only gradient":  # the kernels are compiled for writable arrays only
        grad.flags.writeable = False
    elif why == "shapes differ":
        grad = grad.reshape(6, 8)
    elif why == "kernels off":
        monkeypatch.setattr(fused.KERNELS, "enabled", False)
    else:  # numba cannot be imported: the kernel never becomes ready, with one warning
        monkeypatch.setitem(sys.modules, "numba", None)
        monkeypatch.setattr(fused, "KERNELS", fused.FusedKernels())
        with pytest.warns(UserWarning, match="numba is not available"):
            assert optim.fused_kernel("adam") is None
    before = var.copy()
    assert optim.fused_apply("adam", HYPER, var, grad, slots, 0.1, 1) is False
    assert optim.fused_apply("adam", HYPER, var, grad, slots, 0.1, 1, wait=False) is False
    np.testing.assert_array_equal(var, before)  # untouched: the numpy rule's to do
    if why in ("read-only slot", "shapes differ"):
        return  # the numpy rule refuses these too
    want, want_slots = var.copy(), {k: v.copy() for k, v in slots.items()}
    numpy_rule("adam", HYPER, want, grad, want_slots, 0.1, 1)
    opt.apply(var, grad, slots, 0.1, 1)  # falls back to the numpy rule
    np.testing.assert_array_equal(var, want)
    np.testing.assert_array_equal(slots["v"], want_slots["v"])


def test_kernel_names():
    assert optim.kernel_name("sgd", {}) == "sgd"
    assert optim.kernel_name("momentum", {"nesterov": True}) == "nesterov"
    assert optim.kernel_name("momentum", {"nesterov": False}) == "momentum"


def cfg(**kw):
    base = dict(
        learning_rate=1.0, schedule="constant", decay_rate=0.5, decay_steps=10, warmup_steps=0
    )
    return SimpleNamespace(**dict(base, **kw))


def test_schedules():
    assert learning_rate(cfg(), 123) == 1.0
    assert learning_rate(cfg(schedule="exponential"), 5) == pytest.approx(0.5**0.5)
    assert learning_rate(cfg(schedule="step"), 19) == 0.5
    assert learning_rate(cfg(schedule="step"), 20) == 0.25
    warm = cfg(warmup_steps=4)
    assert [learning_rate(warm, s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_clip_by_global_norm():
    a, b = np.array([3.0, 0.0]), np.array([4.0])
    assert clip_by_global_norm([a, b], 10.0) == 5.0 and a[0] == 3.0
    assert clip_by_global_norm([a, b], 1.0) == 5.0
    np.testing.assert_allclose(np.concatenate([a, b]), [0.6, 0.0, 0.8])


def test_settings_the_rule_does_not_read_are_named():
    """A setting changed from its default that the job's rule ignores is said (nesterov with
    adagrad, a decay with the constant schedule); the defaults and the rule's own are not."""
    from mpips.job import OptimizerConfig

    said = optim.unused_settings(
        OptimizerConfig(kind="adagrad", nesterov=True, beta2=0.99, epsilon=1e-3, decay_rate=0.5)
    )
    assert said == [
        "optimizer.nesterov = True has no effect: kind 'adagrad' does not use it",
        "optimizer.beta2 = 0.99 has no effect: kind 'adagrad' does not use it",
        "optimizer.decay_rate = 0.5 has no effect: the constant schedule does not use it",
    ]
    assert optim.unused_settings(OptimizerConfig()) == []
    for kind in optim.HYPER:
        assert optim.unused_settings(OptimizerConfig(kind=kind)) == [], kind
    stepped = OptimizerConfig(kind="momentum", nesterov=True, schedule="step", decay_steps=10)
    assert optim.unused_settings(stepped) == []
    assert optim.unused_settings(OptimizerConfig(kind="ftrl", l1=0.1, momentum=0.5)) == [
        "optimizer.momentum = 0.5 has no effect: kind 'ftrl' does not use it"
    ]

"""Update rules, written once as in-place array functions (numpy or cupy), plus learning-rate
schedules and gradient clipping.

The same functions serve the PS apply loop (async), the replicas (sync) and any reference
implementation, so every path computes bit-for-bit the same arithmetic. On the CPU, float32
updates go through fused kernels (numba, one pass over memory) that do the numpy rules'
operations in the same order, so they give the same bits; see ``fused_apply``.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .device.backend import array_module
from .device.kernels import device_apply, is_cupy
from .process import settings

Array = Any  # numpy.ndarray or cupy.ndarray


# -- the rules: var and slots are updated in place ----------------------------------------


def apply_sgd(var: Array, grad: Array, lr: float) -> None:
    var -= lr * grad


def sgd_deltas(grads: Iterable[Array], lr: float) -> None:
    """Plain SGD as deltas, in place (``grad *= -lr``): what a worker pushes for a PS to add
    (Accumulate) instead of applying apply_sgd itself."""
    for grad in grads:
        grad *= -lr


def apply_momentum(
    var: Array, grad: Array, m: Array, lr: float, momentum: float, nesterov: bool
) -> None:
    """TF's ApplyMomentum: m = mu m + g; var -= lr (g + mu m) if nesterov else lr m."""
    m *= momentum
    m += grad
    if nesterov:
        var -= lr * (grad + momentum * m)
    else:
        var -= lr * m


def apply_adagrad(var: Array, grad: Array, acc: Array, lr: float, epsilon: float) -> None:
    """acc += g^2; var -= lr g / (sqrt(acc) + eps)."""
    acc += grad * grad
    var -= lr * grad / (array_module(var).sqrt(acc) + epsilon)


def apply_adam(
    var: Array,
    grad: Array,
    m: Array,
    v: Array,
    lr: float,
    t: int,
    beta1: float,
    beta2: float,
    epsilon: float,
) -> None:
    """Adam with bias correction folded into the step size (TF's ApplyAdam); t counts from 1.

    Written in place with two scratch arrays instead of ~6 temporaries (24% faster on the
    reference model), in the same order of operations as the plain expression.
    """
    xp = array_module(var)
    a = xp.multiply(grad, 1 - beta1, out=xp.empty_like(grad))  # an array even for a scalar
    m *= beta1
    m += a
    xp.multiply(grad, 1 - beta2, out=a)
    a *= grad
    v *= beta2
    v += a
    lr_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
    b = xp.sqrt(v)
    b += epsilon
    xp.multiply(m, lr_t, out=a)
    a /= b
    var -= a


def apply_ftrl(
    var: Array, grad: Array, z: Array, n: Array, lr: float, l1: float, l2: float
) -> None:
    """FTRL-Proximal (McMahan et al. 2013; TF's ApplyFtrl with lr_power = -0.5)."""
    xp = array_module(var)
    n_new = n + grad * grad
    sigma = (xp.sqrt(n_new) - xp.sqrt(n)) / lr
    z += grad - sigma * var
    n[...] = n_new
    quadratic = xp.sqrt(n) / lr + 2 * l2
    # soft threshold: -(z - sign(z) l1) / quadratic where |z| > l1, exactly 0 elsewhere
    var[...] = (xp.clip(z, -l1, l1) - z) / quadratic


# -- fused kernels: the same rules in one pass over memory (CPU, float32) ------------------
#
# The numpy rules above make one pass over memory per operator, with temporaries (Adam: ~10
# array passes, FTRL: ~15). These loops read every element once and write the variable and
# its slots once. They do the numpy rules' float32 operations in the same order: the
# hyper-parameters go in as float32, as numpy casts a Python float against a float32 array,
# and there is no fast-math (no fused multiply-add, no reordering, IEEE sqrt and division),
# so they give the numpy rules' results bit for bit (tests/test_optim.py checks it).
# error_model="numpy" drops the division-by-zero check that keeps LLVM from vectorising.
# Serial: the PS shares its cores with the workers. numba compiles a kernel once the numpy
# rules have cost a process COMPILE_AFTER s (below) and caches it on disk where it can
# write; without numba, or for arrays that are not C-contiguous float32 numpy arrays (cupy,
# float64, strided views), the numpy rules above run. (numexpr was measured too: slower
# than numpy here; docs/performance.md.)


def _sgd_kernel(var, grad, lr):
    for i in range(var.size):
        var[i] -= lr * grad[i]


def _momentum_kernel(var, grad, m, lr, momentum):
    for i in range(var.size):
        mi = m[i] * momentum + grad[i]
        m[i] = mi
        var[i] -= lr * mi


def _nesterov_kernel(var, grad, m, lr, momentum):
    for i in range(var.size):
        gi = grad[i]
        mi = m[i] * momentum + gi
        m[i] = mi
        var[i] -= lr * (gi + momentum * mi)


def _adagrad_kernel(var, grad, acc, lr, epsilon):
    for i in range(var.size):
        gi = grad[i]
        ai = acc[i] + gi * gi
        acc[i] = ai
        var[i] -= lr * gi / (np.sqrt(ai) + epsilon)


def _adam_kernel(var, grad, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, lr_t, epsilon):
    for i in range(var.size):
        gi = grad[i]
        mi = m[i] * beta1 + gi * one_minus_beta1
        vi = v[i] * beta2 + gi * one_minus_beta2 * gi
        m[i] = mi
        v[i] = vi
        var[i] -= mi * lr_t / (np.sqrt(vi) + epsilon)


def _ftrl_kernel(var, grad, z, n, lr, l1, two_l2):
    for i in range(var.size):
        gi = grad[i]
        n_old = n[i]
        n_new = n_old + gi * gi
        root = np.sqrt(n_new)
        sigma = (root - np.sqrt(n_old)) / lr
        zi = z[i] + (gi - sigma * var[i])
        z[i] = zi
        n[i] = n_new
        clipped = zi  # np.clip(z, -l1, l1); a NaN passes through, as in numpy
        if clipped < -l1:
            clipped = -l1
        elif clipped > l1:
            clipped = l1
        var[i] = (clipped - zi) / (root / lr + two_l2)


# name: (the loop, its array arguments, its float32 scalar arguments)
_KERNELS: dict[str, tuple[Callable[..., None], int, int]] = {
    "sgd": (_sgd_kernel, 2, 1),
    "momentum": (_momentum_kernel, 3, 2),
    "nesterov": (_nesterov_kernel, 3, 2),
    "adagrad": (_adagrad_kernel, 3, 2),
    "adam": (_adam_kernel, 4, 6),
    "ftrl": (_ftrl_kernel, 4, 3),
}
_F32 = np.dtype(np.float32)

_fused_enabled: bool | None = None  # set_fused_kernels's word; None: MPIPS_FUSED_KERNELS's
_ready: dict[str, Callable[..., None]] = {}  # compiled for float32 and run once
# Loading numba costs a process ~0.8 s of CPU (on 2 busy cores, half a small job's start-up).
# A process starts compiling a kernel only once the numpy rules, applying updates that
# kernel could apply, have cost it this many seconds (about what loading numba costs): a
# small model never loads it, a big one has its kernel after a few updates, and neither
# pays more than about twice the cheaper choice. The bits are the same either way.
COMPILE_AFTER = 0.3
_rule_seconds = [0.0]  # this process's CPU time in those rules (each thread's, summed)
_loaders: dict[str, threading.Thread] = {}  # the thread that compiles each kernel
_failed: set[str] = set()  # kernels that could not be had (numba missing, a failed compile)
_lock = threading.Lock()
# A run decides at start-up instead (plan_kernel), so that no compile lands among its steps:
# the kernel is loaded before the first step where an update costs the numpy rule at least
# PAYS_PER_UPDATE seconds (the kernel saves ~half of that, or more: numba's ~0.5-0.8 s of
# CPU to load is back within ~2000 updates), else never in that run. The numpy rules' CPU
# time per float32 element (1M-element arrays, the 2-vCPU VM, docs/performance.md):
NUMPY_SECONDS_PER_ELEMENT = {
    "sgd": 0.8e-9,
    "momentum": 1.7e-9,
    "nesterov": 2.0e-9,
    "adagrad": 2.7e-9,
    "adam": 5.3e-9,
    "ftrl": 8.7e-9,
}
PAYS_PER_UPDATE = 2e-4


def set_fused_kernels(enabled: bool) -> bool:
    """Use the fused kernels (True, the default unless ``MPIPS_FUSED_KERNELS=0``) or always
    the numpy rules (False) in this process; returns the previous setting."""
    global _fused_enabled
    previous, _fused_enabled = fused_kernels_on(), enabled
    return previous


def fused_kernels_on() -> bool:
    """Whether the fused kernels are used in this process: set_fused_kernels's word, else
    MPIPS_FUSED_KERNELS (default 1)."""
    return settings.cached().fused_kernels if _fused_enabled is None else _fused_enabled


def kernel_name(kind: str, hyper: dict[str, Any]) -> str | None:
    """The fused kernel of an optimizer, or None (none for it)."""
    if kind == "momentum" and hyper.get("nesterov"):
        return "nesterov"
    return kind if kind in _KERNELS else None


def fused_kernel(name: str, wait: bool = True) -> Callable[..., None] | None:
    """The compiled kernel ``name`` (sgd, momentum, nesterov, adagrad, adam, ftrl), or None:
    numba missing, the compile failed, or (``wait=False``) not ready yet.

    The first request starts a thread that imports numba and compiles the kernel for
    float32 arrays, or loads it from numba's cache on disk: ~0.7-0.8 s of CPU on a 2-vCPU
    VM, mostly numba's own start-up. ``wait=False`` returns at once, so a caller runs the
    numpy rule until the kernel is ready rather than stalling an update.
    """
    kernel = _ready.get(name)
    if kernel is not None:
        return kernel
    with _lock:
        loader = _loaders.get(name)
        if loader is None:  # not a daemon: an exit waits for it rather than kill a compile
            loader = threading.Thread(target=_compile, args=(name,), name=f"mpips-{name}-kernel")
            _loaders[name] = loader
            loader.start()
    if wait:
        loader.join()
    return _ready.get(name)


def plan_kernel(optimizer: Optimizer, elements: int) -> tuple[Optimizer, str | None]:
    """At a run's start-up, in a process each of whose updates applies ``optimizer``'s rule
    to ``elements`` float32 elements on the CPU: the optimizer for the run, and the fused
    kernel it starts loading now, in the background (await_kernel before the first step),
    where one update costs the numpy rule at least PAYS_PER_UPDATE seconds. Else no kernel,
    and the run's optimizer keeps the numpy rules (``numpy_only``): no compile starts among
    its steps (a kernel this process already has is used; the bits are the same)."""
    name = kernel_name(optimizer.kind, optimizer.hyper)
    if name is None or not fused_kernels_on():
        return optimizer, None
    if elements * NUMPY_SECONDS_PER_ELEMENT[name] < PAYS_PER_UPDATE:
        return replace(optimizer, numpy_only=True), None
    fused_kernel(name, wait=False)
    return replace(optimizer, numpy_only=False), name


def await_kernel(name: str | None, timeout: float) -> bool:
    """Wait up to ``timeout`` s for plan_kernel's kernel ``name`` (None: none planned) to be
    loaded; whether it is. A compile slower than that goes on in the background, the numpy
    rule running meanwhile (never a hang)."""
    if name is None:
        return True
    loader = _loaders.get(name)
    if loader is not None:
        loader.join(timeout)
    return name in _ready


def _compile(name: str) -> None:
    try:
        import numba
    except Exception as e:  # not installed, or built for another numpy
        warnings.warn(f"mpips: numba is not available ({e}); using the numpy rules", stacklevel=1)
        _failed.add(name)
        return
    source, arrays, scalars = _KERNELS[name]
    try:  # compiled once per machine, then loaded from numba's cache next to this file
        kernel = numba.njit(source, cache=True, nogil=True, error_model="numpy")
    except RuntimeError:  # no writable cache directory: compile in every process
        kernel = numba.njit(source, nogil=True, error_model="numpy")
    try:  # for 1-D C-contiguous float32 arrays and float32 scalars, as fused_apply calls it
        kernel(*[np.zeros(1, np.float32) for _ in range(arrays)], *[np.float32(1)] * scalars)
    except Exception as e:
        warnings.warn(
            f"mpips: fused {name} kernel failed ({e}); using the numpy rule", stacklevel=1
        )
        _failed.add(name)
        return
    _ready[name] = kernel


def _fits(var: Array, grad: Array, slots: list[Array]) -> bool:
    """numpy arrays of one shape, float32, C-contiguous, aligned and writable: the one array
    type the kernels are compiled for (another would be compiled here, on the caller's
    time)."""
    shape = var.shape
    for a in (var, grad, *slots):
        if type(a) is not np.ndarray or a.dtype != _F32 or a.shape != shape:
            return False
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable and flags.aligned):
            return False
    return True


def fused_apply(
    kind: str,
    hyper: dict[str, Any],
    var: Array,
    grad: Array,
    slots: dict[str, Array],
    lr: float,
    t: int,
    wait: bool = True,
    load: bool = True,
) -> bool | None:
    """``kind``'s rule by its fused kernel, in place, where one fits: True. False (nothing
    done) where the numpy rule must run instead: kernels off or unavailable, arrays that
    are not C-contiguous float32 numpy arrays of one shape, or (``load=False``) a kernel
    not loaded yet. None (nothing done, the numpy rule runs) where the kernel fits but is
    not compiled yet (``wait=False``): its compile starts once the numpy rules have taken
    COMPILE_AFTER seconds (Optimizer.apply counts them). The result is the numpy rule's,
    bit for bit."""
    name = kernel_name(kind, hyper)
    if name is None or not fused_kernels_on():
        return False
    arrays = [slots[s] for s in SLOTS[kind]]
    if not _fits(var, grad, arrays):
        return False
    kernel = _ready.get(name)
    if kernel is None:
        if name in _failed or not load:
            return False
        if not (wait or _rule_seconds[0] >= COMPILE_AFTER):
            return None  # not worth loading numba yet
        kernel = fused_kernel(name, wait)
        if kernel is None:  # compiling (None), or it failed
            return False if name in _failed else None
    # ravel: views of C-contiguous arrays, so the kernel writes into var and slots
    kernel(
        var.ravel(), grad.ravel(), *[a.ravel() for a in arrays], *kernel_scalars(kind, hyper, lr, t)
    )
    return True


_constants: dict[tuple[Any, ...], tuple[np.float32, ...]] = {}  # float32 hyper-parameters


def kernel_scalars(kind: str, hyper: dict[str, Any], lr: float, t: int) -> tuple[Any, ...]:
    """A kernel's scalar arguments, in float32 (as numpy casts a Python float against a
    float32 array)."""
    f32 = np.float32
    if kind == "adam":
        b1, b2, eps = hyper["beta1"], hyper["beta2"], hyper["epsilon"]
        lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)  # in float64, as apply_adam
        key: tuple[Any, ...] = (kind, b1, b2, eps)
        if (c := _constants.get(key)) is None:
            c = _constants[key] = (f32(b1), f32(1 - b1), f32(b2), f32(1 - b2))
        return (*c, f32(lr_t), f32(eps))
    if kind == "sgd":
        return (f32(lr),)
    if kind == "momentum":
        return f32(lr), f32(hyper["momentum"])
    if kind == "adagrad":
        return f32(lr), f32(hyper["epsilon"])
    return f32(lr), f32(hyper["l1"]), f32(2 * hyper["l2"])  # ftrl


# -- optimizers: a rule, its hyper-parameters and its slots -------------------------------


@dataclass(frozen=True)
class Optimizer:
    """An update rule with its hyper-parameters; ``slots`` are the per-variable state arrays."""

    kind: str
    hyper: dict[str, Any] = field(default_factory=dict)
    # a run's start-up found its updates too small for a fused kernel to pay (plan_kernel):
    # none is loaded while it runs (one this process already has is used)
    numpy_only: bool = field(default=False, compare=False)

    @property
    def slots(self) -> tuple[str, ...]:
        return SLOTS[self.kind]

    @property
    def stateful(self) -> bool:
        """Has slots, so a PS applies it (plain SGD is a delta the workers Accumulate); with
        zero copy the workers apply every rule themselves."""
        return bool(self.slots)

    def init_slots(self, var: np.ndarray) -> dict[str, np.ndarray]:
        init = self.hyper.get("initial_accumulator_value", 0.0)
        start = {"accumulator": init, "n": init}
        return {s: np.full_like(var, start.get(s, 0.0)) for s in self.slots}

    def apply(self, var: Array, grad: Array, slots: dict[str, Array], lr: float, t: int) -> None:
        """Update ``var`` and its ``slots`` in place with ``grad``; ``t`` is the 1-based update
        count. C-contiguous float32 numpy arrays go through the fused kernel once it is
        compiled (in the background, once the numpy rules have taken COMPILE_AFTER
        seconds of this process), float32 cupy arrays through the same rule's cupy kernel
        (device/kernels.py), anything else through the numpy or cupy rule above; all give
        the same bits."""
        h = self.hyper
        if is_cupy(var):  # a GPU: the rule's cupy kernel
            name = kernel_name(self.kind, h)
            if name is not None and fused_kernels_on():
                arrays = [slots[s] for s in SLOTS[self.kind]]
                if device_apply(name, var, grad, arrays, kernel_scalars(self.kind, h, lr, t)):
                    return
        else:
            fused = fused_apply(self.kind, h, var, grad, slots, lr, t, False, not self.numpy_only)
            if fused:
                return
            if fused is None:  # a kernel would fit: the numpy rule's time counts towards it
                start = time.thread_time()  # (CPU: not the time others ran meanwhile)
                self._array_rule(var, grad, slots, lr, t)
                _rule_seconds[0] += time.thread_time() - start
                return
        self._array_rule(var, grad, slots, lr, t)

    def _array_rule(
        self, var: Array, grad: Array, slots: dict[str, Array], lr: float, t: int
    ) -> None:
        """The rule as array operations (numpy or cupy), in place."""
        h = self.hyper
        if self.kind == "sgd":
            apply_sgd(var, grad, lr)
        elif self.kind == "momentum":
            apply_momentum(var, grad, slots["momentum"], lr, h["momentum"], h["nesterov"])
        elif self.kind == "adagrad":
            apply_adagrad(var, grad, slots["accumulator"], lr, h["epsilon"])
        elif self.kind == "adam":
            apply_adam(
                var, grad, slots["m"], slots["v"], lr, t, h["beta1"], h["beta2"], h["epsilon"]
            )
        elif self.kind == "ftrl":
            apply_ftrl(var, grad, slots["z"], slots["n"], lr, h["l1"], h["l2"])
        else:
            raise ValueError(f"unknown optimizer {self.kind!r}")


SLOTS: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("momentum",),
    "adagrad": ("accumulator",),
    "adam": ("m", "v"),
    "ftrl": ("z", "n"),
}
HYPER: dict[str, tuple[str, ...]] = {
    "sgd": (),
    "momentum": ("momentum", "nesterov"),
    "adagrad": ("epsilon", "initial_accumulator_value"),
    "adam": ("beta1", "beta2", "epsilon"),
    "ftrl": ("l1", "l2", "initial_accumulator_value"),
}


def unused_settings(cfg: Any) -> list[str]:
    """The [optimizer] settings a job changes from their defaults that its rule does not
    read (``nesterov = true`` with ``kind = "adagrad"``; ``decay_rate`` with the constant
    schedule), each said with why, so a run says so rather than train without them."""
    default = type(cfg)()
    notes = [
        (k, f"kind {cfg.kind!r} does not use it")
        for k in dict.fromkeys(sum(HYPER.values(), ()))
        if k not in HYPER[cfg.kind]
    ]
    if cfg.schedule == "constant":
        notes += [
            (k, "the constant schedule does not use it") for k in ("decay_rate", "decay_steps")
        ]
    return [
        f"optimizer.{k} = {getattr(cfg, k)!r} has no effect: {why}"
        for k, why in notes
        if getattr(cfg, k) != getattr(default, k)
    ]


def build_optimizer(cfg: Any) -> Optimizer:
    """The optimizer named by a job's [optimizer] table."""
    return Optimizer(cfg.kind, {k: getattr(cfg, k) for k in HYPER[cfg.kind]})


# -- learning-rate schedules and clipping -------------------------------------------------


def learning_rate(cfg: Any, step: int) -> float:
    """The learning rate for an update computed at global step ``step`` (0-based).

    ``constant``; ``exponential``: lr * rate^(step / decay_steps); ``step``: lr *
    rate^floor(step / decay_steps); then a linear warm-up over ``warmup_steps`` if set.
    """
    lr = cfg.learning_rate
    if cfg.schedule == "exponential":
        lr *= cfg.decay_rate ** (step / cfg.decay_steps)
    elif cfg.schedule == "step":
        lr *= cfg.decay_rate ** (step // cfg.decay_steps)
    if cfg.warmup_steps:
        lr *= min(1.0, (step + 1) / cfg.warmup_steps)
    return lr


def clip_by_global_norm(
    grads: list[Array], clip_norm: float, total: Callable[[float], float] | None = None
) -> Any:
    """Scale all gradients in place so their joint L2 norm is at most ``clip_norm``.

    Returns the norm before clipping. ``clip_norm <= 0`` means no clipping: nothing is
    computed (this runs on every step) and 0.0 is returned. ``total``: the sum of squares
    over every process holding a part of the gradients, from this one's (sync replicas).
    Gradients on a device (and no ``total``) are clipped there and the norm is a device
    scalar: the host never waits for the device (see _clip_on_device).
    """
    if clip_norm <= 0:
        return 0.0
    if total is None and grads and array_module(grads[0]) is not np:
        return _clip_on_device(grads, clip_norm)
    squares = sum(float((g.astype("float64") ** 2).sum()) for g in grads)
    norm = math.sqrt(total(squares) if total else squares)
    if norm > clip_norm:
        for g in grads:
            g *= clip_norm / norm
    return norm


def _clip_on_device(grads: list[Array], clip_norm: float) -> Array:
    """clip_by_global_norm's bits without reading the norm on the host: the squares summed
    in float64 in the same order, the scale ``clip_norm / max(norm, clip_norm)`` (exactly 1
    when the norm is within it, or NaN) rounded to the gradients' dtype as a Python float
    would be. Every gradient is multiplied, by 1 where nothing is clipped, so no branch
    needs the norm: the launches queue behind backward and the host goes on."""
    xp = array_module(grads[0])
    norm = xp.sqrt(sum((g.astype("float64") ** 2).sum() for g in grads))
    scale = clip_norm / xp.fmax(norm, clip_norm)
    for g in grads:
        g *= scale.astype(g.dtype)
    return norm


def global_norm_clip(
    clip_norm: float,
) -> Callable[[list[Array], Callable[[float], float]], None] | None:
    """Clipping to ``clip_norm`` as a callable (parts, total) for code that moves the
    gradients in parts (allreduce's replicas): clip_by_global_norm; None without clipping."""
    if clip_norm <= 0:
        return None

    def clip(parts: list[Array], total: Callable[[float], float]) -> None:
        clip_by_global_norm(parts, clip_norm, total)

    return clip

"""The update rules, one object each: a ``Rule`` holds its array form (numpy or cupy), its
fused loop for the CPU (numba), its fused kernel for a GPU (cupy), the scalars those two take,
its slots and the settings it reads, together. Adding a rule is adding one ``Rule`` to RULES
below (and its kind to the job's ``optimizer.kind`` choices, mpips/job.py); nothing else
names a rule.

The array forms are the reference: in-place functions the PS apply loop (async), the replicas
(sync) and any reference implementation call, so every path computes bit for bit the same
arithmetic. The fused forms read every element once and write the variable and its slots
once, where the array forms make one pass over memory per operator, with temporaries (Adam:
~10 array passes, FTRL: ~15). They do the array forms' float32 operations in the same order:
the hyper-parameters go in as float32, as numpy casts a Python float against a float32 array,
and there is no fast-math (no fused multiply-add, no reordering, IEEE sqrt and division), so
they give the array forms' results bit for bit (tests/test_optim.py checks the CPU loops,
tests/test_gpu_standin.py the GPU loop bodies compiled as C, tests/test_gpu.py on a GPU).
How they are compiled and when they run: fused.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..device.arrays import array_module

Array = Any  # numpy.ndarray or cupy.ndarray
Hyper = dict[str, Any]
f32 = np.float32


class CudaForm(NamedTuple):
    """A rule's cupy ElementwiseKernel: its float32 scalar parameters, its outputs besides
    ``var`` and the loop body; every kernel also takes the gradient ``g`` and writes ``var``.
    The body's C is that of the rule's numba loop, in the same order."""

    scalars: str
    outputs: str
    body: str


def _always(hyper: Hyper) -> bool:
    return True


@dataclass(frozen=True)
class Rule:
    """One update rule, every form of it. ``array(var, grad, slots, lr, t, hyper)`` updates
    ``var`` and ``slots`` (by name) in place, numpy or cupy arrays of any dtype; ``loop(var,
    grad, *slots, *scalars)`` does the same over 1-D float32 numpy arrays (compiled by numba);
    ``cuda`` on float32 cupy arrays; ``scalars(hyper, lr, t)`` are the float32 scalar
    arguments of both fused forms. ``t`` is the 1-based update count."""

    name: str  # the rule's, and its fused kernels' (``mpips_<name>`` on a GPU)
    kind: str  # the [optimizer] kind it is a rule of
    settings: tuple[str, ...]  # the [optimizer] settings that kind reads
    slots: tuple[str, ...]  # the per-variable state arrays, in the fused forms' order
    array: Callable[[Array, Array, dict[str, Array], float, int, Hyper], None]
    loop: Callable[..., None]
    scalars: Callable[[Hyper, float, int], tuple[np.float32, ...]]
    cuda: CudaForm
    numpy_seconds: float  # the array form's CPU time per float32 element (fused.plan_kernel)
    accumulators: tuple[str, ...] = ()  # slots that start at initial_accumulator_value
    serves: Callable[[Hyper], bool] = _always  # its kind's rule for these hyper-parameters

    def init_slots(self, var: np.ndarray, hyper: Hyper) -> dict[str, np.ndarray]:
        init = hyper.get("initial_accumulator_value", 0.0)
        return {s: np.full_like(var, init if s in self.accumulators else 0.0) for s in self.slots}


# -- SGD ------------------------------------------------------------------------------------


def apply_sgd(var: Array, grad: Array, lr: float) -> None:
    var -= lr * grad


def sgd_deltas(grads: Iterable[Array], lr: float) -> None:
    """Plain SGD as deltas, in place (``grad *= -lr``): what a worker pushes for a PS to add
    (Accumulate) instead of applying apply_sgd itself."""
    for grad in grads:
        grad *= -lr


def _sgd_kernel(var, grad, lr):
    for i in range(var.size):
        var[i] -= lr * grad[i]


SGD = Rule(
    name="sgd",
    kind="sgd",
    settings=(),
    slots=(),
    array=lambda var, grad, s, lr, t, h: apply_sgd(var, grad, lr),
    loop=_sgd_kernel,
    scalars=lambda h, lr, t: (f32(lr),),
    cuda=CudaForm("float32 lr", "", "var -= lr * g;"),
    numpy_seconds=0.8e-9,
)


# -- momentum and Nesterov momentum: one kind, ``nesterov`` chooses the rule ---------------


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


def _momentum_array(
    var: Array, grad: Array, s: dict[str, Array], lr: float, t: int, h: Hyper
) -> None:
    apply_momentum(var, grad, s["momentum"], lr, h["momentum"], h["nesterov"])


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


MOMENTUM = Rule(
    name="momentum",
    kind="momentum",
    settings=("momentum", "nesterov"),
    slots=("momentum",),
    array=_momentum_array,
    loop=_momentum_kernel,
    scalars=lambda h, lr, t: (f32(lr), f32(h["momentum"])),
    cuda=CudaForm(
        "float32 lr, float32 mu", "float32 m", "float mi = m * mu + g; m = mi; var -= lr * mi;"
    ),
    numpy_seconds=1.7e-9,
    serves=lambda h: not h.get("nesterov"),
)
NESTEROV = Rule(
    name="nesterov",
    kind="momentum",
    settings=MOMENTUM.settings,
    slots=MOMENTUM.slots,
    array=_momentum_array,
    loop=_nesterov_kernel,
    scalars=MOMENTUM.scalars,
    cuda=CudaForm(
        "float32 lr, float32 mu",
        "float32 m",
        "float mi = m * mu + g; m = mi; var -= lr * (g + mu * mi);",
    ),
    numpy_seconds=2.0e-9,
    serves=lambda h: bool(h.get("nesterov")),
)


# -- Adagrad --------------------------------------------------------------------------------


def apply_adagrad(var: Array, grad: Array, acc: Array, lr: float, epsilon: float) -> None:
    """acc += g^2; var -= lr g / (sqrt(acc) + eps)."""
    acc += grad * grad
    var -= lr * grad / (array_module(var).sqrt(acc) + epsilon)


def apply_rowwise_adagrad(var: Array, grad: Array, acc: Array, lr: float, epsilon: float) -> None:
    """Row-wise Adagrad (TorchRec's and FBGEMM's default for tables): one accumulator a
    row, ``acc`` of shape (rows, 1): acc += mean(g^2) of the row; var -= lr g / (sqrt(acc) +
    eps). A table's slot memory is its row count in words, not its size."""
    acc += (grad * grad).mean(axis=1, keepdims=True)
    var -= lr * grad / (array_module(var).sqrt(acc) + epsilon)


def _adagrad_kernel(var, grad, acc, lr, epsilon):
    for i in range(var.size):
        gi = grad[i]
        ai = acc[i] + gi * gi
        acc[i] = ai
        var[i] -= lr * gi / (np.sqrt(ai) + epsilon)


ADAGRAD = Rule(
    name="adagrad",
    kind="adagrad",
    settings=("epsilon", "initial_accumulator_value"),
    slots=("accumulator",),
    array=lambda var, grad, s, lr, t, h: apply_adagrad(
        var, grad, s["accumulator"], lr, h["epsilon"]
    ),
    loop=_adagrad_kernel,
    scalars=lambda h, lr, t: (f32(lr), f32(h["epsilon"])),
    cuda=CudaForm(
        "float32 lr, float32 eps",
        "float32 acc",
        "float ai = acc + g * g; acc = ai; var -= lr * g / (sqrtf(ai) + eps);",
    ),
    numpy_seconds=2.7e-9,
    accumulators=("accumulator",),
)


# -- Adam -----------------------------------------------------------------------------------


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


def _adam_kernel(var, grad, m, v, beta1, one_minus_beta1, beta2, one_minus_beta2, lr_t, epsilon):
    for i in range(var.size):
        gi = grad[i]
        mi = m[i] * beta1 + gi * one_minus_beta1
        vi = v[i] * beta2 + gi * one_minus_beta2 * gi
        m[i] = mi
        v[i] = vi
        var[i] -= mi * lr_t / (np.sqrt(vi) + epsilon)


_adam_constants: dict[tuple[float, float], tuple[np.float32, ...]] = {}  # by (beta1, beta2)


def _adam_scalars(h: Hyper, lr: float, t: int) -> tuple[np.float32, ...]:
    b1, b2 = h["beta1"], h["beta2"]
    lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)  # in float64, as apply_adam
    if (c := _adam_constants.get((b1, b2))) is None:
        c = _adam_constants[b1, b2] = (f32(b1), f32(1 - b1), f32(b2), f32(1 - b2))
    return (*c, f32(lr_t), f32(h["epsilon"]))


ADAM = Rule(
    name="adam",
    kind="adam",
    settings=("beta1", "beta2", "epsilon"),
    slots=("m", "v"),
    array=lambda var, grad, s, lr, t, h: apply_adam(
        var, grad, s["m"], s["v"], lr, t, h["beta1"], h["beta2"], h["epsilon"]
    ),
    loop=_adam_kernel,
    scalars=_adam_scalars,
    cuda=CudaForm(
        "float32 b1, float32 omb1, float32 b2, float32 omb2, float32 lr_t, float32 eps",
        "float32 m, float32 v",
        "float mi = m * b1 + g * omb1; float vi = v * b2 + g * omb2 * g; m = mi; v = vi;"
        " var -= mi * lr_t / (sqrtf(vi) + eps);",
    ),
    numpy_seconds=5.3e-9,
)


# -- FTRL-Proximal --------------------------------------------------------------------------


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


FTRL = Rule(
    name="ftrl",
    kind="ftrl",
    settings=("l1", "l2", "initial_accumulator_value"),
    slots=("z", "n"),
    array=lambda var, grad, s, lr, t, h: apply_ftrl(
        var, grad, s["z"], s["n"], lr, h["l1"], h["l2"]
    ),
    loop=_ftrl_kernel,
    scalars=lambda h, lr, t: (f32(lr), f32(h["l1"]), f32(2 * h["l2"])),
    cuda=CudaForm(
        "float32 lr, float32 l1, float32 two_l2",
        "float32 z, float32 n",
        "float n_old = n; float n_new = n_old + g * g; float root = sqrtf(n_new);"
        " float sigma = (root - sqrtf(n_old)) / lr; float zi = z + (g - sigma * var);"
        " z = zi; n = n_new; float c = zi; if (c < -l1) { c = -l1; } else if (c > l1)"
        " { c = l1; } var = (c - zi) / (root / lr + two_l2);",
    ),
    numpy_seconds=8.7e-9,
    accumulators=("n",),
)


# -- the rules, by name and by kind ---------------------------------------------------------

RULES: tuple[Rule, ...] = (SGD, MOMENTUM, NESTEROV, ADAGRAD, ADAM, FTRL)
BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}
_BY_KIND: dict[str, tuple[Rule, ...]] = {
    kind: tuple(r for r in RULES if r.kind == kind) for kind in dict.fromkeys(r.kind for r in RULES)
}
# per kind: its slots and the [optimizer] settings it reads (the same for each of its rules)
SLOTS: dict[str, tuple[str, ...]] = {r.kind: r.slots for r in RULES}
HYPER: dict[str, tuple[str, ...]] = {r.kind: r.settings for r in RULES}


def find_rule(kind: str, hyper: Hyper) -> Rule | None:
    """The rule of optimizer ``kind`` with ``hyper``, or None (no such kind)."""
    for rule in _BY_KIND.get(kind, ()):
        if rule.serves(hyper):
            return rule
    return None


def rule_for(kind: str, hyper: Hyper) -> Rule:
    """find_rule's rule; a ValueError for a kind that has none."""
    rule = find_rule(kind, hyper)
    if rule is None:
        raise ValueError(f"unknown optimizer {kind!r}")
    return rule


def kernel_name(kind: str, hyper: Hyper) -> str | None:
    """The fused kernel of an optimizer (its rule's name), or None (none for it)."""
    rule = find_rule(kind, hyper)
    return None if rule is None else rule.name


def kernel_scalars(kind: str, hyper: Hyper, lr: float, t: int) -> tuple[Any, ...]:
    """A fused kernel's scalar arguments, in float32 (as numpy casts a Python float against a
    float32 array)."""
    return rule_for(kind, hyper).scalars(hyper, lr, t)

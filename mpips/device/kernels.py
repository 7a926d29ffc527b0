"""The update rules as fused cupy kernels: one pass over a GPU's memory per update.

Each kernel reads every element of the variable, its gradient and its slots once and writes
the variable and slots once, as the numba kernels do on the CPU (optim.py), with the same
float32 operations in the same order: compiled without fused multiply-add contraction
(``--fmad=false``; IEEE division and square root are NVRTC's default), so they give the
numpy rules' bits. The array rules would make ~10 passes and temporaries for Adam.
Compiled by NVRTC at the first call (cupy caches the binary on disk), on a GPU only.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

# name: (scalar inputs, outputs besides var, the loop body); every kernel also takes the
# gradient ``g`` and writes ``var``
_RULES: dict[str, tuple[str, str, str]] = {
    "sgd": ("float32 lr", "", "var -= lr * g;"),
    "momentum": (
        "float32 lr, float32 mu",
        "float32 m",
        "float mi = m * mu + g; m = mi; var -= lr * mi;",
    ),
    "nesterov": (
        "float32 lr, float32 mu",
        "float32 m",
        "float mi = m * mu + g; m = mi; var -= lr * (g + mu * mi);",
    ),
    "adagrad": (
        "float32 lr, float32 eps",
        "float32 acc",
        "float ai = acc + g * g; acc = ai; var -= lr * g / (sqrtf(ai) + eps);",
    ),
    "adam": (
        "float32 b1, float32 omb1, float32 b2, float32 omb2, float32 lr_t, float32 eps",
        "float32 m, float32 v",
        "float mi = m * b1 + g * omb1; float vi = v * b2 + g * omb2 * g; m = mi; v = vi;"
        " var -= mi * lr_t / (sqrtf(vi) + eps);",
    ),
    "ftrl": (
        "float32 lr, float32 l1, float32 two_l2",
        "float32 z, float32 n",
        "float n_old = n; float n_new = n_old + g * g; float root = sqrtf(n_new);"
        " float sigma = (root - sqrtf(n_old)) / lr; float zi = z + (g - sigma * var);"
        " z = zi; n = n_new; float c = zi; if (c < -l1) { c = -l1; } else if (c > l1)"
        " { c = l1; } var = (c - zi) / (root / lr + two_l2);",
    ),
}
_compiled: dict[str, Any] = {}

# The softmax cross-entropy of one row of logits ``z`` (``classes`` of them, label ``y``):
# its loss and the gradient of the batch's mean loss (``rows`` rows), in one pass where the
# array version is 14 operations, each a launch (max, subtract, exp, sum, divide, gathers,
# a scatter).
# ``z`` and ``d`` are flat (raw) arrays; a label out of range gives a NaN loss, which stops
# the run as any loss that is not finite does.
SOFTMAX_XENT = (
    "const ptrdiff_t at = i * classes;"
    " float m = z[at];"
    " for (int j = 1; j < classes; ++j) { m = fmaxf(m, z[at + j]); }"
    " float s = 0.0f;"
    " for (int j = 0; j < classes; ++j) { s += expf(z[at + j] - m); }"
    ' loss = (y < 0 || y >= classes) ? nanf("") : logf(s) - (z[at + y] - m);'
    " for (int j = 0; j < classes; ++j) {"
    " d[at + j] = (expf(z[at + j] - m) / s - (j == y ? 1.0f : 0.0f)) / rows; }"
)
_failed: list[str] = []  # the fused loss could not be compiled or loaded: not tried again
# one thread a row: up to this many classes (a wider row would want a block of its own)
MAX_FUSED_CLASSES = 1024


def is_cupy(a: Any) -> bool:
    """A cupy array (and not numpy, nor the stand-in)."""
    return type(a).__module__.split(".")[0] == "cupy"


def kernel(name: str) -> Any:
    """The cupy ElementwiseKernel of rule ``name`` (made once; NVRTC compiles it at its
    first call)."""
    k = _compiled.get(name)
    if k is None:
        import cupy

        scalars, outputs, body = _RULES[name]
        k = _compiled[name] = cupy.ElementwiseKernel(
            f"float32 g, {scalars}",
            ", ".join(p for p in ("float32 var", outputs) if p),
            body,
            f"mpips_{name}",
            options=("--fmad=false",),
            no_return=True,
        )
    return k


def device_apply(
    name: str, var: Any, grad: Any, slots: list[Any], scalars: tuple[np.float32, ...]
) -> bool:
    """Rule ``name`` by its fused kernel, in place, for float32 cupy arrays of one shape;
    False (nothing done) for anything else (the array rule runs instead)."""
    arrays = (var, grad, *slots)
    if not all(is_cupy(a) and a.dtype == np.float32 and a.shape == var.shape for a in arrays):
        return False
    kernel(name)(grad, *scalars, var, *slots)
    return True


def softmax_xent(z: Any, y: Any) -> tuple[Any, Any] | None:
    """(each row's loss, the mean loss's gradient with respect to ``z``) by one fused kernel,
    for float32 cupy logits (rows, 1..MAX_FUSED_CLASSES), C-contiguous, and integer cupy
    labels; None for anything else, or if the kernel could not be compiled or loaded (the
    array version runs instead: said once). Other errors (out of memory) are raised."""
    if _failed or not (is_cupy(z) and is_cupy(y)):
        return None
    if z.dtype != np.float32 or z.ndim != 2 or not z.flags.c_contiguous:
        return None
    if not 0 < z.shape[1] <= MAX_FUSED_CLASSES:
        return None
    if y.ndim != 1 or len(y) != len(z) or y.dtype.kind not in "iu":
        return None
    try:
        import cupy
        from cupy.cuda.compiler import CompileException
        from cupy.cuda.driver import CUDADriverError
    except ImportError as e:
        _fused_failed(e)
        return None
    rows, classes = z.shape
    d = cupy.empty(rows * classes, np.float32)
    loss = cupy.empty(rows, np.float32)
    labels = y.astype(np.int64, copy=False)
    try:
        k = _compiled.get("softmax_xent")
        if k is None:
            k = _compiled["softmax_xent"] = cupy.ElementwiseKernel(
                "raw float32 z, int64 y, int32 classes, float32 rows",
                "raw float32 d, float32 loss",
                SOFTMAX_XENT,
                "mpips_softmax_xent",
            )
        k(z.reshape(-1), labels, np.int32(classes), np.float32(rows), d, loss)
    except (CompileException, CUDADriverError) as e:  # (NVRTC, or loading the module)
        _compiled.pop("softmax_xent", None)
        _fused_failed(e)
        return None
    return loss, d.reshape(rows, classes)


def _fused_failed(e: Exception) -> None:
    """The fused loss is off from now on, said once."""
    _failed.append(str(e))
    warnings.warn(
        f"mpips: the fused softmax loss failed ({e}); using array operations", stacklevel=3
    )

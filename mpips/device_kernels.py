"""The update rules as fused cupy kernels: one pass over a GPU's memory per update.

Each kernel reads every element of the variable, its gradient and its slots once and writes
the variable and slots once, as the numba kernels do on the CPU (optim.py), with the same
float32 operations in the same order: compiled without fused multiply-add contraction
(``--fmad=false``; IEEE division and square root are NVRTC's default), so they give the
numpy rules' bits. The array rules would make ~10 passes and temporaries for Adam.
Compiled by NVRTC at the first call (cupy caches the binary on disk), on a GPU only.
"""

from __future__ import annotations

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

"""Fused cupy kernels: one pass over a GPU's memory where array operations make one per
operator, each a launch. ``elementwise`` makes and keeps a cupy ElementwiseKernel (the update
rules' kernels are the rules' own: mpips/optim/rules.py, run by optim/fused.py); the softmax
cross-entropy of the built-in models is here. Compiled by NVRTC at the first call (cupy
caches the binary on disk), on a GPU only.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

_compiled: dict[str, Any] = {}  # the kernels made so far, by key (a rule's: its name)

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


def elementwise(key: str, in_params: str, out_params: str, body: str, **options: Any) -> Any:
    """The cupy ElementwiseKernel ``mpips_<key>`` of ``body``, made once and kept by ``key``
    (NVRTC compiles it at its first call); ``options``: ElementwiseKernel's."""
    k = _compiled.get(key)
    if k is None:
        import cupy

        k = _compiled[key] = cupy.ElementwiseKernel(
            in_params, out_params, body, f"mpips_{key}", **options
        )
    return k


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
        k = elementwise(
            "softmax_xent",
            "raw float32 z, int64 y, int32 classes, float32 rows",
            "raw float32 d, float32 loss",
            SOFTMAX_XENT,
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

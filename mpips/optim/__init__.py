"""Optimizers: the update rules, one object each with all its forms (``rules.py``: array
functions for numpy or cupy, fused loops for numba, fused cupy kernels, slots and settings),
the switch between those forms (``fused.py``), the ``Optimizer`` that asks its rule
(``optimizer.py``), learning-rate schedules and clipping (``schedule.py``).

The same rule serves the PS apply loop (async), the replicas (sync) and any reference
implementation, so every path computes bit for bit the same arithmetic: the fused forms do
the array forms' operations in the same order, so they give the same bits.
"""

from .fused import (
    COMPILE_AFTER,
    NUMPY_SECONDS_PER_ELEMENT,
    PAYS_PER_UPDATE,
    await_kernel,
    fused_apply,
    fused_kernel,
    fused_kernels_on,
    set_fused_kernels,
)
from .optimizer import Optimizer, build_optimizer, plan_kernel, unused_settings
from .rules import (
    HYPER,
    RULES,
    SLOTS,
    Array,
    CudaForm,
    Rule,
    apply_adagrad,
    apply_adam,
    apply_ftrl,
    apply_momentum,
    apply_sgd,
    find_rule,
    kernel_name,
    kernel_scalars,
    rule_for,
    sgd_deltas,
)
from .schedule import clip_by_global_norm, global_norm_clip, learning_rate

__all__ = [
    "COMPILE_AFTER",
    "HYPER",
    "NUMPY_SECONDS_PER_ELEMENT",
    "PAYS_PER_UPDATE",
    "RULES",
    "SLOTS",
    "Array",
    "CudaForm",
    "Optimizer",
    "Rule",
    "apply_adagrad",
    "apply_adam",
    "apply_ftrl",
    "apply_momentum",
    "apply_sgd",
    "await_kernel",
    "build_optimizer",
    "clip_by_global_norm",
    "find_rule",
    "fused_apply",
    "fused_kernel",
    "fused_kernels_on",
    "global_norm_clip",
    "kernel_name",
    "kernel_scalars",
    "learning_rate",
    "plan_kernel",
    "rule_for",
    "set_fused_kernels",
    "sgd_deltas",
    "unused_settings",
]

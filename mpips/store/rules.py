"""An optimizer's rule as the store runs it, on a PS (stateful optimizers) or, with zero copy,
on a worker: whole variables, or the touched rows of a table partition."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# a rule: apply(variable, gradient, slots by name, lr, t), in place
Apply = Callable[[np.ndarray, np.ndarray, dict[str, np.ndarray], float, int], None]


def apply_rows(
    apply: Apply,
    var: np.ndarray,
    slots: dict[str, np.ndarray],
    rows: np.ndarray,
    grad: np.ndarray,
    lr: float,
    t: int,
) -> None:
    """The rule on the touched rows of a table partition and of its slots only (sparse
    update: untouched rows and their accumulators stay as they are)."""
    if not rows.size:
        return
    v = var[rows]
    s = {k: a[rows] for k, a in slots.items()}
    apply(v, grad, s, lr, t)
    var[rows] = v
    for k, a in slots.items():
        a[rows] = s[k]

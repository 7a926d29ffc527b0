"""Learning-rate schedules and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..device.arrays import array_module
from .rules import Array


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

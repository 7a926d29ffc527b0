"""Update rules. Plain SGD turns a gradient into the delta a worker Accumulates onto the PS."""
from __future__ import annotations

from typing import Any


class SGD:
    """``var -= learning_rate * grad``: the push delta is ``-learning_rate * grad``."""

    def __init__(self, learning_rate: float):
        self.learning_rate = learning_rate

    def deltas(self, grads: dict[str, Any]) -> None:
        """Turn gradients into deltas, in place."""
        for g in grads.values():
            g *= -self.learning_rate


def build_optimizer(kind: str, learning_rate: float) -> SGD:
    if kind != "sgd":
        raise ValueError(f"unknown optimizer {kind!r}")
    return SGD(learning_rate)

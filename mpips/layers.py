"""Dense ReLU layers, written once for every model that has them (the MLP, and the deep part
of wide-and-deep): their variables, He-uniform initial values, forward and backward."""
from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from .placement import VariableSpec


class DenseStack:
    """``sizes[0] -> ... -> sizes[-1]``, ReLU between layers (none after the last);
    variables ``{prefix}{i}/kernel`` and ``{prefix}{i}/bias`` in creation order."""

    def __init__(self, sizes: list[int], prefix: str = "dense_", xp: ModuleType = np):
        self.sizes, self.prefix, self.xp = list(sizes), prefix, xp
        self.num_layers = len(self.sizes) - 1
        self.names = [(f"{prefix}{i}/kernel", f"{prefix}{i}/bias") for i in range(self.num_layers)]

    def variables(self) -> list[VariableSpec]:
        return [VariableSpec(n, shape) for (k, b), (a, c) in zip(self.names, self._shapes())
                for n, shape in ((k, (a, c)), (b, (c,)))]

    def _shapes(self) -> list[tuple[int, int]]:
        return list(zip(self.sizes[:-1], self.sizes[1:]))

    def initial_values(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """He-uniform kernels, zero biases (numpy, on the host), drawn in layer order."""
        out = {}
        for (k, b), (fan_in, fan_out) in zip(self.names, self._shapes()):
            limit = np.sqrt(6.0 / fan_in)
            out[k] = rng.uniform(-limit, limit, (fan_in, fan_out)).astype(np.float32)
            out[b] = np.zeros(fan_out, np.float32)
        return out

    def forward(self, params: dict[str, Any], x: Any) -> tuple[Any, list[Any]]:
        """(output, activations): the input and every layer's output, for ``backward``."""
        acts, h = [x], x
        for i, (k, b) in enumerate(self.names):
            h = h @ params[k] + params[b]
            if i < self.num_layers - 1:
                h = self.xp.maximum(h, 0)
            acts.append(h)
        return h, acts

    def backward(self, params: dict[str, Any], acts: list[Any], d: Any, grads: dict[str, Any],
                 ready: Callable[[str], None] | None = None, input_grad: bool = False) -> Any:
        """Gradients of every kernel and bias into ``grads`` (in place) from ``d``, the
        gradient of the output; ``ready(name)`` as each is written (last layer first).
        Returns the gradient of the input if ``input_grad``, else None."""
        for i in reversed(range(self.num_layers)):
            k, b = self.names[i]
            self.xp.matmul(acts[i].T, d, out=grads[k])
            d.sum(axis=0, out=grads[b])
            if ready is not None:
                ready(b)
                ready(k)
            if i or input_grad:
                d = d @ params[k].T
                if i:
                    d *= acts[i] > 0
        return d if input_grad else None

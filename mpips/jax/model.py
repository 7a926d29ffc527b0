"""``mpips.jax.Model``: a pure JAX loss function behind the mpips model contract.

JAX arrays are immutable, so a step copies the pulled parameters in (one ``jnp.asarray``
per leaf) and the gradients out into mpips's push buffers (one copy per leaf); jit compiles
the loss and its gradient once per batch shape. Nothing here calls MPI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from ..models.contract import Model as _Model
from ..models.contract import Ready
from ..models.variables import VariableSpec

FLOATS = ("float16", "float32", "float64")


def leaf_name(path: tuple[Any, ...]) -> str:
    """A pytree path as a variable name: dict keys, attribute names and sequence indices
    joined by "/" (``{"dense_0": {"kernel": ...}}`` -> ``dense_0/kernel``)."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


class Model(_Model):
    """A JAX model: ``init(key)`` returns the parameters (a pytree of float arrays; ``key``
    is ``jax.random.PRNGKey(model.init_seed)``), ``loss(params, x, y)`` returns ``(loss,
    metrics)``: the batch's mean loss and a dict of more numbers (``{}`` for none), both
    traced by ``jax.jit``. An evaluation reports the loss and those metrics on the whole
    split; ``predict(params, x)``, if given, serves ``python -m mpips predict``."""

    def __init__(
        self,
        loss: Callable[[Any, Any, Any], tuple[Any, dict[str, Any]]],
        init: Callable[[Any], Any],
        predict: Callable[[Any, Any], Any] | None = None,
    ):
        if not callable(loss) or not callable(init):
            raise ConfigError("mpips.jax.Model(loss, init): both must be callables")
        self.init, self.loss_fn, self.predict_fn = init, loss, predict
        shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(shapes)
        self.names = [leaf_name(path) for path, _ in leaves]
        self.specs = []
        for name, (_, leaf) in zip(self.names, leaves, strict=True):
            dtype = np.dtype(leaf.dtype).name
            if dtype not in FLOATS:
                raise ConfigError(
                    f"mpips.jax.Model: parameter {name!r} is {dtype}; mpips trains "
                    f"{', '.join(FLOATS)} parameters"
                )
            self.specs.append(VariableSpec(name, tuple(leaf.shape), dtype))
        if len(set(self.names)) != len(self.names):
            raise ConfigError("mpips.jax.Model: two parameters have the same pytree path name")
        self._step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        self._eval = jax.jit(loss)
        self._predict = jax.jit(predict) if predict is not None else None

    def variables(self) -> list[VariableSpec]:
        return list(self.specs)

    def initial_values(self, seed: int) -> dict[str, np.ndarray]:
        """``init(jax.random.PRNGKey(seed))``'s leaves, by name, as numpy arrays."""
        leaves = jax.tree_util.tree_leaves(self.init(jax.random.PRNGKey(seed)))
        return {
            s.name: np.asarray(v, dtype=s.dtype).copy()
            for s, v in zip(self.specs, leaves, strict=True)
        }

    def _tree(self, params: dict[str, Any]) -> Any:
        """mpips's arrays, by name, as the loss's pytree of JAX arrays (copied in)."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [jnp.asarray(params[n]) for n in self.names]
        )

    def loss_and_grads(
        self,
        params: dict[str, Any],
        x: Any,
        y: Any,
        grads: dict[str, Any],
        ready: Ready | None = None,
    ) -> float:
        """The jitted value and gradient on the batch; each gradient leaf copied into its
        push buffer (and said ready, all at once: jit computes them together)."""
        (loss, _), g = self._step(self._tree(params), jnp.asarray(x), jnp.asarray(y))
        for name, leaf in zip(self.names, jax.tree_util.tree_leaves(g), strict=True):
            grads[name][...] = np.asarray(leaf)
            if ready is not None:
                ready(name)
        return float(loss)

    def evaluate(self, params: dict[str, Any], x: Any, y: Any) -> dict[str, float]:
        """The loss and the loss function's metrics on the whole split."""
        loss, metrics = self._eval(self._tree(params), jnp.asarray(x), jnp.asarray(y))
        return {"loss": float(loss), **{k: float(v) for k, v in dict(metrics).items()}}

    def predict(self, params: dict[str, Any], x: Any) -> Any:
        if self._predict is None:
            raise NotImplementedError("mpips.jax.Model was given no predict function")
        return np.asarray(self._predict(self._tree(params), jnp.asarray(x)))

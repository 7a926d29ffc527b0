"""JAX frontend: train a pure loss function of a pytree of parameters on the parameter server.

The job's factory returns ``mpips.jax.Model(loss, init)``: ``init(key)`` makes the parameter
pytree, ``loss(params, x, y)`` returns ``(loss, metrics)``; mpips places every leaf on the PS
tasks under its pytree path (``dense_0/kernel``) and runs ``jax.value_and_grad`` under
``jax.jit`` on the workers (docs/guide/jax.md). Needs the ``jax`` extra:
``pip install ".[jax]"``.
"""

from .model import Model, leaf_name

__all__ = ["Model", "leaf_name"]

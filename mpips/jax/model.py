"""``mpips.jax.Model``: a pure JAX loss function behind the mpips model contract.

JAX arrays are immutable, so a step copies the pulled parameters in (one ``jnp.asarray``
per leaf) and the gradients out into mpips's push buffers (one copy per leaf); jit compiles
the loss and its gradient once per batch shape. Nothing here calls MPI.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from ..models.contract import Model as _Model
from ..models.contract import Ready
from ..models.variables import VariableSpec

FLOATS = ("float16", "float32", "float64")
RETURNS = (
    "loss(params, x, y) must return (loss, metrics): the batch's mean loss as a float scalar "
    "and a dict of scalars ({} for none)"
)


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


def defined_at(fn: Callable[..., Any]) -> str:
    """Where a user's function is defined, compiler style (``net.py:12``, the file relative
    to the working directory when below it), so that a mistake in what it returns is said
    in the user's file, not mpips's; its repr when Python does not know."""
    target: Any = inspect.unwrap(fn)
    while isinstance(target, functools.partial):
        target = target.func
    code = getattr(target, "__code__", None)
    if code is None and callable(target):  # an object with a __call__ method
        code = getattr(type(target).__call__, "__code__", None)
    if code is None:
        return repr(fn)
    name = code.co_filename
    with suppress(ValueError, OSError):
        name = str(Path(name).resolve().relative_to(Path.cwd().resolve()))
    return f"{name}:{code.co_firstlineno}"


def _described(v: Any) -> str:
    """What a (traced) value is, in words: ``a float32[16] array``, ``a float32 scalar``."""
    if isinstance(v, tuple | list):
        parts = ", ".join(_described(e) for e in v[:3]) + (", ..." if len(v) > 3 else "")
        return f"a {type(v).__name__} of {len(v)} ({parts})"
    if isinstance(v, Mapping):
        return "a dict"
    if v is None:
        return "None"
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        dtype = np.dtype(v.dtype).name
        return f"a {dtype} scalar" if not v.shape else f"a {dtype}{list(v.shape)} array"
    if isinstance(v, int | float):
        return f"a Python {type(v).__name__}"
    return f"a {type(v).__name__}"


def _scalar(v: Any) -> bool:
    return isinstance(v, int | float) or getattr(v, "shape", None) == ()


def _return_problem(out: Any) -> str:
    """What is wrong with what the loss function returned ('' if nothing): checked as jit
    traces it, so a mistake costs no step and is said before JAX's own error."""
    if not isinstance(out, tuple | list) or len(out) != 2:
        hint = ""
        if _scalar(out):
            hint = " (the loss alone: return (loss, {}))"
        elif getattr(out, "shape", ()):
            hint = " (a loss per example? return (loss.mean(), {}))"
        return f"{_described(out)}{hint}"
    loss, metrics = out
    if not _scalar(loss) or not jnp.issubdtype(jnp.result_type(loss), jnp.floating):
        hint = " (a loss per example? take its mean)" if getattr(loss, "shape", ()) else ""
        return f"(loss, metrics) with loss {_described(loss)}{hint}"
    if not isinstance(metrics, Mapping):
        return f"(loss, metrics) with metrics {_described(metrics)}"
    for key, value in metrics.items():
        if not _scalar(value):
            return f"(loss, metrics) with metric {key!r} {_described(value)} (reduce it)"
    return ""


def _checked(loss: Callable[..., Any]) -> Callable[[Any, Any, Any], Any]:
    """``loss`` whose return is checked when traced (at the first step or evaluation, and
    at each new batch shape: nothing at run time), a mistake one ConfigError naming the
    user's file: a traceback through JAX and mpips would not say what to return."""

    def checked(params: Any, x: Any, y: Any) -> Any:
        out = loss(params, x, y)
        problem = _return_problem(out)
        if problem:
            raise ConfigError(
                f"{defined_at(loss)}: {getattr(loss, '__name__', 'the loss function')} "
                f"returned {problem}; mpips.jax.Model's {RETURNS}"
            )
        return out

    return checked


def _copy_out(grads: dict[str, Any], name: str, leaf: Any) -> str:
    """A gradient leaf written into its push buffer; returns its name, which only then may
    be said ready (so the write comes first by construction: ``ready(_copy_out(...))``)."""
    grads[name][...] = np.asarray(leaf)
    return name


def _quiet(name: str, rows: int | None = None) -> None:
    """``ready`` when mpips gives none."""


class Model(_Model):
    """A JAX model: ``init(key)`` returns the parameters (a pytree of float arrays; ``key``
    is ``jax.random.PRNGKey(model.init_seed)``), ``loss(params, x, y)`` returns ``(loss,
    metrics)``: the batch's mean loss and a dict of more numbers (``{}`` for none), both
    traced by ``jax.jit``. An evaluation reports the loss and those metrics on the whole
    split; ``predict(params, x)``, if given, serves ``python -m mpips predict`` (a model
    made without it does not implement ``predict``, as the contract says "none")."""

    def __new__(cls, loss: Any = None, init: Any = None, predict: Any = None) -> Model:
        # with predict, an instance of the subclass that implements it; without, one whose
        # predict is the contract's own, which `mpips predict` refuses in one line, as it
        # does a native model's (run/evaluation.py). (Defaults: copy.copy calls it bare.)
        return super().__new__(Predicting if predict is not None and cls is Model else cls)

    def __init__(
        self,
        loss: Callable[[Any, Any, Any], tuple[Any, dict[str, Any]]],
        init: Callable[[Any], Any],
        predict: Callable[[Any, Any], Any] | None = None,
    ):
        if not callable(loss) or not callable(init):
            raise ConfigError("mpips.jax.Model(loss, init): both must be callables")
        if predict is not None and not callable(predict):
            raise ConfigError("mpips.jax.Model(loss, init, predict): predict must be callable")
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
        self._step = jax.jit(jax.value_and_grad(_checked(loss), has_aux=True))
        self._eval = jax.jit(_checked(loss))
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
        push buffer, then said ready (jit computes them together: each is final once
        copied). ``ready`` is told the name the copy returns, so the write comes first by
        construction; tests/test_frontend_ready.py catches any other order."""
        (loss, _), g = self._step(self._tree(params), jnp.asarray(x), jnp.asarray(y))
        say = ready if ready is not None else _quiet
        for name, leaf in zip(self.names, jax.tree_util.tree_leaves(g), strict=True):
            say(_copy_out(grads, name, leaf))
        return float(loss)

    def evaluate(self, params: dict[str, Any], x: Any, y: Any) -> dict[str, float]:
        """The loss and the loss function's metrics on the whole split."""
        loss, metrics = self._eval(self._tree(params), jnp.asarray(x), jnp.asarray(y))
        return {"loss": float(loss), **{k: float(v) for k, v in dict(metrics).items()}}


class Predicting(Model):
    """A ``mpips.jax.Model`` made with ``predict=``: what ``mpips.jax.Model(loss, init,
    predict)`` returns (an instance of ``mpips.jax.Model`` all the same)."""

    def predict(self, params: dict[str, Any], x: Any) -> Any:
        """``predict(params, x)`` jitted, as a numpy array."""
        assert self._predict is not None
        return np.asarray(self._predict(self._tree(params), jnp.asarray(x)))

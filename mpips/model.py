"""The model interface every model implements, the built-in ones included, and how a job's
``model.kind`` becomes a model: a built-in name, or ``"package.module:factory"``.

A model declares its variables (name, shape, dtype), makes their initial values, and given
parameters and a batch writes the gradient of its loss into buffers mpips hands it (the
worker's push buffers on the CPU, so a push copies nothing). mpips places the variables on
the PS tasks, pulls them before each step, pushes the gradients, checkpoints them by name.
Models compute with ``self.xp`` (numpy, or cupy on a GPU worker), set by mpips.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from .errors import ConfigError
from .placement import VariableSpec

if TYPE_CHECKING:
    from .data import DatasetInfo

Variable = VariableSpec  # the public name: Variable(name, shape, dtype="float32")


class Ready(Protocol):
    """What ``loss_and_grads`` may call as backward goes: ``ready(name)`` once gradient
    ``name`` is final and backward no longer reads variable ``name``; ``ready(name, rows)``
    once its first ``rows`` rows (along axis 0) are, so a large gradient written in blocks of
    rows is reduced block by block. Sync replicas may update the variable from then on
    (compute a layer's input gradient before you say its kernel is ready)."""

    def __call__(self, name: str, rows: int | None = None) -> None: ...


BUILT_IN = ("mlp", "logreg", "wide_deep")


class Model:
    """Subclass this and implement the four methods marked *required*.

    ``xp`` is the array module to compute with (numpy, or cupy on a GPU worker); mpips sets
    it before training. Arrays handed to the model (parameters, batches, gradient buffers)
    are ``xp`` arrays; ``initial_values`` returns numpy arrays (the chief writes them)."""

    xp: ModuleType = np
    worker: int = 0  # this worker's task index, set by mpips (e.g. to seed dropout per worker)

    def variables(self) -> list[VariableSpec]:
        """*Required.* Every dense variable, in the same order on every rank (mpips checks)."""
        raise NotImplementedError

    def initial_values(self, seed: int) -> dict[str, np.ndarray]:
        """*Required.* Initial numpy values of every variable, by name (from ``seed``)."""
        raise NotImplementedError

    def loss_and_grads(
        self,
        params: dict[str, Any],
        x: Any,
        y: Any,
        grads: dict[str, Any],
        ready: Ready | None = None,
    ) -> float:
        """*Required.* The batch's mean loss; writes d loss / d variable into ``grads[name]``
        in place (``grads[name][...] = ...``, never rebinding it). ``ready(name)``, if given,
        may be called as each gradient is final and its variable no longer read (sync mode
        starts reducing it at once, and may update the variable), and ``ready(name, rows)``
        as its first ``rows`` rows are (see ``Ready``)."""
        raise NotImplementedError

    def evaluate(self, params: dict[str, Any], x: Any, y: Any) -> dict[str, float]:
        """*Required.* Metrics on a split, by name: at least ``"loss"``; ``"accuracy"`` and
        ``"auc"`` are reported when present."""
        raise NotImplementedError

    def predict(self, params: dict[str, Any], x: Any) -> Any:
        """Optional: the model's outputs for ``x`` (``python -m mpips predict``), e.g. class
        probabilities."""
        raise NotImplementedError(f"{type(self).__name__} does not implement predict()")

    def tables(self) -> list[VariableSpec]:
        """Row-partitioned tables (sparse models): none by default."""
        return []

    def initial_rows(self, table: str, rows: tuple[int, int, int], seed: int) -> np.ndarray:
        """The initial ``range(*rows)`` rows of a table (sparse models only)."""
        raise NotImplementedError(f"{type(self).__name__} declares no tables")

    @staticmethod
    def prepare(x: Any) -> tuple[Any, Any]:
        """The batch as the model wants it, and the table rows it needs (None: no tables)."""
        return x, None


REQUIRED = ("variables", "initial_values", "loss_and_grads", "evaluate")


def check_model(model: Any, what: str) -> Model:
    """``model`` if it is a usable Model, else one ConfigError naming ``what``."""
    if not isinstance(model, Model):
        raise ConfigError(
            f"{what} returned {type(model).__name__}, not a model: subclass "
            f"mpips.Model and implement {', '.join(REQUIRED)}"
        )
    missing = [m for m in REQUIRED if getattr(type(model), m) is getattr(Model, m)]
    if missing:
        raise ConfigError(f"{what}: {type(model).__name__} does not implement {', '.join(missing)}")
    specs = model.variables()
    if not isinstance(specs, list) or not all(isinstance(s, VariableSpec) for s in specs):
        raise ConfigError(f"{what}: variables() must return a list of mpips.Variable")
    names = [s.name for s in specs + model.tables()]
    if len(set(names)) != len(names):
        raise ConfigError(f"{what}: two variables share a name")
    return model


def import_factory(kind: str, near: str | None = None) -> Callable[..., Any]:
    """The callable ``"package.module:attr"`` names (the job file's folder is searched
    first, then the current one and sys.path); ConfigError naming what failed."""
    module_name, _, attr = kind.partition(":")
    where = f"model.kind = {kind!r}"
    folders = [str(Path(near).resolve().parent)] if near and Path(near).is_file() else []
    for folder in folders + [str(Path.cwd())]:
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error in it is theirs to see
        raise ConfigError(
            f"{where}: cannot import {module_name} ({type(e).__name__}: {e})"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {attr} is not callable")
    return cast(Callable[..., Any], obj)


def build_from_factory(
    factory: Callable[..., Any], data: DatasetInfo, xp: ModuleType, args: dict[str, Any], what: str
) -> Model:
    """``factory(data, **args)`` checked, with ``xp`` set; ConfigError if it raises or
    returns something that is not a model."""
    try:
        model = factory(data, **args)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{what} raised {type(e).__name__}: {e}") from None
    model = check_model(model, what)
    model.xp = xp
    return model


def factory_name(factory: Any) -> str:
    """How a factory passed to the Python API is named in messages and manifests."""
    module = inspect.getmodule(factory)
    return f"{module.__name__ if module else '?'}:{getattr(factory, '__qualname__', factory)}"

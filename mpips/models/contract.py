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
import math
import random
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np

from ..errors import AlreadyReported, ConfigError, MpipsError
from .variables import VariableSpec

if TYPE_CHECKING:
    from ..data.batches import DatasetInfo

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
        """*Required.* Metrics on a split, by name, each a number: ``"accuracy"``,
        ``"loss"`` and ``"auc"`` are reported first when present (and fill the result's
        ``test_*`` fields), any others after them."""
        raise NotImplementedError

    def predict(self, params: dict[str, Any], x: Any) -> Any:
        """Optional: the model's outputs for ``x`` (``python -m mpips predict``), e.g. class
        probabilities."""
        raise NotImplementedError(f"{type(self).__name__} does not implement predict()")

    def tables(self) -> list[VariableSpec]:
        """Row-partitioned tables (sparse models): none by default."""
        return []

    def table_offsets(self) -> dict[str, int]:
        """Optional (tables that each serve a part of the data's one id space, as DLRM's
        per-feature tables do): by table name, the data id its row 0 serves. Such a table
        is pulled and pushed only for the batch's ids in ``[offset, offset + rows)``. A
        pull's rows of it are still one per id of the batch, but only those at its own
        ids' positions are its rows (tables whose spans do not overlap share one buffer:
        the others are other tables' rows), and its gradient rows (``grads``) are those
        of its own ids alone, in order. Default: none (a table's rows are the ids)."""
        return {}

    def initial_rows(self, table: str, rows: tuple[int, int, int], seed: int) -> np.ndarray:
        """The initial ``range(*rows)`` rows of a table (sparse models only)."""
        raise NotImplementedError(f"{type(self).__name__} declares no tables")

    def initial_rows_of(self, table: str, ids: np.ndarray, seed: int) -> np.ndarray:
        """The initial rows of a dynamic table (``tables.kind = "dynamic"``) for ``ids``,
        a function of (seed, id) only. Default: the rows ``initial_rows`` gives for each id
        as a row (right where those depend on the row alone, as the built-in models' do)."""
        return (
            np.concatenate([self.initial_rows(table, (int(i), int(i) + 1, 1), seed) for i in ids])
            if len(ids)
            else np.zeros((0,), np.float32)
        )

    def state(self) -> dict[str, np.ndarray]:
        """Optional: values the model keeps that are not trained (a framework module's
        buffers, BatchNorm's running statistics; frozen parameters), by name, as numpy
        copies. Each worker keeps its own; the chief's are written into every checkpoint
        under these names (beside the variables) and restored into every worker's model.
        None by default."""
        return {}

    def load_state(self, values: dict[str, np.ndarray]) -> None:
        """Optional: take back state restored from a checkpoint (names as ``state()``)."""

    def fingerprints(self) -> dict[str, int]:
        """Optional: a checksum of each value the model builds itself on every rank (a
        framework module's initial parameters and buffers), compared across ranks at
        start-up: a rank that built another is refused, the first differing name said."""
        return {}

    def batch_statistics(self) -> list[str]:
        """Optional: the names of the state values that summarise the data the model saw
        (BatchNorm's running means and variances), which ``recompute_batch_statistics``
        can make anew (``train.recompute_batch_norm``). None by default."""
        return []

    def recompute_batch_statistics(self, batches: Iterable[tuple[dict[str, Any], Any]]) -> int:
        """Optional: make the ``batch_statistics()`` values anew from ``batches``, each
        ``(params, x)``: the variables (fixed) and a training batch, prepared and on the
        model's device, run forward without gradients. Returns how many batches it used
        (0: none came, and the values are left as they were). mpips calls it on the chief
        at the end of a run and in ``ckpt export --recompute-batch-norm``."""
        raise NotImplementedError(f"{type(self).__name__} keeps no batch statistics")

    def checked_initial_values(self, seed: int) -> dict[str, np.ndarray]:
        """``initial_values(seed)`` checked against ``variables()`` (what mpips calls; not
        to override): every declared name and no other, each a numpy array of the declared
        shape and dtype. A mismatch is one ConfigError at start-up (the chief makes the
        values), not a traceback on several ranks once they meet the windows or the
        replicas' buffers."""
        who = f"{type(self).__name__}.initial_values()"
        values = self.initial_values(seed)
        if not isinstance(values, dict):
            raise ConfigError(
                f"{who} returned {type(values).__name__}, not a dict of numpy arrays by "
                f"variable name"
            )
        specs = self.variables()
        declared = [s.name for s in specs]
        missing = [n for n in declared if n not in values]
        extra = [str(n) for n in values if n not in declared]
        if missing or extra:
            raise ConfigError(
                f"{who} does not match variables(): "
                + "; ".join(
                    ([f"it lacks {', '.join(missing)}"] if missing else [])
                    + ([f"it returns {', '.join(extra)}, not declared there"] if extra else [])
                )
            )
        for spec in specs:
            value = values[spec.name]
            shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
            if not isinstance(value, np.ndarray):
                raise ConfigError(
                    f"{who}[{spec.name!r}] is {type(value).__name__}, not a numpy array "
                    f"(initial values are made on the host: numpy, even for a GPU worker)"
                )
            if value.shape != shape:
                raise ConfigError(
                    f"{who}[{spec.name!r}] has shape {value.shape}; variables() declares "
                    f"{spec.name!r} with shape {shape}"
                )
            if value.dtype != dtype:
                raise ConfigError(
                    f"{who}[{spec.name!r}] is {value.dtype}; variables() declares {spec.name!r} "
                    f"as {dtype} (make it with .astype(np.{dtype}), or declare dtype="
                    f'"{value.dtype}")'
                )
        return values

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
    for spec in specs + model.tables():
        _check_dtype(spec, what)
    return model


FLOATS = ("float32", "float64", "float16")  # what the PS windows, MPI and the optimizers sum


def _check_dtype(spec: VariableSpec, what: str) -> None:
    """A variable's dtype must be a float type: gradients are summed and updates applied
    to it (and a gradient buffer's first step is checked by filling it with NaN)."""
    try:
        dtype = np.dtype(spec.dtype)
    except TypeError:
        raise ConfigError(
            f"{what}: variable {spec.name!r} has dtype {spec.dtype!r}, not a numpy dtype "
            f"(use one of {', '.join(FLOATS)})"
        ) from None
    if dtype.name not in FLOATS:
        raise ConfigError(
            f"{what}: variable {spec.name!r} is {dtype.name}: mpips trains float variables "
            f"only ({', '.join(FLOATS)}); keep counters and integer state out of variables()"
        )


def first_loss_and_grads(
    model: Model,
    params: dict[str, Any],
    x: Any,
    y: Any,
    grads: dict[str, Any],
    ready: Ready | None = None,
) -> tuple[float, str]:
    """The first step's ``loss_and_grads``, its gradient buffers checked: each is filled
    with a marked NaN (UNWRITTEN) before the call, and after it must still be the array
    mpips handed over (a rebound ``grads[name] = ...`` never reaches the variable: the run
    would train nothing) with every element written. Returns (loss, what is wrong, '' if
    nothing); the caller says it once, before anything of the step is pushed. Later steps
    call loss_and_grads directly: the check costs nothing after the first step.

    The mark survives everything mpips does with a buffer before the check (sync replicas
    may sum a bucket said ready, or update its variables, while backward goes on: a sum
    with a NaN keeps its bits), and arithmetic never makes it: a NaN gradient the model
    computed (a diverging run, another worker's update read live) is not the mark, and
    is left to the loss check."""
    names = [s.name for s in model.variables() + model.tables() if s.name in grads]
    for name in names:
        _bits(grads[name]).fill(UNWRITTEN[grads[name].dtype.itemsize])
    given = dict(grads)  # the model's own dict: what it rebinds leaves ``grads`` as it was
    try:
        loss = model.loss_and_grads(params, x, y, given, ready)
    except ConfigError as e:  # a frontend's own check of the first step, said the same way
        return math.nan, str(e)
    who = f"{type(model).__name__}.loss_and_grads"
    rebound = [n for n in names if given.get(n) is not grads[n]]
    if rebound:
        n = rebound[0]
        return loss, (
            f"{who} rebinds grads[{n!r}] (grads[{n!r}] = ...) instead of writing into the "
            f"buffer mpips hands it, so that gradient would never reach the variable: "
            f"write every gradient in place, grads[{n!r}][...] = ..."
            + (f" (rebound too: {', '.join(rebound[1:])})" if len(rebound) > 1 else "")
        )
    if not math.isfinite(loss):  # the loss check says it
        return loss, ""
    for n in names:
        g = grads[n]
        left = _unwritten_count(g)
        if left:
            extra = [str(k) for k in given if k not in grads]
            return loss, (
                f"{who} "
                + (
                    f"did not write grads[{n!r}]"
                    if left == g.size
                    else f"left {left} of {g.size} elements of grads[{n!r}] unwritten"
                )
                + f" at the first step: write every element of every gradient in place, "
                f"grads[{n!r}][...] = ..."
                + (f" (it set grads[{extra[0]!r}]: no variable has that name)" if extra else "")
            )
    return loss, ""


# A quiet NaN with a payload, by item size (float16, 32, 64): what a gradient buffer holds
# before the first step. Arithmetic gives NaN without it (the default NaN) or carries the
# payload of a NaN operand, and no operand of a model's gradient holds it.
UNWRITTEN = {2: 0x7E6D, 4: 0x7FCDA000, 8: 0x7FF9B40000000000}
CHECK_CHUNK = 1 << 22  # elements compared at a time: no temporary the size of a big buffer


def _bits(g: Any) -> Any:
    """A (numpy or cupy) float buffer's elements as unsigned integers of the same size: a
    view of any layout (writes reach the buffer)."""
    return g.view(f"uint{8 * g.dtype.itemsize}")


def _unwritten_count(g: Any) -> int:
    """How many elements of a gradient buffer still hold UNWRITTEN, a chunk at a time."""
    flat, mark = _bits(g).reshape(-1), UNWRITTEN[g.dtype.itemsize]
    chunks = (flat[i : i + CHECK_CHUNK] for i in range(0, flat.size, CHECK_CHUNK))
    return sum(int((c == mark).sum()) for c in chunks)


def said_once(problem: str, speaker: bool) -> MpipsError:
    """What a rank raises for a model's mistake found during the run: a ConfigError (exit
    2) on the one rank that says it, a quiet AlreadyReported with the same exit code on the
    others (they abort a little later, so the message is said once)."""
    if speaker:
        return ConfigError(problem)
    quiet = AlreadyReported(problem)
    quiet.exit_code = ConfigError.exit_code
    return quiet


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
        raise ConfigError(f"{where}: {_import_problem(module_name, attr, e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: {module_name} has no {attr}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"{where}: {attr} is not callable")
    return cast(Callable[..., Any], obj)


def _import_problem(module_name: str, attr: str, e: Exception) -> str:
    """Why the module of a model.kind did not import, in words: a file name given as the
    module's name (``net.py``) says the name to give; an error raised in the user's module
    says its file and line."""
    named_a_file = module_name.endswith(".py") and getattr(e, "name", None) == module_name
    if isinstance(e, ModuleNotFoundError) and named_a_file:
        return (
            f"drop the .py: model.kind names a module as Python imports it, "
            f'model.kind = "{module_name.removesuffix(".py")}:{attr}" (looked for beside the '
            f"job file, then in the working directory)"
        )
    return f"cannot import {module_name} ({type(e).__name__}: {e}{_at_user_line(e)})"


def _at_user_line(e: BaseException) -> str:
    """`` at file.py:12`` where ``e`` was raised in the user's own code, else empty."""
    from ..process.failure import user_frame

    frame = user_frame(e)
    return f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""


def seed_globals(seed: int) -> None:
    """Seed the global random generators a factory may draw from with ``seed``
    (model.init_seed), so that every rank builds the same model: Python's ``random``,
    numpy's global generator, and torch's (CPU and CUDA) where torch is imported. JAX keeps
    no global state: ``mpips.jax.Model`` makes its parameters from a key of the seed."""
    random.seed(seed)
    np.random.seed(seed if seed < 1 << 32 else [seed & 0xFFFFFFFF, seed >> 32])
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)


def build_from_factory(
    factory: Callable[..., Any],
    data: DatasetInfo,
    xp: ModuleType,
    args: dict[str, Any],
    what: str,
    seed: int = 0,
) -> Model:
    """``factory(data, **args)`` checked, with ``xp`` set; ConfigError if it raises or
    returns something that is not a model. The global generators are seeded with ``seed``
    first (seed_globals), whatever the factory imports: one that imported torch for the
    first time drew from an unseeded torch, so it is called once more, torch seeded."""
    had_torch = "torch" in sys.modules
    model = _call_factory(factory, data, args, what, seed)
    if not had_torch and "torch" in sys.modules:
        model = _call_factory(factory, data, args, what, seed)
    model = check_model(model, what)
    model.xp = xp
    return model


def _call_factory(
    factory: Callable[..., Any], data: DatasetInfo, args: dict[str, Any], what: str, seed: int
) -> Any:
    """``factory(data, **args)`` after seed_globals(seed); what it raises, a ConfigError."""
    seed_globals(seed)
    try:
        return factory(data, **args)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{what} raised {type(e).__name__}: {e}{_at_user_line(e)}") from None


def factory_name(factory: Any) -> str:
    """How a factory passed to the Python API is named in messages and manifests."""
    module = inspect.getmodule(factory)
    return f"{module.__name__ if module else '?'}:{getattr(factory, '__qualname__', factory)}"

"""Evaluate or predict from a checkpoint in one process, without MPI: the job's model (built
in, or your own) with the variables a checkpoint holds, on the job's test split or on an
array file."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .. import checkpoint
from ..checkpoint.dynamic import IDS
from ..data.batches import (
    NUMPY_ERRORS,
    DatasetInfo,
    check_finite,
    load_split,
    npz_member,
    numpy_reason,
    open_data,
    open_npz,
    raw_range,
)
from ..data.hdf5 import h5py_errors, open_plain
from ..errors import CheckpointError, ConfigError, DataError
from ..job import Job
from ..models.contract import Model
from ..models.initial import from_model
from ..models.mlp import build_model
from ..models.variables import VariableSpec
from ..process.files import check_regular
from ..process.memory import check_fits

INPUT_SUFFIXES = (".npy", ".npz", ".h5", ".hdf5")


def restore_model(
    job: Job, ckpt_path: str | None = None, factory: Any = None
) -> tuple[Model, dict[str, np.ndarray], checkpoint.Checkpoint, DatasetInfo]:
    """The job's model, every variable and table of the checkpoint (``ckpt_path``: a manifest
    or a directory; default the job's checkpoint.dir), the checkpoint and the job's data. The
    manifest must name the same model as the job (a checkpoint of another model is one clear
    error), and every value must be finite (NaN weights give NaN metrics and predictions:
    one clear error naming the variable instead)."""
    where = ckpt_path or job.checkpoint.dir
    if not where:
        raise ConfigError("no checkpoint: the job has no checkpoint.dir; give --ckpt PATH")
    ckpt = checkpoint.resolve(where)
    info = open_data(job.data)
    model = build_model(job.model, info, np, job.source, factory)
    wrote = ckpt.meta.get("model")
    if wrote is not None and wrote != job.model.kind:
        raise CheckpointError(
            f"checkpoint {ckpt.path} was written by model {wrote!r}, but the "
            f"job's model.kind is {job.model.kind!r}"
        )
    dynamic = [t for t in model.tables() if t.name + IDS in ckpt.variables]
    fixed = [t for t in model.tables() if t not in dynamic]
    params = ckpt.read(
        model.variables() + fixed,
        initial=from_model(model),
        finite=(
            f"its metrics and predictions would be meaningless; use an earlier checkpoint "
            f"(--ckpt {ckpt.directory}/ckpt-<step>.json, see python -m mpips ckpt list "
            f"{ckpt.directory})"
        ),
    )
    for t in dynamic:  # (tables.kind = "dynamic": rows by id)
        if hasattr(model, "use_dynamic_tables"):
            model.use_dynamic_tables()
        names = [t.name, t.name + IDS]
        entries = {n: ckpt.variables[n] for n in names}
        got = ckpt.read([VariableSpec(n, e.shape, e.dtype) for n, e in entries.items()])
        # (read by _params_for, the one reader of a table's value here)
        params[t.name] = ByIds(got[t.name + IDS], got[t.name].astype(t.dtype))  # type: ignore[assignment]
    kept = [
        VariableSpec(n, tuple(a.shape), a.dtype.name)
        for n, a in model.state().items()
        if n in ckpt.variables
    ]
    if kept:  # the chief's buffers and frozen parameters, as the run evaluated with them
        model.load_state(ckpt.read(kept))
    return model, params, ckpt, info


class ByIds:
    """A dynamic table as a checkpoint holds it: its live rows and their ids; an id with
    no row reads a zero row, as a worker's pull does."""

    def __init__(self, ids: np.ndarray, rows: np.ndarray):
        order = np.argsort(ids, kind="stable")
        self.ids, self.rows = ids[order], rows[order]

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        at = np.minimum(np.searchsorted(self.ids, ids), max(len(self.ids) - 1, 0))
        found = self.ids[at] == ids if len(self.ids) else np.zeros(len(ids), bool)
        out = np.zeros((len(ids),) + self.rows.shape[1:], self.rows.dtype)
        out[found] = self.rows[at[found]]
        return out


def _params_for(model: Model, params: dict[str, np.ndarray], x: Any) -> tuple[Any, dict]:
    """The batch as the model wants it, and the parameters for it (sparse models: the
    table rows of its ids, as a worker pulls them)."""
    x, ids = model.prepare(x)
    if ids is None:
        return x, params
    tables = {t.name for t in model.tables()}
    offsets: dict[str, int] = getattr(model, "table_offsets", dict)()

    def rows(name: str, table: np.ndarray) -> np.ndarray:
        """The table's rows for the ids (those it does not serve: zero)."""
        if isinstance(table, ByIds):
            return table.rows_of(ids)
        first = offsets.get(name)
        if first is None:
            return table[ids]
        out = np.zeros((len(ids),) + table.shape[1:], table.dtype)
        inside = (ids >= first) & (ids < first + len(table))
        out[inside] = table[ids[inside] - first]
        return out

    return x, {k: (rows(k, v) if k in tables else v) for k, v in params.items()}


def evaluate(job: Job, ckpt_path: str | None = None) -> tuple[dict[str, float], int, Path]:
    """Metrics of the checkpoint on the job's test split: (metrics, global_step, manifest)."""
    model, params, ckpt, info = restore_model(job, ckpt_path)
    x, y = load_split(info, "test")
    x, params = _params_for(model, params, x)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        metrics = {k: float(v) for k, v in model.evaluate(params, x, y).items()}
    return metrics, ckpt.step, ckpt.path


def load_inputs(path: str) -> np.ndarray:
    """The array to predict on: a .npy file, the array ``x`` (or the only one) of a .npz file,
    or the dataset ``x`` of an HDF5 file; numbers only, no pickle."""
    p = Path(path)
    if p.suffix not in INPUT_SUFFIXES:
        raise DataError(f"--input {path}: give a {', '.join(INPUT_SUFFIXES)} file")
    check_regular(p, DataError, f"--input {path}")
    try:
        if p.suffix == ".npy":
            x = np.load(p, mmap_mode="r", allow_pickle=False)
        elif p.suffix == ".npz":
            with open_npz(p, f"--input {path}", ".npz file") as z:
                names = list(z.files)
                if "x" not in names and (len(names) != 1 or names == ["y"]):
                    raise DataError(f"--input {path}: holds {names}; name the inputs 'x'")
                x = npz_member(z, "x" if "x" in names else names[0])
        else:

            def damaged(why: str) -> DataError:
                return DataError(f"--input {path}: unreadable ({why})")

            with open_plain(p, DataError, f"--input {path}", damaged) as f, h5py_errors(damaged):
                ds = f.get("x")
                if not isinstance(ds, h5py.Dataset):
                    raise DataError(f"--input {path}: no dataset 'x'")
                check_fits(ds.size * ds.dtype.itemsize * 2, f"--input {path}", DataError)
                x = ds[()]
    except DataError:
        raise
    except (*NUMPY_ERRORS, KeyError) as e:  # (np.load's and a zip's errors: data.py)
        raise DataError(f"--input {path}: unreadable ({numpy_reason(e)})") from None
    if x.dtype.kind not in "biuf":
        raise DataError(f"--input {path}: holds {x.dtype} values, not numbers")
    with np.errstate(over="ignore"):  # a value past float32's range: inf, refused by predict
        return np.asarray(x, np.float32)


def predict(
    job: Job,
    inputs: str,
    output: str,
    ckpt_path: str | None = None,
    input_scaled: bool | None = None,
    warn: Callable[[str], None] | None = None,
) -> tuple[int, int]:
    """Write the model's predictions for the inputs to ``output`` (.npy); returns (rows,
    global_step of the checkpoint). ``input_scaled``: whether the rows are multiplied by the
    data's x_scale already (True) or raw (False); None decides from their range, and
    refuses rows that look scaled (see input_is_scaled). ``warn``: where a range at odds
    with what ``input_scaled`` says is told (default: a line on stderr)."""
    from ..process.files import atomic_write

    model, params, ckpt, info = restore_model(job, ckpt_path)
    if not Path(output).suffix == ".npy":
        raise ConfigError(f"--output {output}: predictions are written as a .npy file")
    if type(model).predict is Model.predict:
        raise ConfigError(
            f"{type(model).__module__}.{type(model).__qualname__} does not implement "
            f"predict(params, x), which `predict` needs (an mpips.Model defines the method; "
            f"mpips.jax.Model takes predict=, mpips.torch.Model has one)"
        )
    x = load_inputs(inputs)
    if info.sparse:
        raise ConfigError("predict takes dense inputs; sparse (CTR) models: use eval")
    if x.ndim < 1 or int(np.prod(x.shape[1:])) != info.num_inputs:
        raise DataError(
            f"--input {inputs}: shape {list(x.shape)}, the model takes rows of "
            f"{info.num_inputs} inputs"
        )
    if not len(x):
        raise DataError(f"--input {inputs}: holds no rows (shape {list(x.shape)})")
    x = x.reshape(len(x), -1)
    check_finite(x, f"--input {inputs}", "input")
    if not input_is_scaled(x, info, input_scaled, inputs, warn or _warn):
        with np.errstate(over="ignore"):  # an overflow to inf is said just below
            x = x * np.float32(info.x_scale)
        check_finite(x, f"--input {inputs}", "input", detail=f" (times x_scale {info.x_scale})")
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out = np.asarray(model.predict(params, x))

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file, not a name: np.save would add ".npy" to it
            np.save(f, out, allow_pickle=False)

    atomic_write(output, write, "no predictions written")
    return len(x), ckpt.step


def _warn(text: str) -> None:
    print(f"mpips: warning: {text}", file=sys.stderr)


def input_is_scaled(
    x: np.ndarray,
    info: DatasetInfo,
    given: bool | None,
    inputs: str,
    warn: Callable[[str], None],
) -> bool:
    """Whether predict's rows ``x`` (finite) are multiplied by the data's x_scale already.
    ``given`` (--input-scaled / --input-raw) decides, and a range at odds with it is told
    to ``warn``; without it the rows are raw unless their range looks scaled: then they are
    refused (DataError), as scaling them again would give confident nonsense. An x_scale
    of 1 makes both the same."""
    if info.x_scale == 1.0:
        return True
    raw = raw_range(info)
    scaled = (raw[0] * info.x_scale, raw[1] * info.x_scale)
    span = (float(x.min()), float(x.max()))
    looks = looks_scaled(span, raw, info.x_scale)
    if (given is None and not looks) or looks is None or looks == given:
        return bool(given)
    after = f"after x_scale {info.x_scale:g} ([{scaled[0]:g}, {scaled[1]:g}])"
    before = f"before x_scale ([{raw[0]:g}, {raw[1]:g}])"
    said = (
        f"--input {inputs}: its values span [{span[0]:g}, {span[1]:g}], like the training "
        f"inputs " + (f"{after}, not {before}" if looks else f"{before}, not {after}")
    )
    if given is None:
        raise DataError(
            f"{said}: scaled again, they would give meaningless predictions. Give --input-scaled "
            f"to use them as they are, or --input-raw to multiply them by x_scale"
        )
    flag = "--input-scaled: used as they are" if given else "--input-raw: multiplied by x_scale"
    warn(f"{said}; {flag} all the same")
    return given


def looks_scaled(
    span: tuple[float, float], raw: tuple[float, float], x_scale: float
) -> bool | None:
    """Whether inputs spanning ``span`` look multiplied by ``x_scale`` already, the training
    inputs spanning ``raw`` before it: their largest magnitude nearer (as a ratio) to the
    training inputs' after x_scale than before it. None if either is all zeros."""
    top, top_raw = max(abs(span[0]), abs(span[1])), max(abs(raw[0]), abs(raw[1]))
    if not top > 0 or not top_raw > 0:
        return None
    return abs(math.log(top / (top_raw * x_scale))) < abs(math.log(top / top_raw))

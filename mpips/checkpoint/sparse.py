"""Table partitions stored sparsely: only the rows that differ from their initial values.

A PS writes a table partition (and its slots) as ``index`` and ``values`` where that writes at
most SPARSE_MAX_FRACTION of its bytes, saying what the other rows hold: one constant, or the
model's initial rows of a seed (computed by the InitialValues the writer is handed, never by
a model the file names). A reader checks such a part here before it trusts any of it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..data.hdf5 import fixed_text, plain_attrs
from ..errors import CheckpointError
from ..models.initial import InitialValues, row_chunks
from ..process.memory import check_fits
from .checksum import crc32, recorded, write_array, write_checked
from .format import NUMBER_KINDS, SPARSE, Entry, Part, Rows, h5_path

SPARSE_MIN_BYTES = 1 << 16  # smaller partitions are written whole: sparse saves too little
SPARSE_MAX_FRACTION = 0.5  # sparse only if it writes at most this fraction of the bytes


@dataclass(frozen=True)
class SparseTables:
    """What a PS knows to write its table partitions sparsely: each partition's rows by
    table name, the seed of their initial values, and how to compute those."""

    rows: dict[str, Rows]
    seed: int
    initial: InitialValues


@dataclass
class Changed:
    """Rows of one array of a table partition found to differ from their initial values,
    gathered a chunk at a time while storing them sparsely still pays."""

    array: np.ndarray
    limit: int  # more changed rows than this: the whole array is smaller
    index_dtype: np.dtype[Any]
    found: list[np.ndarray] = field(default_factory=list)
    count: int = 0
    constant: np.ndarray | None = None  # the bits every initial row holds, if one value
    varies: bool = False  # the initial rows are not one value
    on_step: int | None = None  # an increment: the other rows are checkpoint on_step's

    @classmethod
    def increment(cls, array: np.ndarray, index: np.ndarray, on_step: int) -> Changed:
        """Rows ``index`` of ``array``, changed since checkpoint ``on_step`` (see increments)."""
        dtype = _index_dtype(len(array))
        return cls(array, len(array), dtype, [index.astype(dtype)], len(index), on_step=on_step)

    def add(self, lo: int, initial: np.ndarray) -> bool:
        """Compare rows [lo, lo + len(initial)) with their ``initial`` values, bit for bit
        (-0.0 is not 0.0: a restore must give the same bits); False once sparse no longer
        pays, or if ``initial`` is not rows of this array."""
        current = self.array[lo : lo + len(initial)]
        if initial.shape != current.shape or initial.dtype != current.dtype:
            return False
        old = _bits(initial)
        changed = np.flatnonzero((_bits(current) != old).any(axis=1))
        self.count += len(changed)
        if self.count > self.limit:
            return False
        if len(changed):
            self.found.append((changed + lo).astype(self.index_dtype))
        if old.dtype.itemsize != current.dtype.itemsize:
            self.varies = True  # compared as bytes: no one value to name
        if not self.varies and old.size:
            self.constant = old.flat[0] if self.constant is None else self.constant
            self.varies = bool((old != self.constant).any())
        return True

    def index(self) -> np.ndarray:
        """Positions of the changed rows in the partition, ascending."""
        return np.concatenate(self.found) if self.found else np.zeros(0, self.index_dtype)

    def base(self) -> np.ndarray | None:
        """The one value every untouched row holds (a 0-d array of the array's dtype), or
        None: they hold the model's initial rows."""
        if self.varies or self.constant is None:
            return None
        return np.asarray(self.constant).view(self.array.dtype).reshape(())


def _bits(a: np.ndarray) -> np.ndarray:
    """``a`` as rows of unsigned integers of the same bits, for exact comparison."""
    rows = a.reshape(len(a), -1)
    size = rows.dtype.itemsize
    return rows.view(f"u{size}") if size in (1, 2, 4, 8) else rows.view(np.uint8)


def _index_dtype(rows: int) -> np.dtype[Any]:
    """The dtype of the row index of a part of ``rows`` rows."""
    return np.dtype(np.uint32 if rows <= 1 << 32 else np.int64)


def _may_be_sparse(array: np.ndarray) -> bool:
    """Worth comparing with its initial rows: a numeric array with rows, large enough."""
    return (
        array.ndim >= 1
        and array.dtype.kind in NUMBER_KINDS
        and array.size * array.dtype.itemsize >= SPARSE_MIN_BYTES
    )


def _changed_rows(
    table: str, rows: Rows, arrays: dict[str, np.ndarray], tables: SparseTables
) -> dict[str, Changed]:
    """For each array of one table partition (the table itself as "", its slots by slot
    name) that pays to write sparsely: its rows that differ from their initial values. One
    pass over the partition, a chunk of rows at a time; the initial values of each chunk are
    computed once for the table and all its slots, and the pass stops early once no array
    pays."""
    part = range(*rows)
    pending: dict[str, Changed] = {}
    for key, a in arrays.items():
        if _may_be_sparse(a) and len(a) == len(part):
            row_bytes = a[:1].nbytes
            index_dtype = _index_dtype(len(a))
            limit = int(SPARSE_MAX_FRACTION * len(a) * row_bytes) // (
                row_bytes + index_dtype.itemsize
            )
            pending[key] = Changed(a, limit, index_dtype)
    width = max((a[:1].size for a in arrays.values()), default=1)
    for lo, hi in row_chunks(len(part), width, tables.initial.chunk_elements):
        if not pending:
            break
        sub = part[lo:hi]
        initial = tables.initial.compute(table, (sub.start, sub.stop, sub.step), tables.seed)
        for key in list(pending):
            values = initial.get(key)
            if values is None or not pending[key].add(lo, np.asarray(values)):
                del pending[key]
    return pending


def sparse_parts(
    variables: dict[str, np.ndarray],
    slots: dict[str, np.ndarray],
    tables: SparseTables | None,
    done: Collection[str] = (),
) -> dict[str, Changed]:
    """The arrays of a shard that are written sparsely, by their path in it, with their
    changed rows: those of the table partitions (and their slots) where sparse pays, but
    the paths ``done`` (written as increments)."""
    out: dict[str, Changed] = {}
    for table, rows in (tables.rows if tables else {}).items():
        assert tables is not None
        arrays = {
            k: a
            for k, a in _table_arrays(table, variables, slots).items()
            if _path(table, k) not in done
        }
        found = _changed_rows(table, rows, arrays, tables) if arrays else {}
        out.update({_path(table, k): c for k, c in found.items()})
    return out


def table_arrays(
    variables: dict[str, np.ndarray], slots: dict[str, np.ndarray], tables: SparseTables | None
) -> dict[str, np.ndarray]:
    """The arrays of a shard that may be stored sparsely (as rows changed from their initial
    values, or since the last checkpoint), by their path in it: each table partition and
    slot of one that is large enough."""
    out: dict[str, np.ndarray] = {}
    for table, rows in (tables.rows if tables else {}).items():
        for key, a in _table_arrays(table, variables, slots).items():
            if _may_be_sparse(a) and len(a) == len(range(*rows)):
                out[_path(table, key)] = a
    return out


def _path(table: str, key: str) -> str:
    """The path in a shard of a table's partition (``key`` "") or of its slot ``key``."""
    return h5_path(f"{table}/{key}" if key else table, bool(key))


def write_sparse(f: h5py.File, path: str, changed: Changed, tables: SparseTables) -> None:
    """One array of a table partition as a group: ``index`` (positions of the rows that
    differ from their initial values, ascending), ``values`` (those rows), and attributes
    saying what the other rows hold: ``base`` "constant" (``value``), "initial" (the
    model's initial rows of ``seed``) or, for an increment, "checkpoint" (the rows of the
    checkpoint at global step ``step``: the index then holds the rows changed since). Both
    datasets carry the crc32 of what was written (see checksum)."""
    a, index = changed.array, changed.index()
    g = f.create_group(path)
    g.attrs["layout"] = fixed_text(SPARSE)
    g.attrs["rows"] = len(a)
    base = changed.base()
    if changed.on_step is not None:
        g.attrs["base"] = fixed_text("checkpoint")
        g.attrs["step"] = changed.on_step
    elif base is not None:
        g.attrs["base"] = fixed_text("constant")
        g.attrs["value"] = base
    else:
        g.attrs["base"] = fixed_text("initial")
        g.attrs["seed"] = tables.seed
    write_array(g, "index", index)
    chunks = row_chunks(len(index), a[:1].size, tables.initial.chunk_elements)
    blocks = (((slice(lo, hi),), a[index[lo:hi]]) for lo, hi in chunks)
    write_checked(g, "values", (len(index),) + a.shape[1:], a.dtype, blocks)


def _table_arrays(
    table: str, variables: dict[str, np.ndarray], slots: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A table's partition ("") and its slots' (by slot name) among a shard's arrays."""
    out = {"": variables[table]} if table in variables else {}
    for name, a in slots.items():
        var, slot = name.rsplit("/", 1)
        if var == table:
            out[slot] = a
    return out


@dataclass(frozen=True)
class SparsePart:
    """A part stored sparsely, checked: its rows of the whole variable, the ascending
    positions (in the part) of the rows it stores, those rows, and what the other rows hold
    (``constant``, the initial values of ``seed``, or the rows of checkpoint ``on_step``),
    and the crc32 ``values`` was written with (None: its shard records none)."""

    rows: range
    index: np.ndarray
    values: h5py.Dataset
    constant: np.ndarray | None
    seed: int
    crc: int | None = None
    on_step: int | None = None


def check_sparse(
    path: Path, name: str, entry: Entry, part: Part, g: h5py.Group, checksummed: bool = False
) -> SparsePart:
    """A sparse part checked: its attributes, the shapes and dtypes of its index and
    values, every index entry (in range, strictly ascending) and, if ``checksummed`` (its
    shard records crc32s), the index's crc32; a CheckpointError saying what is wrong
    otherwise. The values' crc32 is checked as they are read (see Checkpoint)."""
    dtype = np.dtype(entry.dtype)
    rows = range(*(part.rows or (0, entry.shape[0], 1)))
    shard = Path(g.file.filename).name

    def bad(problem: str) -> CheckpointError:
        return CheckpointError(
            f"checkpoint {path}: shard {shard} holds '{name}' sparsely, but {problem}"
        )

    attrs = plain_attrs(g)
    if attrs.get("layout") != SPARSE:
        raise bad(f"its layout is {attrs.get('layout')!r}, not {SPARSE!r}")
    if integer(attrs.get("rows")) != len(rows):
        raise bad(f"it says it has {attrs.get('rows')} rows, the manifest {len(rows)}")
    index, values = g.get("index"), g.get("values")
    if not isinstance(index, h5py.Dataset) or index.ndim != 1 or index.dtype.kind not in "iu":
        raise bad("its row index is not a 1-D array of integers")
    if not isinstance(values, h5py.Dataset):
        raise bad("it has no values")
    k = index.shape[0]
    if k > len(rows):
        raise bad(f"its row index has {k} entries for {len(rows)} rows")
    if values.shape != (k,) + entry.shape[1:] or values.dtype != dtype:
        raise bad(
            f"its values are {values.dtype}{list(values.shape)}, not "
            f"{dtype}{[k, *entry.shape[1:]]} (one row per index entry)"
        )
    constant, seed, on_step = _sparse_base(attrs, dtype, bad)
    check_fits(8 * k, f"reading checkpoint {path}", CheckpointError)
    stored = index[()]
    positions = stored.astype(np.int64)
    if k and (positions.min() < 0 or positions.max() >= len(rows)):
        raise bad(f"its row index holds positions outside 0..{len(rows) - 1}")
    if k and bool((positions[1:] <= positions[:-1]).any()):
        raise bad("its row index is not strictly ascending (sorted, no repeats)")
    _check_index_crc(index, stored, checksummed, bad)
    crc = recorded(values, checksummed, _no_crc(bad))
    return SparsePart(rows, positions, values, constant, seed, crc, on_step)


def _no_crc(bad: Callable[[str], CheckpointError]) -> Callable[[str], CheckpointError]:
    """The error for a dataset of a sparse part that carries no crc32 its shard records."""
    return lambda dataset: bad(f"its dataset {dataset} carries no crc32 (its shard records them)")


def _check_index_crc(
    index: h5py.Dataset,
    stored: np.ndarray,
    checksummed: bool,
    bad: Callable[[str], CheckpointError],
) -> None:
    """``bad`` unless ``stored``, the row ``index`` read whole, matches the crc32 it was
    written with (if its shard records one)."""
    expected = recorded(index, checksummed, _no_crc(bad))
    got = crc32(stored)
    if expected is not None and got != expected:
        raise bad(
            f"its row index does not match the checksum written with it (crc32 {got:08x}, "
            f"written {expected:08x}): the shard is damaged"
        )


def _sparse_base(
    attrs: dict[str, Any], dtype: np.dtype[Any], bad: Callable[[str], CheckpointError]
) -> tuple[np.ndarray | None, int, int | None]:
    """(the constant the unstored rows hold, or None; the seed of their initial values; the
    step of the checkpoint that holds them, or None)."""
    base = attrs.get("base")
    if base == "constant":
        value = attrs.get("value")
        if not isinstance(value, np.generic | np.ndarray) or value.dtype != dtype:
            raise bad(f"its constant is not one {dtype}")
        if np.size(value) != 1:
            raise bad(f"its constant is not one {dtype}")
        return np.asarray(value).reshape(()), 0, None
    if base == "initial":
        seed = integer(attrs.get("seed"))
        if seed is None:
            raise bad("the seed of its initial values is not an integer")
        return None, seed, None
    if base == "checkpoint":
        step = integer(attrs.get("step"))
        if step is None or step < 0:
            raise bad("the step of the checkpoint it overlays is not an integer")
        return None, 0, step
    raise bad(f"what its other rows hold is {base!r}, not 'constant', 'initial' or 'checkpoint'")


def integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer (a Python or numpy one, not a bool)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        return None
    return int(value)

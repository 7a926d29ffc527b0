"""Training data: where a job's arrays are, each worker's part of the rows, and its batches.

Dense data comes from an HDF5 file (``train/x, train/y, test/x, test/y`` and optionally
``val/x, val/y`` by default, or any dataset paths the job names), a ``.npz`` file, ``.npy``
files, or arrays handed to ``mpips.train``. x is rows of numbers (each row flattened to
float32 inputs), y is 1-D integer labels. A worker either reads its part whole into memory,
or (``data.chunk_rows``) streams it from the file in chunks with a bounded read-ahead, so a
dataset larger than memory trains. Sparse CTR files (CSR) are read by sparse.py.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import queue
import re
import shlex
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import DataError
from ..process.files import check_regular
from ..process.log import log
from ..process.memory import check_fits
from . import sparse
from .hdf5 import Damaged, h5py_errors, open_plain, plain_attrs

if TYPE_CHECKING:
    from ..job import DataConfig

SPLITS = ("train", "test")
ALL_SPLITS = ("train", "test", "val")
MAX_CLASSES = 1 << 24  # more output units than this is a corrupt or hostile attribute
LABEL_CHUNK = 1 << 20  # labels scanned this many at a time (for num_classes)
SCAN_BYTES = 1 << 24  # rows with a value that is not finite are looked for this much at a time
RANGE_ROWS = 1 << 16  # train rows read (at most) for the inputs' range, without an x_range
IDX_NAME = re.compile(r"idx\d-ubyte")  # MNIST's raw files: train-images-idx3-ubyte(.gz)
LOOKED_AT = 1000  # entries of a folder named as data.path looked at for idx files
# default names of the arrays in each kind of container
HDF5_NAMES = {s: (f"{s}/x", f"{s}/y") for s in ALL_SPLITS}
NPZ_NAMES = {s: (f"x_{s}", f"y_{s}") for s in ALL_SPLITS}  # Keras' mnist.npz convention
# what np.load raises on an empty, truncated or damaged .npy or .npz file, a zip's own errors
# included (a bad CRC, corrupt deflate data, an encrypted member or an unknown compression
# method, a NotImplementedError: a RuntimeError), and on a header declaring a huge array
NUMPY_ERRORS = (
    OSError,
    ValueError,
    EOFError,
    RuntimeError,
    MemoryError,
    zipfile.BadZipFile,
    zlib.error,
)

Batch = tuple[int, Any, Any]  # (epoch, x, y)


@dataclass(frozen=True)
class DatasetInfo:
    """Shape facts of a dataset, checked once on open, and where its arrays are."""

    path: str
    num_inputs: int  # features (sparse: the id space)
    num_classes: int
    rows: dict[str, int]
    x_scale: float = 1.0
    sparse: bool = False  # CSR rows of (id, value) features (see sparse.py)
    max_nnz: int = 0  # sparse: most features in one row
    kind: str = "hdf5"  # "hdf5", "npz", "npy" (one file per array) or "arrays" (in memory)
    names: dict[str, tuple[str, str]] = field(default_factory=lambda: dict(HDF5_NAMES))
    arrays: Mapping[str, tuple[Any, Any]] | None = field(
        default=None, compare=False, repr=False
    )  # kind "arrays"


def resolve_path(path: str, builtin: str) -> str:
    """The HDF5 file a job's [data] names (a path, or a dataset shipped in the package)."""
    if builtin:
        return str(resources.files("mpips.builtin").joinpath(f"{builtin}.h5"))
    return path


# -- opening ----------------------------------------------------------------------------------


@dataclass
class _Arrays:
    """An open container of a dataset's arrays: HDF5 datasets and .npy memory maps are read
    only where sliced; a .npz member is read whole once."""

    get: Callable[[str], Any]  # name -> array-like (shape, dtype, slicing)
    has: Callable[[str], bool]
    attrs: dict[str, Any]  # HDF5 attributes (num_classes, x_scale, ...)
    file: Any = None  # the HDF5 file (sparse CSR files are checked on it)


@contextlib.contextmanager
def _container(info: DatasetInfo) -> Iterator[_Arrays]:
    """The dataset's container, open for the duration."""
    if info.kind == "hdf5":
        damaged = _damaged(info)
        with open_plain(info.path, DataError, _where(info), damaged) as f:
            with h5py_errors(damaged):
                attrs = plain_attrs(f)

            def get(name: str) -> _H5Dataset:
                with h5py_errors(damaged):
                    return _H5Dataset(f[name], damaged)

            def has(name: str) -> bool:
                with h5py_errors(damaged):
                    return name in f

            yield _Arrays(get, has, attrs, f)
    elif info.kind == "npz":
        with open_npz(info.path, _where(info), ".npz dataset") as z:
            cache: dict[str, Any] = {}

            def member(name: str) -> np.ndarray:
                if name not in cache:
                    with numpy_errors(_where(info), ".npz dataset"):
                        cache[name] = npz_member(z, name)
                return cache[name]

            yield _Arrays(member, lambda n: n in z.files, {})
    elif info.kind == "npy":
        yield _Arrays(_load_npy, os.path.exists, {})
    else:
        assert info.arrays is not None
        flat = {
            n: a
            for split, pair in info.arrays.items()
            for n, a in zip(info.names[split], pair, strict=False)
        }
        yield _Arrays(lambda n: _as_array(flat[n]), flat.__contains__, {})


def _damaged(info: DatasetInfo) -> Damaged:
    """The error for an HDF5 data file h5py cannot read (damaged, truncated, not HDF5)."""

    def damaged(why: str) -> DataError:
        return DataError(f"{_where(info)}: not a readable mpips HDF5 dataset ({why})")

    return damaged


class _H5Dataset:
    """A dataset of an HDF5 data file as the readers here use it (shape, dtype, ndim,
    slices), each h5py call turning h5py's errors on a damaged file into one DataError
    naming the file (``damaged``)."""

    def __init__(self, ds: Any, damaged: Damaged):
        self._ds, self._damaged = ds, damaged

    @property
    def shape(self) -> tuple[int, ...]:
        with h5py_errors(self._damaged):
            return tuple(self._ds.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        with h5py_errors(self._damaged):
            return np.dtype(self._ds.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> Any:
        with h5py_errors(self._damaged):
            return self._ds[key]


def _load_npy(path: str) -> Any:
    """One .npy array as a read-only memory map, after checking it is a regular file."""
    check_regular(path, DataError, f"data file {path}")
    with numpy_errors(f"data file {path}", ".npy dataset"):
        return np.load(path, mmap_mode="r", allow_pickle=False)


@contextlib.contextmanager
def numpy_errors(what: str, kind: str) -> Iterator[None]:
    """np.load's errors on a bad file (NUMPY_ERRORS) as one DataError naming ``what``: "not a
    readable ``kind`` (why)", ``kind`` e.g. ".npz file". Wrap the reading only: an error of
    the caller's own code would be blamed on the file."""
    try:
        yield
    except NUMPY_ERRORS as e:
        raise DataError(f"{what}: not a readable {kind} ({numpy_reason(e)})") from None


def numpy_reason(e: BaseException) -> str:
    """Why np.load could not read a file, in a few words: numpy says "No data left in file"
    of an empty one, and of one in no numpy format advises unpickling it; a zip member's
    compressed data that ends early is an EOFError with no text."""
    text = str(e)
    if isinstance(e, EOFError):
        return "empty" if "No data left" in text else "truncated"
    if isinstance(e, ValueError) and "allow_pickle" in text:
        return "not in numpy's format, or Python objects, which mpips never unpickles"
    if isinstance(e, ValueError) and "mmap length" in text:
        return "truncated: shorter than its header says"
    if isinstance(e, MemoryError):  # (a valid member larger than memory, or a bad header)
        return (
            f"{text.strip() or 'out of memory'}: more than this machine's memory holds; a .npz "
            f"member is read whole, a .npy file is memory-mapped (data convert writes HDF5)"
        )
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def open_npz(path: str | Path, what: str, kind: str = ".npz file") -> Any:
    """``path`` opened as a .npz file (close it: ``with``), its members read when asked for;
    any problem is one DataError naming ``what``, a .npy file given a .npz's name too."""
    check_regular(path, DataError, what)  # a FIFO would block np.load
    with numpy_errors(what, kind):
        z = np.load(path, allow_pickle=False)
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise DataError(f"{what}: not a readable {kind} (one .npy array, not a zip of them)")
    return z


def npz_member(z: Any, name: str) -> np.ndarray:
    """The array ``name`` of an open .npz file; ValueError if that member is not a .npy file
    (np.load gives such a member's bytes: no array, no dtype)."""
    a = z[name]
    if not isinstance(a, np.ndarray):
        raise ValueError(f"its member {name}.npy is not a numpy array")
    return a


def _as_array(a: Any) -> Any:
    """Arrays handed to the Python API: numpy arrays, memory maps and h5py datasets as they
    are (sliced where read), anything else (lists) as a numpy array."""
    return a if hasattr(a, "shape") and hasattr(a, "dtype") else np.asarray(a)


def open_dataset(path: str) -> DatasetInfo:
    """An HDF5 dataset file with the default names (``train/x`` ...) and attributes."""
    return _open(
        DatasetInfo(path, 0, 0, {}), num_classes=0, x_scale=0.0, splits=ALL_SPLITS, required=SPLITS
    )


def open_data(
    config: DataConfig, arrays: Mapping[str, tuple[Any, Any]] | None = None
) -> DatasetInfo:
    """The dataset a job's [data] names (or ``arrays`` handed to the Python API: split ->
    (x, y)); any problem is one DataError naming the file and the array."""
    if arrays is not None:
        unknown = set(arrays) - set(ALL_SPLITS)
        if unknown or "train" not in arrays or "test" not in arrays:
            raise DataError(
                f"data arrays: give 'train' and 'test' (and optionally 'val'), "
                f"each as (x, y); got {sorted(arrays)}"
            )
        info = DatasetInfo(
            "<arrays>",
            0,
            0,
            {},
            kind="arrays",
            names={s: (f"{s}/x", f"{s}/y") for s in arrays},
            arrays=arrays,
        )
        return _open(info, config.num_classes, config.x_scale, tuple(arrays), SPLITS)
    given = {s: (getattr(config, f"{s}_x"), getattr(config, f"{s}_y")) for s in ALL_SPLITS}
    path = resolve_path(config.path, config.builtin)
    if not path and not config.train_x:
        raise DataError(
            "no data: give data.path (an HDF5 or .npz file), data.builtin "
            '("digits"), .npy files as data.train_x, data.train_y, data.test_x '
            "and data.test_y, or arrays to mpips.train(job, data=...)"
        )
    if not path:  # .npy files, one per array
        names = {s: pair for s, pair in given.items() if all(pair)}
        info = DatasetInfo(config.train_x, 0, 0, {}, kind="npy", names=names)
        return _open(info, config.num_classes, config.x_scale, tuple(names), SPLITS)
    kind = "npz" if path.endswith(".npz") else "hdf5"
    default = NPZ_NAMES if kind == "npz" else HDF5_NAMES
    names = {s: (given[s][0] or default[s][0], given[s][1] or default[s][1]) for s in ALL_SPLITS}
    info = DatasetInfo(path, 0, 0, {}, kind=kind, names=names)
    required = tuple(s for s in ALL_SPLITS if s in SPLITS or all(given[s]))
    return _open(info, config.num_classes, config.x_scale, ALL_SPLITS, required)


def _open(
    info: DatasetInfo,
    num_classes: int,
    x_scale: float,
    splits: tuple[str, ...],
    required: tuple[str, ...],
) -> DatasetInfo:
    """Check every split's arrays (present, shapes agree, numbers and integer labels) and
    work out the number of classes; ``required`` splits must be there, the others may."""
    where = _where(info)
    if info.kind in ("hdf5", "npz") and not os.path.exists(info.path):
        raise DataError(
            f"{where}: not found{_relative(info.path)} (make one with `python -m mpips data ...`)"
        )
    if info.kind in ("hdf5", "npz"):
        _refuse_raw(info.path, where)
    try:
        with _container(info) as source:
            with h5py_errors(_damaged(info)):  # (reads an HDF5 file's attributes only)
                is_csr = source.file is not None and sparse.is_sparse_file(source.file)
            if is_csr:
                with h5py_errors(_damaged(info)):  # (an HDF5 file's datasets, checked)
                    rows, num_features, max_nnz = sparse.check_csr(source.file, info.path)
                _check_rows(where, rows, {s: f"'{s}/label'" for s in rows})
                return DatasetInfo(info.path, num_features, 2, rows, sparse=True, max_nnz=max_nnz)
            rows, widths, names = _check_splits(source, info, splits, required)
            num_classes = _num_classes(source, where, num_classes, names["train"][1])
            x_scale = x_scale or float(source.attrs.get("x_scale", 1.0))
            if not 0 < x_scale < float("inf"):
                raise DataError(f"{where}: x_scale must be a positive number, got {x_scale}")
    except DataError:
        raise
    except (OSError, KeyError, ValueError, TypeError, AttributeError, MemoryError) as e:
        kind = {"hdf5": "mpips HDF5", "npz": ".npz", "npy": ".npy"}.get(info.kind, "")
        raise DataError(f"{where}: not a readable {kind} dataset ({numpy_reason(e)})") from None
    return DatasetInfo(
        info.path,
        widths["train"],
        num_classes,
        rows,
        x_scale,
        kind=info.kind,
        names=names,
        arrays=info.arrays,
    )


def _refuse_raw(path: str, where: str) -> None:
    """DataError naming the converter to run if ``path`` is a raw dataset (a folder, MNIST's
    idx files, a gzip-compressed file) rather than a data file: a user who points data.path
    at what they downloaded is told how to make one, as a missing file's message is."""
    p = Path(path)
    make = "make a data file from it once with `python -m mpips data"
    then = 'then set data.path = "OUT.h5"'
    if p.is_dir():
        try:
            names = [c.name for c in itertools.islice(p.iterdir(), LOOKED_AT)]
        except OSError:
            names = []
        if any(IDX_NAME.search(n) for n in names):
            raise DataError(
                f"{where}: a folder of idx files (MNIST's format), not a data file: "
                f"{make} fashion-mnist OUT.h5 --src {shlex.quote(path)}`, {then}"
            )
        raise DataError(
            f"{where}: a directory, not a data file (HDF5 or .npz): {make} KIND OUT.h5 "
            f"--src FILE` (`python -m mpips data --help` lists the kinds), {then}"
        )
    head = _first_bytes(p)
    if IDX_NAME.search(p.name) and head[:2] in (GZIP_MAGIC, IDX_MAGIC):
        raise DataError(
            f"{where}: an idx file (MNIST's format), not a data file: {make} fashion-mnist "
            f"OUT.h5 --src {shlex.quote(str(p.parent))}` (its folder), {then}"
        )
    if head[:2] == GZIP_MAGIC:
        raise DataError(
            f"{where}: gzip-compressed, not a data file (HDF5 or .npz): decompress it and "
            f"{make} KIND OUT.h5 --src FILE` (`python -m mpips data --help` lists the "
            f"kinds), {then}"
        )


GZIP_MAGIC, IDX_MAGIC = b"\x1f\x8b", b"\x00\x00"  # how a .gz and an idx file begin


def _first_bytes(p: Path) -> bytes:
    """The first bytes of a regular file (b"" for anything else, or one that cannot be
    read: opening a FIFO would block, and the reader says what is wrong with it)."""
    if not p.is_file():
        return b""
    try:
        with open(p, "rb") as f:
            return f.read(4)
    except OSError:
        return b""


def _check_splits(
    source: _Arrays, info: DatasetInfo, splits: tuple[str, ...], required: tuple[str, ...]
) -> tuple[dict[str, int], dict[str, int], dict[str, tuple[str, str]]]:
    """Each split's arrays present (if ``required``), rows of numbers with as many integer
    labels, all splits of one width: (rows, widths, array names) of the splits there."""
    where = _where(info)
    rows, widths, names = {}, {}, {}
    for split in splits:
        x_name, y_name = info.names[split]
        missing = [n for n in (x_name, y_name) if not source.has(n)]
        if missing:
            if split in required:
                raise DataError(
                    f"{where}: missing {_what(info, missing[0])} (the {split} split)"
                    + (_relative(missing[0]) if info.kind == "npy" else "")
                )
            continue
        x, y = source.get(x_name), source.get(y_name)
        if x.ndim < 1 or x.dtype.kind not in "biuf":
            raise DataError(
                f"{where}: {_what(info, x_name)} must be rows of numbers, got {x.ndim}-D {x.dtype}"
            )
        if y.ndim != 1 or y.dtype.kind not in "iu":
            raise DataError(
                f"{where}: {_what(info, y_name)} must be 1-D integer "
                f"labels, got {y.ndim}-D {y.dtype}"
            )
        if x.shape[0] != y.shape[0]:
            raise DataError(
                f"{where}: {_what(info, x_name)} has {x.shape[0]} rows "
                f"but {_what(info, y_name)} has {y.shape[0]}"
            )
        rows[split], names[split] = int(x.shape[0]), (x_name, y_name)
        widths[split] = math.prod(int(d) for d in x.shape[1:])
    if len(set(widths.values())) != 1:
        raise DataError(f"{where}: its splits have different widths {widths}")
    if widths["train"] == 0:
        x_name = names["train"][0]
        shape = list(source.get(x_name).shape)
        raise DataError(
            f"{where}: {_what(info, x_name)} has shape {shape}: its rows hold no inputs"
        )
    _check_rows(where, rows, {s: _what(info, names[s][0]) for s in rows})
    return rows, widths, names


def _check_rows(where: str, rows: dict[str, int], said: dict[str, str]) -> None:
    """DataError if a split has no rows: nothing to train on, or metrics of nothing."""
    for split, n in rows.items():
        if n == 0:
            raise DataError(f"{where}: the {split} split has no rows ({said[split]} is empty)")


def _num_classes(source: _Arrays, where: str, num_classes: int, train_y: str) -> int:
    """The number of classes: ``num_classes``, else the file's attribute num_classes, else
    the largest train label + 1; DataError unless in 2..MAX_CLASSES."""
    if not num_classes:
        num_classes = int(source.attrs.get("num_classes", 0)) or _count_classes(source.get(train_y))
    if not 2 <= num_classes <= MAX_CLASSES:
        raise DataError(
            f"{where}: num_classes must be in 2..{MAX_CLASSES}, got "
            f"{num_classes} (the attribute num_classes, data.num_classes, "
            f"or the largest train label + 1)"
        )
    return num_classes


def _relative(path: str) -> str:
    """Where a relative path of a job was looked for: the working directory (see job.py)."""
    return "" if os.path.isabs(path) else f" (relative to the working directory {os.getcwd()})"


def _what(info: DatasetInfo, name: str) -> str:
    return (
        f"array '{name}'"
        if info.kind in ("npz", "arrays")
        else f"file {name}"
        if info.kind == "npy"
        else f"dataset '{name}'"
    )


def _count_classes(y: Any) -> int:
    """The largest label + 1, the labels read a chunk at a time (little memory)."""
    top = -1
    for start in range(0, y.shape[0], LABEL_CHUNK):
        chunk = np.asarray(y[start : start + LABEL_CHUNK])
        top = max(top, int(chunk.max()) if chunk.size else -1)
    return max(2, top + 1)


# -- reading rows -----------------------------------------------------------------------------


def worker_rows(num_rows: int, num_parts: int, index: int) -> tuple[int, int]:
    """Contiguous, disjoint, near-equal row range ``[start, stop)`` of part ``index`` (worker
    ``index`` of ``num_parts``)."""
    base, extra = divmod(num_rows, num_parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def full_batches(num_rows: int, num_parts: int, batch_size: int) -> int:
    """Full batches every part can make (the same count on every worker: sync replicas)."""
    return min(
        (b - a) // batch_size
        for a, b in (worker_rows(num_rows, num_parts, k) for k in range(num_parts))
    )


def epoch_batches(num_rows: int, workers: int, batch_size: int) -> int:
    """Batches all async workers together make in one epoch of their parts (a part's last
    batch may be short; streamed chunks hold whole batches, so the count is the same): the
    global steps of an epoch."""
    return sum(
        -(-(b - a) // batch_size)
        for a, b in (worker_rows(num_rows, workers, k) for k in range(workers))
    )


def row_bytes(info: DatasetInfo) -> int:
    """Host memory one row takes while read. Dense: as stored (<= 8 B an input) and as
    float32; its label as stored and as int64. Sparse: at most max_nnz (id, value) pairs,
    as stored and converted (28 B a pair, as load_csr counts), plus indptr and label."""
    if info.sparse:
        return max(1, info.max_nnz) * 28 + 28
    return info.num_inputs * 12 + 16


def load_split(
    info: DatasetInfo, split: str, rows: tuple[int, int] | None = None
) -> tuple[Any, Any]:
    """Read rows of a split as float32 features (scaled) and int64 labels (sparse files:
    a CSR matrix and float32 0/1 labels)."""
    start, stop = rows or (0, info.rows[split])
    if info.sparse:
        return sparse.load_csr(info.path, split, (start, stop), info.num_inputs)
    check_fits(
        (stop - start) * row_bytes(info),
        f"{_where(info)}: {split} rows "
        f"[{start}, {stop}) (data.chunk_rows streams a worker's part instead)",
        DataError,
    )
    with _container(info) as source:
        return _read(info, source.get, split, start, stop)


def raw_range(info: DatasetInfo) -> tuple[float, float]:
    """The train inputs' (min, max) before ``x_scale``: the data file's attribute ``x_range``
    if it records one, else those of its first RANGE_ROWS train rows (read a block at a
    time, values that are not finite left out). predict compares its input with it."""
    where = _where(info)
    with _container(info) as source:
        if "x_range" in source.attrs:
            return _recorded_range(source.attrs["x_range"], where)
        x = source.get(info.names["train"][0])
        rows = min(info.rows["train"], RANGE_ROWS)
        step = max(1, SCAN_BYTES // (4 * max(1, info.num_inputs)))
        lo, hi = math.inf, -math.inf
        for start in range(0, rows, step):
            block = np.asarray(x[start : min(rows, start + step)], np.float32)
            block = block[np.isfinite(block)]
            if block.size:
                lo, hi = min(lo, float(block.min())), max(hi, float(block.max()))
    return (lo, hi) if lo <= hi else (0.0, 0.0)


def _recorded_range(value: Any, where: str) -> tuple[float, float]:
    """A data file's ``x_range`` attribute, checked: two finite numbers, min <= max."""
    a = np.asarray(value)
    if a.shape != (2,) or a.dtype.kind not in "biuf" or not np.isfinite(a).all() or a[0] > a[1]:
        raise DataError(
            f"{where}: the attribute x_range must be the train inputs' [min, max] (two "
            f"finite numbers, before x_scale), got "
            + (f"{a.tolist()!r}" if a.size <= 4 else f"{a.size} values")
        )
    return float(a[0]), float(a[1])


def _where(info: DatasetInfo) -> str:
    return "data arrays" if info.kind == "arrays" else f"data file {info.path}"


def _read(
    info: DatasetInfo, get: Callable[[str], Any], split: str, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``[start, stop)`` of a split from an open container, checked and converted."""
    x_name, y_name = info.names[split]
    try:
        x = np.asarray(get(x_name)[start:stop]).reshape(stop - start, -1).astype(np.float32)
        y = np.asarray(get(y_name)[start:stop]).astype(np.int64)
    except (OSError, KeyError, ValueError, MemoryError) as e:
        raise DataError(
            f"{_where(info)}: cannot read {split} rows [{start}, {stop}) ({e})"
        ) from None
    if info.x_scale != 1.0:
        with np.errstate(over="ignore"):  # an overflow to inf is said just below
            x *= np.float32(info.x_scale)
    scaled = f" times x_scale {info.x_scale}" if info.x_scale != 1.0 else ""
    check_finite(x, _where(info), split, start, f" ({_what(info, x_name)}{scaled})")
    bad = (y < 0) | (y >= info.num_classes)
    if bad.any():
        raise DataError(
            f"{_where(info)}: {y_name} has label {int(y[bad][0])} outside 0..{info.num_classes - 1}"
        )
    return x, y


def check_finite(x: np.ndarray, where: str, split: str, start: int = 0, detail: str = "") -> None:
    """DataError if a row of ``x`` (rows of float32 inputs, row ``start`` of ``split`` first)
    holds NaN or an infinity, naming the first such row. A NaN input makes the loss NaN,
    which would be blamed on the learning rate. One sum in the common case (~1% of the
    time reading the rows from an HDF5 file takes, the reference MLP's 60000 x 784); row by
    row only when that sum is not finite (finite values can overflow it: then nothing is wrong)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(x.sum()):
            return
    step = max(1, SCAN_BYTES // max(1, x[0].size))  # the bad rows found in bounded memory
    for lo in range(0, len(x), step):
        bad = ~np.isfinite(x[lo : lo + step])
        rows = np.flatnonzero(bad.reshape(len(bad), -1).any(axis=1))
        if rows.size:
            i = int(rows[0])
            j = int(np.flatnonzero(bad[i])[0])
            raise DataError(
                f"{where}: {split} row {start + lo + i}{detail} holds "
                f"{x[lo + i].reshape(-1)[j]} at input {j}: mpips trains on finite numbers "
                f"only (fix or drop that row)"
            )


def batches(
    x: Any,
    y: Any,
    batch_size: int,
    seed: int,
    task: int,
    epochs: int = 0,
    start_batch: int = 0,
    per_epoch: int | None = None,
    xp: Any = np,
) -> Iterator[Batch]:
    """(epoch, x, y) batches of one worker's part, reshuffled each epoch from (seed, task, epoch).

    ``epochs = 0`` repeats forever. A last short batch of an epoch is kept, unless
    ``per_epoch`` is given: then each epoch is exactly that many full batches (sync replicas
    must all make the same number of equal batches). ``start_batch`` skips that many
    batches (a restored data position) without reading them. ``xp``: the array module of
    ``x`` and ``y`` (a part on the device: each epoch's order goes there once, and the
    batches are gathered there, the same rows as on the host).
    """
    n = len(y)
    say_capped(batch_size, n, task)
    if per_epoch is None:
        per_epoch = -(-n // batch_size)
    epoch, first = divmod(start_batch, per_epoch)
    while not epochs or epoch < epochs:
        order = np.random.default_rng([seed, task, epoch]).permutation(n)
        if xp is not np:
            order = xp.asarray(order)
        for i in range(first * batch_size, min(n, per_epoch * batch_size), batch_size):
            idx = order[i : i + batch_size]
            yield epoch, x[idx], y[idx]
        epoch, first = epoch + 1, 0


def say_capped(batch_size: int, rows: int, task: int) -> None:
    """A batch larger than a worker's part is the whole part (as tf.data's batch() makes
    it), and the user is told so, once: by worker 0, whose part is as large as any."""
    if batch_size > rows and task == 0:
        log(
            f"/job:worker/task:{task}",
            f"warning: train.batch_size = {batch_size} is more than the {rows} train rows "
            f"of this worker's part: its batches hold {rows} rows (lower train.batch_size "
            f"to say what is used)",
        )


class Part(Protocol):
    """One worker's part of the train rows: its batches, epoch after epoch."""

    def batches(
        self,
        batch_size: int,
        seed: int,
        task: int,
        epochs: int = 0,
        start_batch: int = 0,
        per_epoch: int | None = None,
    ) -> Iterator[Batch]:
        """As ``batches`` above: reshuffled each epoch from (seed, task, epoch)."""


@dataclass
class InMemoryPart:
    """A part read whole into host memory (x: float32 rows or CSR, y: labels), or copied
    whole to a GPU (``xp``: their array module; see ``data.on_device``)."""

    x: Any
    y: Any
    xp: Any = np

    def batches(
        self,
        batch_size: int,
        seed: int,
        task: int,
        epochs: int = 0,
        start_batch: int = 0,
        per_epoch: int | None = None,
    ) -> Iterator[Batch]:
        return batches(
            self.x, self.y, batch_size, seed, task, epochs, start_batch, per_epoch, self.xp
        )


@dataclass
class StreamedPart:
    """A part read from the file a chunk at a time, never whole (``data.chunk_rows``).

    Each epoch visits the part's chunks in an order drawn from (seed, task, epoch) and the
    rows of each chunk in an order drawn from (seed, task, epoch, chunk): a two-level
    shuffle, since rows scattered over the file cannot be read fast. Chunks hold a whole
    number of batches, so a batch never spans two chunks; only the part's last chunk can
    end in a short batch. A background thread reads up to ``prefetch`` chunks ahead, so at
    most ``prefetch + 2`` chunks are in memory at any time.
    """

    info: DatasetInfo
    rows: tuple[int, int]
    chunk_rows: int
    prefetch: int = 2

    def batches(
        self,
        batch_size: int,
        seed: int,
        task: int,
        epochs: int = 0,
        start_batch: int = 0,
        per_epoch: int | None = None,
    ) -> Iterator[Batch]:
        start, stop = self.rows
        n, b = stop - start, batch_size
        say_capped(batch_size, n, task)
        chunk = max(b, self.chunk_rows // b * b)
        counts = [
            -(-min(chunk, n - c) // b) if per_epoch is None else min(chunk, n - c) // b
            for c in range(0, n, chunk)
        ]  # batches each chunk gives
        per_epoch = per_epoch or sum(counts)
        epoch, skip = divmod(start_batch, per_epoch)

        def plan() -> Iterator[tuple[int, int, int, int]]:
            """(epoch, chunk, first batch, end batch) to read, in order: the first batches of
            the resumed epoch are skipped without reading them."""
            nonlocal epoch, skip
            while not epochs or epoch < epochs:
                left = per_epoch
                for c in np.random.default_rng([seed, task, epoch]).permutation(len(counts)):
                    take = min(counts[c], left)
                    if skip >= take:
                        skip, left = skip - take, left - take
                    else:
                        yield epoch, int(c), skip, take
                        left, skip = left - take, 0
                    if not left:
                        break
                epoch += 1

        def read(item: tuple[int, int, int, int]) -> tuple[int, Any, np.ndarray]:
            e, c, _, _ = item
            lo = start + c * chunk
            hi = min(stop, lo + chunk)
            if self.info.sparse:
                x, y = sparse.load_csr(self.info.path, "train", (lo, hi), self.info.num_inputs)
            else:
                x, y = _read(self.info, get, "train", lo, hi)
            order = np.random.default_rng([seed, task, e, c]).permutation(len(y))
            return e, x[order], y[order]

        with _container(self.info) as source:
            get = source.get
            for item, (e, x, y) in _read_ahead(plan(), read, self.prefetch):
                _, _, first, take = item
                for i in range(first, take):
                    yield e, x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]


def _read_ahead(
    items: Iterator[Any], read: Callable[[Any], Any], depth: int
) -> Iterator[tuple[Any, Any]]:
    """(item, read(item)) for each item, read by a background thread up to ``depth`` items
    ahead of the consumer (bounded memory). A read error is raised in the consumer; closing
    the generator stops the thread."""
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()
    end = object()

    def put(value: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, read(item))):
                    return
            put(end)
        except BaseException as e:  # handed to the consumer, raised there
            put(e)

    thread = threading.Thread(target=produce, name="mpips-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            got = q.get()
            if got is end:
                return
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        stop.set()
        thread.join(timeout=5)


def train_part(
    info: DatasetInfo, rows: tuple[int, int], chunk_rows: int = 0, prefetch: int = 2
) -> Part:
    """A worker's part: streamed in chunks of ``chunk_rows`` (dense or sparse rows), else
    read whole."""
    if chunk_rows:
        check_fits(
            (prefetch + 2) * min(chunk_rows, rows[1] - rows[0]) * row_bytes(info),
            f"{_where(info)}: {prefetch + 2} chunks of {chunk_rows} rows (data.prefetch + 2)",
            DataError,
        )
        return StreamedPart(info, rows, chunk_rows, prefetch)
    return InMemoryPart(*load_split(info, "train", rows))

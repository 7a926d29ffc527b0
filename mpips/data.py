"""HDF5 input: dataset files, per-worker parts of the rows, shuffled batches, and converters.

A dataset file holds ``train/x, train/y, test/x, test/y`` (x: 2-D uint8 or float32, y: 1-D
integer labels) and attributes ``num_classes`` and ``x_scale`` (x is multiplied by it on load).
"""
from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol
from importlib import resources
from pathlib import Path

import h5py
import numpy as np

from . import sparse
from .errors import DataError
from .files import atomic_write
from .hdf5 import open_plain
from .memory import check_fits

SPLITS = ("train", "test")
MAX_CLASSES = 1 << 24  # more output units than this is a corrupt or hostile attribute


@dataclass(frozen=True)
class DatasetInfo:
    """Shape facts of a dataset file, checked once on open."""

    path: str
    num_inputs: int          # features (sparse: the id space)
    num_classes: int
    rows: dict[str, int]
    x_scale: float = 1.0
    sparse: bool = False     # CSR rows of (id, value) features (see sparse.py)
    max_nnz: int = 0         # sparse: most features in one row


def resolve_path(path: str, builtin: str) -> str:
    """The HDF5 file a job's [data] names (a path, or a dataset shipped in the package)."""
    if builtin:
        return str(resources.files("mpips.builtin").joinpath(f"{builtin}.h5"))
    return path


def open_dataset(path: str) -> DatasetInfo:
    """Check the file's layout; any problem is one DataError naming the file and the key."""
    if not os.path.exists(path):
        raise DataError(f"data file {path}: not found (make one with `python -m mpips data ...`)")
    try:
        with open_plain(path, DataError, f"data file {path}") as f:
            if sparse.is_sparse_file(f):
                rows, num_features, max_nnz = sparse.check_csr(f, path)
                if rows["train"] == 0:
                    raise DataError(f"data file {path}: 'train' has no rows")
                return DatasetInfo(path, num_features, 2, rows, sparse=True, max_nnz=max_nnz)
            rows, dims = {}, set()
            for split in SPLITS + (("val",) if "val" in f else ()):  # val: optional
                for key in ("x", "y"):
                    if f"{split}/{key}" not in f:
                        raise DataError(f"data file {path}: missing dataset '{split}/{key}'")
                x, y = f[f"{split}/x"], f[f"{split}/y"]
                if x.ndim != 2 or x.dtype not in (np.uint8, np.float32):
                    raise DataError(f"data file {path}: '{split}/x' must be 2-D uint8 or float32, "
                                    f"got {x.ndim}-D {x.dtype}")
                if y.ndim != 1 or y.dtype.kind not in "iu":
                    raise DataError(f"data file {path}: '{split}/y' must be 1-D integer labels, "
                                    f"got {y.ndim}-D {y.dtype}")
                if x.shape[0] != y.shape[0]:
                    raise DataError(f"data file {path}: '{split}/x' has {x.shape[0]} rows but "
                                    f"'{split}/y' has {y.shape[0]}")
                rows[split] = int(x.shape[0])
                dims.add(int(x.shape[1]))
            if len(dims) != 1:
                raise DataError(f"data file {path}: its splits have different widths {dims}")
            num_classes = int(f.attrs.get("num_classes", 0))
            if not 2 <= num_classes <= MAX_CLASSES:
                raise DataError(f"data file {path}: attribute num_classes must be in "
                                f"2..{MAX_CLASSES}, got {num_classes}")
            x_scale = float(f.attrs.get("x_scale", 1.0))
            if not 0 < x_scale < float("inf"):
                raise DataError(f"data file {path}: attribute x_scale must be a positive "
                                f"number, got {x_scale}")
    except DataError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise DataError(f"data file {path}: not a readable mpips HDF5 dataset ({e})") from None
    if rows["train"] == 0:
        raise DataError(f"data file {path}: 'train' has no rows")
    return DatasetInfo(path, dims.pop(), num_classes, rows, x_scale)


def worker_rows(num_rows: int, num_parts: int, index: int) -> tuple[int, int]:
    """Contiguous, disjoint, near-equal row range ``[start, stop)`` of part ``index`` (worker
    ``index`` of ``num_parts``)."""
    base, extra = divmod(num_rows, num_parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def load_split(info: DatasetInfo, split: str, rows: tuple[int, int] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """Read rows of a split as float32 features (scaled) and int64 labels (sparse files:
    a CSR matrix and float32 0/1 labels)."""
    start, stop = rows or (0, info.rows[split])
    if info.sparse:
        return sparse.load_csr(info.path, split, (start, stop), info.num_inputs)
    # per input: as stored (<= 8 B) and as float32; per label: as stored and as int64
    check_fits((stop - start) * (info.num_inputs * 12 + 16),
               f"data file {info.path}: {split} rows [{start}, {stop})", DataError)
    try:
        with open_plain(info.path, DataError, f"data file {info.path}") as f:
            x = f[f"{split}/x"][start:stop].astype(np.float32)
            y = f[f"{split}/y"][start:stop].astype(np.int64)
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"data file {info.path}: cannot read {split} rows "
                        f"[{start}, {stop}) ({e})") from None
    if info.x_scale != 1.0:
        x *= np.float32(info.x_scale)
    bad = (y < 0) | (y >= info.num_classes)
    if bad.any():
        raise DataError(f"data file {info.path}: {split}/y has label {int(y[bad][0])} outside "
                        f"0..{info.num_classes - 1}")
    return x, y


def batches(x: np.ndarray, y: np.ndarray, batch_size: int, seed: int, task: int,
            epochs: int = 0, start_batch: int = 0, per_epoch: int | None = None
            ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(epoch, x, y) batches of one worker's part, reshuffled each epoch from (seed, task, epoch).

    ``epochs = 0`` repeats forever. A last short batch of an epoch is kept, unless
    ``per_epoch`` is given: then each epoch is exactly that many full batches (sync replicas
    must all make the same number of equal batches). ``start_batch`` skips that many
    batches (a restored data position) without reading them.
    """
    n = len(y)
    if per_epoch is None:
        per_epoch = -(-n // batch_size)
    epoch, first = divmod(start_batch, per_epoch)
    while not epochs or epoch < epochs:
        order = np.random.default_rng([seed, task, epoch]).permutation(n)
        for i in range(first * batch_size, min(n, per_epoch * batch_size), batch_size):
            idx = order[i:i + batch_size]
            yield epoch, x[idx], y[idx]
        epoch, first = epoch + 1, 0


Batch = tuple[int, Any, Any]  # (epoch, x, y)


class Part(Protocol):
    """One worker's part of the train rows: its batches, epoch after epoch."""

    def batches(self, batch_size: int, seed: int, task: int, epochs: int = 0,
                start_batch: int = 0, per_epoch: int | None = None) -> Iterator[Batch]:
        """As ``batches`` below: reshuffled each epoch from (seed, task, epoch)."""


@dataclass
class InMemoryPart:
    """A part read whole into host memory (x: float32 rows or CSR, y: labels)."""

    x: Any
    y: Any

    def batches(self, batch_size: int, seed: int, task: int, epochs: int = 0,
                start_batch: int = 0, per_epoch: int | None = None) -> Iterator[Batch]:
        return batches(self.x, self.y, batch_size, seed, task, epochs, start_batch, per_epoch)


# -- writing and converting -------------------------------------------------------------------

def write_dataset(path: str | Path, train: tuple[np.ndarray, np.ndarray],
                  test: tuple[np.ndarray, np.ndarray], num_classes: int,
                  x_scale: float = 1.0, name: str = "",
                  val: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Write a dataset file durably and atomically (temporary file, fsync, rename)."""
    splits = list(zip(SPLITS, (train, test))) + ([("val", val)] if val is not None else [])

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            for split, (x, y) in splits:
                f.create_dataset(f"{split}/x", data=x, compression="gzip", compression_opts=4,
                                 chunks=(max(1, min(len(x), 1024)), x.shape[1]))
                f.create_dataset(f"{split}/y", data=y.astype(np.int64))
            f.attrs["num_classes"] = num_classes
            f.attrs["x_scale"] = x_scale
            f.attrs["name"] = name
    atomic_write(path, write)


def _read_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a .npz file: x rows of numbers (as float32), y integer labels; no pickle."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if "x" not in z.files or "y" not in z.files:
                raise DataError(f"{path}: needs arrays 'x' and 'y', has {z.files}")
            x, y = z["x"], z["y"]
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npz file ({e})") from None
    if x.dtype.kind not in "biuf" or x.ndim < 2:
        raise DataError(f"{path}: x must be rows of numbers, got {x.ndim}-D {x.dtype}")
    if y.dtype.kind not in "iu" or y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{path}: y must be {len(x)} integer labels, got {y.ndim}-D {y.dtype}")
    if len(y) and y.min() < 0:
        raise DataError(f"{path}: labels must be >= 0")
    return x.reshape(len(x), -1).astype(np.float32), y


def convert_arrays(out: str | Path, train: str, test: str | None = None,
                   val: str | None = None) -> None:
    """Your own arrays as an mpips data file: .npz files with ``x`` (each row flattened to
    float32 inputs) and ``y`` (integer labels 0..C-1). Without a test file the last 20% of
    the train rows are held out."""
    x, y = _read_arrays(train)
    if test:
        test_split = _read_arrays(test)
    else:
        cut = int(len(x) * 0.8)
        x, y, test_split = x[:cut], y[:cut], (x[cut:], y[cut:])
    val_split = _read_arrays(val) if val else None
    parts = [(x, y), test_split] + ([val_split] if val_split else [])
    if len({p[0].shape[1] for p in parts}) != 1:
        raise DataError("arrays: train, test and validation rows differ in width")
    classes = int(max(int(p[1].max(initial=0)) for p in parts)) + 1
    write_dataset(out, (x, y), test_split, max(2, classes), name=Path(train).stem,
                  val=val_split)


def _read_idx(path: Path) -> np.ndarray:
    """Read an idx file (the MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
        if zero != 0 or dtype != 0x08:
            raise DataError(f"{path}: not an unsigned-byte idx file")
        shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
        data = np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim)
        return data.reshape(shape)
    except (OSError, EOFError, struct.error, ValueError) as e:
        raise DataError(f"{path}: cannot read idx data ({e})") from None


FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def convert_fashion_mnist(out: str | Path, src: str | Path = FASHION_MNIST_DIR) -> None:
    """Debian's dataset-fashion-mnist idx files -> one HDF5 dataset (uint8, scale 1/255)."""
    src = Path(src)
    names = {"train": "train", "test": "t10k"}
    parts = {}
    for split, prefix in names.items():
        found = {}
        for kind, stem in (("x", "images-idx3-ubyte"), ("y", "labels-idx1-ubyte")):
            cands = [src / f"{prefix}-{stem}.gz", src / f"{prefix}-{stem}"]
            hit = next((c for c in cands if c.exists()), None)
            if hit is None:
                raise DataError(f"{cands[0]}: not found (apt-get install dataset-fashion-mnist)")
            found[kind] = _read_idx(hit)
        x = found["x"].reshape(len(found["x"]), -1)
        parts[split] = (x, found["y"].astype(np.int64))
    write_dataset(out, parts["train"], parts["test"], 10, 1 / 255, "fashion-mnist")


def convert_digits(out: str | Path) -> None:
    """The 1797 8x8 digits that ship inside mpips (scikit-learn's set: 1437 train / 360 test,
    uint8, scale 1/16), copied to ``out`` as a dataset file of its own."""
    src = Path(resolve_path("", "digits"))
    atomic_write(out, lambda tmp: tmp.write_bytes(src.read_bytes()))


def make_synthetic(out: str | Path, rows: int = 60000, test_rows: int = 10000,
                   inputs: int = 784, classes: int = 10) -> None:
    """The reference workload of the benchmarks: X ~ N(0,1) (numpy seed 0), labels
    argmax(X @ W) with W ~ N(0,1) (seed 1), 784 inputs and 10 classes by default."""
    x = np.random.default_rng(0).standard_normal((rows + test_rows, inputs), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal((inputs, classes), dtype=np.float32)
    y = (x @ w).argmax(axis=1)
    write_dataset(out, (x[:rows], y[:rows]), (x[rows:], y[rows:]), classes, 1.0, "synthetic")

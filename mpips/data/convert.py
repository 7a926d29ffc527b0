"""Dense dataset files: writing them, and converting other formats into them once.

A dataset file holds ``train/x, train/y, test/x, test/y`` (and optionally ``val/x, val/y``;
x: rows of numbers, y: 1-D integer labels) and the attributes ``num_classes``, ``x_scale``
(x is multiplied by it on load) and ``x_range`` (the train inputs' [min, max] before
``x_scale``, which predict compares its input with). Sparse CTR files are made by sparse.py.
"""

from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import h5py
import numpy as np

from ..errors import DataError
from ..process.files import atomic_write, check_regular
from ..process.memory import ABSURD_BYTES, check_fits, human
from .batches import SPLITS, check_finite, npz_member, numpy_errors, open_npz, resolve_path
from .hdf5 import fixed_text

# what a failure to write a converted file (a read-only folder, a full disk) means: one line
# (WriteFailed, exit 1), as `ckpt export` and `predict` say theirs
NOT_WRITTEN = "no dataset written"


def write_dataset(
    path: str | Path,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    num_classes: int,
    x_scale: float = 1.0,
    name: str = "",
    val: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """Write a dataset file durably and atomically (temporary file, fsync, rename), with the
    train inputs' range as ``x_range`` (none for a train split without finite values)."""
    splits = list(zip(SPLITS, (train, test), strict=True)) + (
        [("val", val)] if val is not None else []
    )

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            for split, (x, y) in splits:
                # gzip needs chunks, and a chunk at most the data's shape: none for no rows
                packed = {"compression": "gzip", "compression_opts": 4}
                chunks = {"chunks": (min(len(x), 1024), x.shape[1]), **packed} if x.size else {}
                f.create_dataset(f"{split}/x", data=x, **chunks)
                f.create_dataset(f"{split}/y", data=y.astype(np.int64))
            f.attrs["num_classes"] = num_classes
            f.attrs["x_scale"] = x_scale
            f.attrs["name"] = fixed_text(name)
            record_range(f, train[0])

    atomic_write(path, write, NOT_WRITTEN)


def record_range(f: h5py.File, x: np.ndarray) -> None:
    """Record the train inputs ``x``'s range as the attribute ``x_range`` of ``f`` (float64
    [min, max], raw units), so predict need not read train rows for it."""
    x_range = finite_range(x)
    if x_range is not None:
        f.attrs["x_range"] = np.array(x_range, np.float64)


def finite_range(x: np.ndarray) -> tuple[float, float] | None:
    """(min, max) of the finite values of ``x`` (raw units: before any x_scale), as predict's
    scan of a file without ``x_range`` counts them; None if it has none (no rows)."""
    if not x.size:
        return None
    lo, hi = float(x.min()), float(x.max())
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    finite = x[np.isfinite(x)]  # (only data that training refuses anyway pays for this copy)
    return (float(finite.min()), float(finite.max())) if finite.size else None


def _read_arrays(path: str) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of a .npz file: x rows of finite numbers (as float32), y integer labels; no
    pickle."""
    with open_npz(path, path) as z:
        if "x" not in z.files or "y" not in z.files:
            raise DataError(f"{path}: needs arrays 'x' and 'y', has {z.files}")
        with numpy_errors(path, ".npz file"):
            x, y = npz_member(z, "x"), npz_member(z, "y")
    if x.dtype.kind not in "biuf" or x.ndim < 2:
        raise DataError(f"{path}: x must be rows of numbers, got {x.ndim}-D {x.dtype}")
    if 0 in x.shape[1:]:
        raise DataError(f"{path}: x has shape {list(x.shape)}: its rows hold no inputs")
    if not len(x):
        raise DataError(f"{path}: x has no rows")
    if y.dtype.kind not in "iu" or y.ndim != 1 or len(y) != len(x):
        raise DataError(f"{path}: y must be {len(x)} integer labels, got {y.ndim}-D {y.dtype}")
    if len(y) and y.min() < 0:
        raise DataError(f"{path}: labels must be >= 0")
    x = x.reshape(len(x), -1).astype(np.float32)
    check_finite(x, path, "x")
    return x, y


def convert_arrays(
    out: str | Path, train: str, test: str | None = None, val: str | None = None
) -> None:
    """Your own arrays as an mpips data file: .npz files with ``x`` (each row flattened to
    float32 inputs) and ``y`` (integer labels 0..C-1). Without a test file the last 20% of
    the train rows are held out."""
    x, y = _read_arrays(train)
    if test:
        test_split = _read_arrays(test)
    else:
        cut = int(len(x) * 0.8)
        x, y, test_split = x[:cut], y[:cut], (x[cut:], y[cut:])
    if not len(x) or not len(test_split[0]):
        raise DataError(
            f"{train}: {len(y) + len(test_split[1])} row(s) are too few to hold out 20% "
            f"as the test split and train on the rest (give a test file: --test-src)"
        )
    val_split = _read_arrays(val) if val else None
    parts = [(x, y), test_split] + ([val_split] if val_split else [])
    if len({p[0].shape[1] for p in parts}) != 1:
        raise DataError("arrays: train, test and validation rows differ in width")
    classes = int(max(int(p[1].max(initial=0)) for p in parts)) + 1
    write_dataset(out, (x, y), test_split, max(2, classes), name=Path(train).stem, val=val_split)


def _read_idx(path: Path) -> np.ndarray:
    """Read an idx file (the MNIST format), gzipped or not."""
    check_regular(path, DataError, str(path))
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
        zero, dtype, ndim = struct.unpack(">HBB", raw[:4])
        if zero != 0 or dtype != 0x08:
            raise DataError(f"{path}: not an unsigned-byte idx file")
        shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
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
    uint8, scale 1/16), copied to ``out`` as a dataset file of its own, with their ``x_range``
    as write_dataset records it."""
    raw = Path(resolve_path("", "digits")).read_bytes()  # (first: a failure below is the write's)

    def write(tmp: Path) -> None:
        tmp.write_bytes(raw)
        with h5py.File(tmp, "r+") as f:
            record_range(f, np.asarray(f["train/x"]))

    atomic_write(out, write, NOT_WRITTEN)


def make_synthetic(
    out: str | Path, rows: int = 60000, test_rows: int = 10000, inputs: int = 784, classes: int = 10
) -> None:
    """The reference workload of the benchmarks: X ~ N(0,1) (numpy seed 0), labels
    argmax(X @ W) with W ~ N(0,1) (seed 1), 784 inputs and 10 classes by default. DataError
    if ``rows`` is not positive or the rows do not fit in memory."""
    if rows < 1:
        raise DataError(f"synthetic: rows must be at least 1, got {rows}")
    total = rows + test_rows
    # x, x @ W, the labels and their int64 copy (write_dataset) are in memory at once
    need = total * (inputs * 4 + classes * 4 + 16)
    what = f"synthetic: the data of {rows} + {test_rows} rows"
    if need > ABSURD_BYTES:  # (check_fits would blame a file)
        raise DataError(f"{what} needs {human(need)}, more than any machine's memory")
    check_fits(need, what, DataError)
    x = np.random.default_rng(0).standard_normal((total, inputs), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal((inputs, classes), dtype=np.float32)
    y = (x @ w).argmax(axis=1)
    write_dataset(out, (x[:rows], y[:rows]), (x[rows:], y[rows:]), classes, 1.0, "synthetic")

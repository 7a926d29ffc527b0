"""Sparse (CTR) input: CSR rows of (id, value) features with 0/1 labels, in HDF5.

A sparse dataset file holds, for each split ``train`` and ``test``:
``label`` (int8, one per row), ``indptr`` (int64, rows + 1), ``ids`` (int64) and ``values``
(float32); row i's features are ``ids[indptr[i]:indptr[i+1]]`` with their ``values``. File
attributes: ``format = "mpips-csr-1"``, ``num_features`` (ids are below it), ``max_nnz``
(most features in one row) and ``num_classes = 2``.

Files are written in chunks (``write_csr_chunks``), so converters (ctr_convert.py) hold one
chunk of rows at a time; ``load_csr`` reads any range of rows, so a worker can stream its
part the same way.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import numpy as np

from ..errors import DataError
from ..process.files import atomic_write
from ..process.memory import ABSURD_BYTES, check_fits
from .hdf5 import fixed_text, h5py_errors, open_plain, plain_attrs

FORMAT = "mpips-csr-1"
KEYS = {"label": "iu", "indptr": "iu", "ids": "iu", "values": "f"}

if TYPE_CHECKING:  # (scipy.sparse is imported where a matrix is made: not at start-up)
    import scipy.sparse as sp

Split = tuple["sp.csr_matrix", np.ndarray]


def is_sparse_file(f: h5py.File) -> bool:
    return plain_attrs(f).get("format") == FORMAT


def check_csr(f: h5py.File, path: str) -> tuple[dict[str, int], int, int]:
    """(rows per split, num_features, max_nnz) of an open sparse file; DataError if malformed.

    The declared sizes are checked against each other before anything is allocated: array
    lengths, ``indptr`` (starts at 0, never decreases, ends at the number of ids) and
    ``max_nnz`` (exactly the longest row, found by reading ``indptr`` in chunks).
    """
    rows, longest = {}, 0
    for split in ("train", "test"):
        for key, kinds in KEYS.items():
            ds = f.get(f"{split}/{key}")
            if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype.kind not in kinds:
                raise DataError(
                    f"data file {path}: '{split}/{key}' must be a 1-D "
                    f"{'float' if kinds == 'f' else 'integer'} array"
                )
        n, nnz = f[f"{split}/label"].shape[0], f[f"{split}/ids"].shape[0]
        indptr = f[f"{split}/indptr"]
        if (
            indptr.shape[0] != n + 1
            or f[f"{split}/values"].shape[0] != nnz
            or (n and (indptr[0] != 0 or indptr[-1] != nnz))
        ):
            raise DataError(
                f"data file {path}: '{split}' rows, indptr, ids and values do not "
                f"agree ({n} labels, {indptr.shape[0]} row pointers, {nnz} ids)"
            )
        longest = max(longest, _longest_row(indptr, f"data file {path}: {split}/indptr"))
        rows[split] = int(n)
    attrs = plain_attrs(f)
    num_features = int(attrs.get("num_features", 0))
    if not 1 <= num_features <= ABSURD_BYTES // 4:
        raise DataError(
            f"data file {path}: attribute num_features must be a positive id "
            f"count, got {num_features}"
        )
    if "max_nnz" not in attrs:
        raise DataError(
            f"data file {path}: attribute max_nnz is missing (the longest row "
            f"has {longest} features; it sizes the PS inboxes)"
        )
    max_nnz = int(attrs["max_nnz"])
    if max_nnz != longest:
        raise DataError(
            f"data file {path}: attribute max_nnz = {max_nnz}, but the longest "
            f"row has {longest} features (it sizes the PS inboxes)"
        )
    return rows, num_features, max_nnz


CHUNK_ROWS = 1 << 20


def _longest_row(indptr: h5py.Dataset, what: str) -> int:
    """The most entries in one row; DataError if ``indptr`` ever decreases. Read in chunks
    of CHUNK_ROWS, so the check needs little memory whatever the file's size."""
    longest, previous = 0, None
    for start in range(0, indptr.shape[0], CHUNK_ROWS):
        chunk = indptr[start : start + CHUNK_ROWS + 1].astype(np.int64)
        steps = np.diff(chunk)
        if (steps.size and steps.min() < 0) or (previous is not None and chunk[0] < previous):
            raise DataError(f"{what} decreases (rows would have negative lengths)")
        longest = max(longest, int(steps.max(initial=0)))
        previous = int(chunk[-1])
    return longest


def load_csr(path: str, split: str, rows: tuple[int, int], num_features: int) -> Split:
    """Rows ``[start, stop)`` of a split as a CSR matrix (num_features columns) and labels."""
    start, stop = rows

    def damaged(why: str) -> DataError:
        return DataError(f"data file {path}: cannot read {split} rows [{start}, {stop}) ({why})")

    try:
        with open_plain(path, DataError, f"data file {path}", damaged) as f, h5py_errors(damaged):
            indptr = f[f"{split}/indptr"][start : stop + 1].astype(np.int64)
            lo, hi = int(indptr[0]), int(indptr[-1])
            # as stored (<= 8 B each) and converted: ids to int64, values and labels to
            # float32, indptr to int64
            check_fits(
                (hi - lo) * 28 + (stop - start) * 28,
                f"data file {path}: {split} rows [{start}, {stop})",
                DataError,
            )
            ids = f[f"{split}/ids"][lo:hi].astype(np.int64)
            values = f[f"{split}/values"][lo:hi].astype(np.float32)
            labels = f[f"{split}/label"][start:stop].astype(np.float32)
    except DataError:
        raise
    except (OSError, KeyError, ValueError) as e:
        raise DataError(
            f"data file {path}: cannot read {split} rows [{start}, {stop}) ({e})"
        ) from None
    indptr -= lo
    if np.any(np.diff(indptr) < 0):
        raise DataError(f"data file {path}: {split}/indptr decreases")
    if ids.size and (ids.min() < 0 or ids.max() >= num_features):
        bad = ids[(ids < 0) | (ids >= num_features)][0]
        raise DataError(
            f"data file {path}: {split} has feature id {bad} outside 0..{num_features - 1}"
        )
    if not np.isin(labels, (0.0, 1.0)).all():
        raise DataError(f"data file {path}: {split}/label must be 0 or 1")
    with np.errstate(over="ignore", invalid="ignore"):
        finite = bool(np.isfinite(values.sum()))  # one sum; where, only if it is not finite
    if not finite and not np.isfinite(values).all():
        k = int(np.flatnonzero(~np.isfinite(values))[0])
        row = start + int(np.searchsorted(indptr, k, side="right")) - 1
        raise DataError(
            f"data file {path}: {split} row {row} holds {values[k]} for feature id {ids[k]}: "
            f"mpips trains on finite numbers only (fix or drop that row)"
        )
    import scipy.sparse as sp

    x = sp.csr_matrix((values, ids, indptr), shape=(stop - start, num_features))
    return x, labels


def write_csr(
    path: str | Path, train: Split, test: Split, num_features: int, name: str = ""
) -> None:
    """Write a sparse dataset file durably and atomically (temporary file, fsync, rename)."""
    write_csr_chunks(path, [("train", *train), ("test", *test)], num_features, name)


ROWS_PER_CHUNK = 8192  # rows a streaming converter holds at a time (~10 MB parsed)


def write_csr_chunks(
    path: str | Path,
    chunks: Iterable[tuple[str, sp.csr_matrix, np.ndarray]],
    num_features: int | None,
    name: str = "",
) -> None:
    """Write a sparse dataset file from (split, rows, labels) chunks, appended in order, so
    memory holds one chunk at a time, whatever the file's size. Duplicate ids of a row are
    summed. ``num_features`` None: the largest id + 1. Durable and atomic: a failure (a bad
    line in a converter's input) leaves no file, and an existing one untouched."""

    import scipy.sparse as sp

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            rows = {"train": 0, "test": 0}
            nnz = {"train": 0, "test": 0}
            for split in rows:
                for key, dtype in (("label", np.int8), ("ids", np.int64), ("values", np.float32)):
                    f.create_dataset(
                        f"{split}/{key}", (0,), dtype, maxshape=(None,), chunks=(1 << 16,)
                    )
                f.create_dataset(
                    f"{split}/indptr",
                    data=np.zeros(1, np.int64),
                    maxshape=(None,),
                    chunks=(1 << 16,),
                )
            max_nnz, top = 0, -1
            for split, x, y in chunks:
                x = sp.csr_matrix(x)
                x.sum_duplicates()  # also sorts each row's ids
                n, k = x.shape[0], x.nnz
                _append(f[f"{split}/label"], rows[split], np.asarray(y, np.int8))
                _append(f[f"{split}/indptr"], rows[split] + 1, x.indptr[1:] + nnz[split])
                _append(f[f"{split}/ids"], nnz[split], x.indices.astype(np.int64))
                _append(f[f"{split}/values"], nnz[split], x.data.astype(np.float32))
                rows[split] += n
                nnz[split] += k
                max_nnz = max(max_nnz, int(np.diff(x.indptr).max(initial=0)))
                top = max(top, int(x.indices.max(initial=-1)))
            if not rows["train"]:
                raise DataError(f"{name or path}: no train rows")
            if not rows["test"]:  # (evaluation would have nothing to measure)
                raise DataError(
                    f"{name or path}: no test rows (too few rows to hold any out): give more "
                    "rows, or a test file"
                )
            f.attrs.update(
                format=fixed_text(FORMAT),
                num_features=num_features or max(top + 1, 1),
                num_classes=2,
                name=fixed_text(name),
                max_nnz=max_nnz,
            )

    atomic_write(path, write)


def _append(ds: h5py.Dataset, at: int, values: np.ndarray) -> None:
    """Write ``values`` at ``at`` of a resizable dataset, growing it."""
    ds.resize((at + len(values),))
    ds[at:] = values

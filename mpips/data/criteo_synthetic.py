"""Synthetic Criteo-format click data for DLRM-style models (``data criteo-synthetic``).

Each row has Criteo's 39 features: 13 integers (counts drawn log-normal, rounded up, so
every one is >= 1) and 26 categoricals, feature f's values drawn Zipf-like over its
cardinality: the published Criteo Kaggle cardinalities, each capped at ``max_cardinality``.
Labels come from a planted model a DLRM can represent: a bias, a linear term in the log
integers, a weight per category, and the pairwise dot products of a small vector per
category (DLRM's feature interaction), so a learned model's AUC has a known ceiling.

Layout in the sparse file format (sparse.py), one id space with per-feature offsets, so the
existing CSR machinery stores it unchanged: id j < 13 is integer feature j with value
log(1 + x); categorical f's value c is id ``13 + offset[f] + c`` with value 1, where
``offset`` is the running sum of the capped cardinalities. Every row has all 39 features,
and ids ascend with the feature, so a row's entries are in feature order: a model reads
integers and categoricals by position (jobs/torch_dlrm.py).

Deterministic: the planted model comes from ``seed``, each chunk of rows from (seed, chunk).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from ..errors import DataError
from ..process.memory import check_disk, check_fits
from .ctr_convert import CRITEO_CATEGORIES, CRITEO_INTEGERS, _write
from .sparse import ROWS_PER_CHUNK

# The Criteo Kaggle (Display Advertising Challenge) categorical cardinalities, C1..C26, as
# published with DLRM's and TorchRec's Kaggle preprocessing (33,762,577 in all).
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
FEATURES = CRITEO_INTEGERS + CRITEO_CATEGORIES  # 39 per row
LEAST_ROWS = 10  # rows // 10 test rows are added: fewer would leave none
ZIPF_A = 1.2  # as make_zipf: a few values everywhere, most rare
PLANT_DIM = 4  # the planted interaction vectors' length
BIAS = -1.5  # about a fifth of the rows are clicks (Criteo Kaggle's: 26%)
SIGNAL = (0.6, 2.0, 1.5)  # the std of the logit's integer, category and pairwise terms


def cardinalities(max_cardinality: int) -> np.ndarray:
    """The 26 categorical features' cardinalities, each capped at ``max_cardinality``."""
    return np.minimum(np.array(CRITEO_KAGGLE_CARDINALITIES, np.int64), max_cardinality)


def id_offsets(max_cardinality: int) -> np.ndarray:
    """Where each categorical feature's ids start (13 integer ids come first)."""
    card = cardinalities(max_cardinality)
    return CRITEO_INTEGERS + np.concatenate([[0], np.cumsum(card)[:-1]])


class Planted:
    """The planted model: log-normal parameters of the integers, their linear weights, and
    per category a weight and a PLANT_DIM-vector (flat over the id space, as the file's)."""

    def __init__(self, max_cardinality: int, seed: int):
        rng = np.random.default_rng([seed, 1 << 20])
        self.card = cardinalities(max_cardinality)
        self.offsets = id_offsets(max_cardinality)
        self.num_ids = int(CRITEO_INTEGERS + self.card.sum())
        self.mu = rng.uniform(0.0, 3.0, CRITEO_INTEGERS)
        self.sigma = rng.uniform(0.5, 1.5, CRITEO_INTEGERS)
        self.dense = rng.normal(0.0, SIGNAL[0] / np.sqrt(CRITEO_INTEGERS), CRITEO_INTEGERS)
        n = self.num_ids - CRITEO_INTEGERS
        self.weight = rng.normal(0.0, SIGNAL[1] / np.sqrt(CRITEO_CATEGORIES), n).astype(np.float32)
        pairs = CRITEO_CATEGORIES * (CRITEO_CATEGORIES - 1) // 2
        scale = SIGNAL[2] ** 0.5 * (pairs * PLANT_DIM) ** -0.25  # the pairwise sum's std
        self.vector = rng.normal(0.0, scale, (n, PLANT_DIM)).astype(np.float32)

    def rows(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """n x 39 ids, n x 39 values and n labels drawn from the planted model."""
        x = np.ceil(rng.lognormal(self.mu, self.sigma, (n, CRITEO_INTEGERS)))
        dense = np.log1p(x)
        cats = (rng.zipf(ZIPF_A, (n, CRITEO_CATEGORIES)) - 1) % self.card + self.offsets
        flat = cats - CRITEO_INTEGERS
        u = self.vector[flat]  # n x 26 x PLANT_DIM
        pairwise = 0.5 * ((u.sum(1) ** 2).sum(1) - (u**2).sum((1, 2)))
        logit = BIAS + ((dense - self.mu) / self.sigma) @ self.dense
        logit += self.weight[flat].sum(1) + pairwise
        labels = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.int8)
        ids = np.concatenate(
            [np.broadcast_to(np.arange(CRITEO_INTEGERS), (n, CRITEO_INTEGERS)), cats], 1
        )
        values = np.concatenate([dense, np.ones((n, CRITEO_CATEGORIES))], 1)
        return ids, values.astype(np.float32), labels


def _check(rows: int, max_cardinality: int, seed: int) -> None:
    if rows < LEAST_ROWS:
        raise DataError(
            f"--rows {rows}: criteo-synthetic needs at least {LEAST_ROWS} train rows "
            "(a tenth of them are its test rows)"
        )
    if max_cardinality < 1:
        raise DataError(f"--max-cardinality {max_cardinality}: must be at least 1")
    if seed < 0:
        raise DataError(f"--seed {seed}: must be 0 or more")


def make_criteo_synthetic(
    out: str | Path, rows: int = 100_000, max_cardinality: int = 100_000, seed: int = 0
) -> None:
    """Write ``rows`` train rows, then rows // 10 test rows, of synthetic Criteo data (the
    module docstring's layout), a chunk of ROWS_PER_CHUNK rows at a time."""
    _check(rows, max_cardinality, seed)
    total = rows + rows // 10
    check_disk(total * (FEATURES * 12 + 9), out, f"criteo-synthetic: {total} rows", DataError)
    ids = int(CRITEO_INTEGERS + cardinalities(max_cardinality).sum())
    # the planted model: a weight and a PLANT_DIM-vector per id, drawn in float64
    check_fits(ids * (1 + PLANT_DIM) * 12, "criteo-synthetic's planted model", DataError)
    planted = Planted(max_cardinality, seed)

    def chunks() -> Iterator[tuple[str, Any, Any]]:
        for c, lo in enumerate(range(0, total, ROWS_PER_CHUNK)):
            n = min(ROWS_PER_CHUNK, total - lo)
            ids, values, labels = planted.rows(n, np.random.default_rng([seed, c]))
            indptr = np.arange(0, n * FEATURES + 1, FEATURES)
            x = sp.csr_matrix(
                (values.ravel(), ids.ravel(), indptr),
                shape=(n, planted.num_ids),
            )
            cut = max(0, min(n, rows - lo))  # rows before ``rows`` are train rows
            yield "train", x[:cut], labels[:cut]
            yield "test", x[cut:], labels[cut:]

    _write(out, chunks(), planted.num_ids, f"criteo-synthetic-{max_cardinality}")

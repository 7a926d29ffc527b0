"""Click-through-rate models on sparse (id, value) features: logistic regression and
wide-and-deep, with tables (one row per feature id) that the PS tasks hold split by rows.

A batch touches few rows. ``prepare`` finds the batch's unique ids and renumbers its CSR
columns to them; the training loop pulls just those rows of each table, and the gradient of
each table comes out per unique id (duplicates summed by the sparse product), ready to push.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.sparse as sp

from ..device.arrays import SparseBatch, to_host
from ..layers import DenseStack, log_loss
from .contract import Model
from .metrics import auc
from .variables import VariableSpec

WIDE, EMBEDDING = "wide/weights", "deep/embedding"


def init_rows(seed: int, rows: tuple[int, int, int], width: int, scale: float) -> np.ndarray:
    """Uniform(-scale, scale) rows ``range(*rows)`` of a table, a function of (seed, row id,
    column) only: the same values whatever the partition (a SplitMix64 hash)."""
    return uniform_rows(seed, np.arange(*rows, dtype=np.uint64), width, scale)


def uniform_rows(seed: int, ids: np.ndarray, width: int, scale: float) -> np.ndarray:
    """Uniform(-scale, scale) rows for row ``ids`` (any values below 2^63), a function of
    (seed, id, column) only: a fixed table's row ``i`` and a dynamic table's id ``i`` start
    the same."""
    r = np.asarray(
        ids.astype(np.uint64)[:, None] * np.uint64(width) + np.arange(width, dtype=np.uint64),
        np.uint64,
    )
    with np.errstate(over="ignore"):
        z = r + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return ((2 * u - 1) * scale).astype(np.float32)


def _times(x: Any, w: Any) -> Any:
    """``x @ w``: a CSR batch in host memory (scipy), or on the device (SparseBatch)."""
    return x.times(w) if isinstance(x, SparseBatch) else np.asarray(x @ w)


def _transposed(x: Any) -> Any:
    """What ``_back`` takes: the host batch transposed once (CSR), the device batch as it is."""
    return x if isinstance(x, SparseBatch) else x.T.tocsr()


def _back(xt: Any, d: Any) -> Any:
    """``x.T @ d`` from ``_transposed(x)``: a gradient per unique id of the batch."""
    return xt.transposed_times(d) if isinstance(xt, SparseBatch) else np.asarray(xt @ d)


class WideDeep(Model):
    """logit = x . w + b (wide) + MLP(x E) (deep: each example's embedding rows summed,
    weighted by its feature values). ``hidden = None`` is plain logistic regression."""

    def __init__(
        self,
        num_features: int,
        hidden: list[int] | None = None,
        embedding_dim: int = 8,
        xp: Any = np,
    ):
        self.xp = xp  # on a GPU the batches come as SparseBatch (backend.Device.to_device)
        self.num_features = num_features
        self.hidden = hidden
        self.dim = embedding_dim
        self.sizes = [embedding_dim, *(hidden or []), 1] if hidden is not None else []
        self.deep = DenseStack(self.sizes, "deep/dense_", xp) if hidden is not None else None

    def tables(self) -> list[VariableSpec]:
        out = [VariableSpec(WIDE, (self.num_features, 1))]
        if self.hidden is not None:
            out.append(VariableSpec(EMBEDDING, (self.num_features, self.dim)))
        return out

    def variables(self) -> list[VariableSpec]:
        return [VariableSpec("wide/bias", (1,))] + (self.deep.variables() if self.deep else [])

    def initial_values(self, seed: int) -> dict[str, np.ndarray]:
        out = {"wide/bias": np.zeros(1, np.float32)}
        if self.deep:
            out.update(self.deep.initial_values(np.random.default_rng(seed)))
        return out

    def initial_rows(self, table: str, rows: tuple[int, int, int], seed: int) -> np.ndarray:
        """Wide weights start at zero, embeddings small and random."""
        if table == WIDE:
            return np.zeros((len(range(*rows)), 1), np.float32)
        return init_rows(seed, rows, self.dim, 0.05)

    def initial_rows_of(self, table: str, ids: np.ndarray, seed: int) -> np.ndarray:
        """A dynamic table's rows: those of the same ids in a fixed table."""
        if table == WIDE:
            return np.zeros((len(ids), 1), np.float32)
        return uniform_rows(seed, ids, self.dim, 0.05)

    @staticmethod
    def prepare(x: sp.csr_matrix) -> tuple[sp.csr_matrix, np.ndarray]:
        """(the batch with columns renumbered to its unique ids, the sorted unique ids)."""
        ids, local = np.unique(x.indices, return_inverse=True)
        return sp.csr_matrix((x.data, local.ravel(), x.indptr), shape=(x.shape[0], len(ids))), ids

    def _forward(self, params: dict[str, Any], x: sp.csr_matrix) -> tuple[np.ndarray, list]:
        z = _times(x, params[WIDE])[:, 0] + params["wide/bias"][0]
        acts: list[np.ndarray] = []
        if self.deep:
            h, acts = self.deep.forward(params, _times(x, params[EMBEDDING]))
            z = z + h[:, 0]
        return z, acts

    def loss_and_grads(
        self,
        params: dict[str, Any],
        x: sp.csr_matrix,
        y: np.ndarray,
        grads: dict[str, Any],
        ready: Any = None,
    ) -> float:
        """Mean log loss of the batch; gradients into ``grads`` in place (table gradients per
        unique id of the batch, in ``prepare``'s order)."""
        z, acts = self._forward(params, x)
        loss, p = log_loss(self.xp, z, y)
        d = ((p - y) / len(y)).astype(np.float32)
        xt = _transposed(x)
        grads[WIDE][...] = _back(xt, d[:, None])
        grads["wide/bias"][...] = d.sum()
        if self.deep:
            dh = self.deep.backward(params, acts, d[:, None], grads, input_grad=True)
            grads[EMBEDDING][...] = _back(xt, dh)
        return loss

    def evaluate(self, params: dict[str, Any], x: sp.csr_matrix, y: np.ndarray) -> dict[str, float]:
        """Log loss, accuracy (threshold 0.5) and AUC."""
        z, _ = self._forward(params, x)
        loss, p = log_loss(self.xp, z, y)
        p, y = to_host(p), to_host(y)  # (AUC ranks on the host)
        return {"loss": loss, "accuracy": float(np.mean((p > 0.5) == (y > 0.5))), "auc": auc(y, p)}

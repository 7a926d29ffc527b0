"""Array helpers a model calls, whatever its array module (numpy, cupy, the stand-in): sparse
batches (issparse, SparseBatch), scatter_add, array_module, to_host."""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

from . import standin


def issparse(a: Any) -> bool:
    """A scipy sparse matrix (CSR rows). scipy.sparse is imported by the code that makes one
    (sparse data, the CTR models), not at start-up (~0.2 s of CPU a process): if it is not
    loaded, nothing is sparse."""
    sp = sys.modules.get("scipy.sparse")
    return sp is not None and sp.issparse(a)


class SparseBatch:
    """A CSR batch on the device as its nonzeros (value, column, row), and the two products
    a sparse model takes with it: gathers and scatter-adds (on the stand-in in the nonzeros'
    order, scipy's; on a GPU atomic adds, in any order). cupy's own sparse matrices have no strict
    stand-in, and these two are all an embedding lookup and its gradient need."""

    def __init__(self, xp: ModuleType, a: Any):
        import scipy.sparse as sp

        a = sp.csr_matrix(a)
        self.xp, self.shape = xp, a.shape
        self.values = xp.asarray(np.asarray(a.data, np.float32))
        self.cols = xp.asarray(a.indices.astype(np.int64))
        self.rows = xp.asarray(np.repeat(np.arange(a.shape[0], dtype=np.int64), np.diff(a.indptr)))

    def times(self, w: Any) -> Any:
        """``batch @ w`` for a (columns, d) device array: each row's weighted sum of rows."""
        out = self.xp.zeros((self.shape[0], w.shape[1]), w.dtype)
        scatter_add(self.xp, out, self.rows, w[self.cols] * self.values[:, None])
        return out

    def transposed_times(self, d: Any) -> Any:
        """``batch.T @ d`` for a (rows, k) device array: the gradient of ``times``' ``w``,
        per column, repeated columns summed."""
        out = self.xp.zeros((self.shape[1], d.shape[1]), d.dtype)
        scatter_add(self.xp, out, self.cols, d[self.rows] * self.values[:, None])
        return out


def scatter_add(xp: ModuleType, target: Any, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices summed: ``np.add.at`` on the CPU,
    ``cupyx.scatter_add`` for any other array module (cupy)."""
    if xp is np:
        np.add.at(target, index, values)
    elif xp is standin:
        standin.scatter_add(target, index, values)
    else:
        import cupyx

        cupyx.scatter_add(target, index, values)


def array_module(a: Any) -> ModuleType:
    """numpy for a numpy array, else the array's own module (cupy, or the stand-in)."""
    if isinstance(a, np.ndarray):
        return np
    return standin if isinstance(a, standin.ndarray) else __import__("cupy").get_array_module(a)


def to_host(a: Any) -> np.ndarray:
    """A device array's values in host memory (a numpy array as it is)."""
    return a if isinstance(a, np.ndarray) else a.get()

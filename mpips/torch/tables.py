"""A torch module's sparse embeddings as mpips tables: split by rows over the PS tasks, only
the rows a batch touches pulled and pushed.

``nn.Embedding`` and ``nn.EmbeddingBag`` made with ``sparse=True`` say "few rows a step", so
they become tables (what ``Model.tables()`` declares). A batch's ids are made unique once
(``prepare``); mpips pulls those rows of every table, and for the step each table's weight is
a view of its pulled rows, indexed by the batch's ids renumbered to them. Every pulled row is
touched, so the gradient of that small weight is the table's gradient per touched row:
PyTorch's sparse backward adds it, in place, into the ``.grad`` that is mpips's push buffer
(3x faster than the dense backward of a bag, which sorts every id).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..device.arrays import issparse
from ..errors import ConfigError, DataError
from ..models.variables import VariableSpec
from .binding import Traffic, Views, as_tensor, numpy_dtype
from .spans import Spans

SPARSE_KINDS = (torch.nn.Embedding, torch.nn.EmbeddingBag)


@dataclass
class SparseInput:
    """A batch of sparse rows as ``nn.EmbeddingBag`` takes them: ``indices`` (int64, the
    rows of the tables), ``offsets`` (where each example's ids start) and ``weights`` (each
    id's value, ``per_sample_weights``); ``rows`` is the number of examples. A module with
    tables is called as ``module(batch)`` and passes these on to its bags."""

    indices: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    rows: int

    def __len__(self) -> int:
        return self.rows

    def to(self, device: torch.device | None) -> SparseInput:
        """The batch on ``device`` (a GPU worker's module: copied there, a batch at a time)."""
        if device is None or self.indices.device == device:
            return self
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return SparseInput(move(self.indices), move(self.offsets), move(self.weights), self.rows)


def _checked_offsets(offsets: dict[str, int], tables: set[str]) -> dict[str, int]:
    """``table_offsets`` checked: each names a sparse table, with an id >= 0."""
    for name, first in offsets.items():
        if name not in tables:
            known = ", ".join(sorted(tables)) or "none"
            raise ConfigError(
                f"mpips.torch.Model: table_offsets names {name!r}, not a sparse table of the "
                f"module (its sparse tables: {known})"
            )
        if isinstance(first, bool) or not isinstance(first, int | np.integer) or first < 0:
            raise ConfigError(
                f"mpips.torch.Model: table_offsets[{name!r}] is {first!r}, not a data id >= 0"
            )
    return {n: int(v) for n, v in offsets.items()}


def _csr_input(x: Any, dtype: Any = np.float32) -> tuple[SparseInput, np.ndarray]:
    """A CSR batch as a SparseInput over its unique ids, and those ids (sorted); its
    weights in ``dtype``, the tables' (``per_sample_weights`` must be)."""
    ids, local = np.unique(x.indices, return_inverse=True)
    batch = SparseInput(
        torch.from_numpy(local.reshape(-1).astype(np.int64)),
        torch.from_numpy(np.asarray(x.indptr[:-1], dtype=np.int64)),
        as_tensor(np.asarray(x.data, dtype=dtype)),
        x.shape[0],
    )
    return batch, ids


class Tables:
    """The module's sparse embeddings (by variable name) and their binding to pulled rows."""

    def __init__(self, module: torch.nn.Module, offsets: Mapping[str, int] | None = None):
        self.modules: dict[str, torch.nn.Embedding | torch.nn.EmbeddingBag] = {
            f"{name}.weight": m
            for name, m in module.named_modules()
            if isinstance(m, SPARSE_KINDS) and m.sparse and m.weight.requires_grad
        }
        self.params: dict[str, torch.Tensor] = {n: m.weight for n, m in self.modules.items()}
        self.names = set(self.params)
        self.offsets = _checked_offsets(dict(offsets or {}), self.names)
        self.initial = {n: p.detach().cpu().numpy() for n, p in self.params.items()}
        # the ids every table without an offset serves: its rows; the ids past every table
        whole = [p.shape[0] for n, p in self.params.items() if n not in self.offsets]
        self.num_rows = min(whole, default=None)
        ends = [self.offsets[n] + p.shape[0] for n, p in self.params.items() if n in self.offsets]
        self.past = max(ends, default=None)
        first = next(iter(self.initial.values()), None)
        self.dtype = first.dtype if first is not None else np.dtype(np.float32)
        self._values, self._grads = Views(), Views()
        self.spans = Spans(self.params, self.offsets)  # (the tables with an offset)
        self._bound: dict[str, torch.Tensor] = {}  # each .grad as bound before backward
        self.dynamic = False  # tables.kind = "dynamic": the data's ids are any values
        self._scales: dict[str, float] = {}  # (initial_rows_of: found when first asked)

    def specs(self) -> list[VariableSpec]:
        return [VariableSpec(n, tuple(p.shape), numpy_dtype(p, n)) for n, p in self.params.items()]

    def initial_rows(self, table: str, rows: tuple[int, int, int]) -> np.ndarray:
        """The module's initial values of rows ``range(*rows)`` of ``table``."""
        return np.ascontiguousarray(self.initial[table][slice(*rows)])

    def initial_rows_of(self, table: str, ids: np.ndarray, seed: int) -> np.ndarray:
        """A dynamic table's initial rows: uniform, a function of (seed, id), with the
        variance of the module's own initial rows."""
        from ..models.ctr import uniform_rows

        width = int(np.prod(self.params[table].shape[1:]))
        if table not in self._scales:  # (a PS task's: it keeps the initial tables)
            self._scales[table] = float(np.sqrt(3) * self.initial[table].std())
        rows = uniform_rows(seed, ids, width, self._scales[table])
        return rows.astype(self.dtype, copy=False)

    def prepare(self, x: Any) -> tuple[Any, np.ndarray]:
        """(the batch over its unique ids, those ids): CSR rows of (id, value) features give a
        SparseInput; integer arrays of ids give the same array renumbered (nn.Embedding)."""
        batch: SparseInput | torch.Tensor
        if issparse(x):
            batch, ids = _csr_input(x, self.dtype)
            width = x.shape[1]
        elif isinstance(x, np.ndarray) and x.dtype.kind in "iu":
            ids, local = np.unique(x, return_inverse=True)
            batch, width = (
                torch.from_numpy(local.reshape(x.shape).astype(np.int64)),
                int(ids[-1]) + 1,
            )
        else:
            raise DataError(
                "mpips.torch.Model: a module with sparse embeddings (sparse=True) takes "
                "sparse (CSR) rows or integer ids; this data is "
                f"{getattr(x, 'dtype', type(x).__name__)}"
            )
        if self.dynamic:  # (any ids: the PS tasks make their rows)
            return batch, ids
        if self.offsets:
            self.spans.prepare(ids)
        if self.num_rows is None and self.past is not None and width > self.past:
            raise DataError(
                f"mpips.torch.Model: the data has ids up to {width - 1}; no table serves an "
                f"id past {self.past - 1} (table_offsets + rows): wrong offsets, or another "
                f"data file?"
            )
        if self.num_rows is not None and width > self.num_rows:
            raise DataError(
                f"mpips.torch.Model: the data has ids up to {width - 1}; the smallest sparse "
                f"table has {self.num_rows} rows (every table is indexed by the data's ids, "
                f"unless table_offsets says which part of them it serves)"
            )
        return batch, ids

    def bind(self, params: dict[str, Any], grads: dict[str, Any] | None) -> None:
        """Each table's weight a view of its pulled rows, and (training) its .grad a zeroed
        view of the rows' push buffer (tables with an offset: Spans). A worker's first
        training step lets the module's whole initial tables go (the PS tasks made the rows
        from theirs)."""
        if grads is not None:
            self.initial.clear()
        for n, p in self.params.items():
            if n in self.offsets:
                continue
            t = self._values.of(n, params[n], p.data)
            if t is not None:
                p.data = t
            if grads is None:
                p.grad = None
                continue
            t = self._grads.of(n, grads[n], p.grad)
            if t is not None:
                p.grad = t
            g = p.grad
            assert g is not None
            self._bound[n] = g
            g.zero_()
        if self.offsets:
            self.spans.bind(params, grads)

    def collect(self, traffic: Traffic) -> None:
        """A table gradient torch made anew (not accumulated into the buffer) copied in."""
        for n, p in self.params.items():
            g = p.grad
            if n not in self.offsets and g is not None and g is not self._bound[n]:
                self._bound[n].copy_(g)
                traffic.copied_bytes += g.nbytes
                p.grad = None
        if self.offsets:
            self.spans.collect(traffic)

"""The buckets' layout, whatever moves them: a replica's variables, optimizer slots and
gradients live in a few flat buffers of one dtype each (``Store``), cut into buckets in the
order backward produces the gradients; a matrix that would overfill one is cut between rows.
Each replica owns one contiguous part of every bucket (``Bucket.counts``), which it updates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..device.pages import page_zeros
from ..models.variables import VariableSpec

LOSS = "__loss__"  # every replica's batch loss (its own entry): rides in the last bucket
ALIGN = 16  # elements: buckets (but one going on with a cut matrix), and parts where they
# can, start on a 64-byte line

# update(part of the variable, its summed gradient (mean once divided), its slots' parts):
# applies the optimizer in place to the part of one variable a replica owns
Update = Callable[[np.ndarray, np.ndarray, dict[str, np.ndarray]], None]


@dataclass
class Store:
    """Flat buffers of one dtype: variables, gradients and each optimizer slot; with node
    shared memory also every replica's gradients (``peers``)."""

    values: np.ndarray
    grads: np.ndarray
    slots: dict[str, np.ndarray]
    peers: list[np.ndarray] = field(default_factory=list)


@dataclass
class Bucket:
    needs: dict[str, int]  # variable: how many of its first rows backward must have written
    store: Store
    start: int  # where the bucket begins in its store
    counts: list[int]  # the part of the bucket each replica owns, in elements
    displs: list[int]
    pieces: list[tuple[str, int, int]]  # (variable, start, stop) in the store: this replica's
    shard: np.ndarray  # this replica's part of the summed gradients
    first: int  # where this replica's part begins in the store
    request: MPI.Request | None = None  # the reduce-scatter, until it completed
    gather: MPI.Request | None = None  # the allgather of the updated variables

    @property
    def size(self) -> int:
        return sum(self.counts)

    @property
    def own(self) -> slice:
        """This replica's part, in the store."""
        return slice(self.first, self.first + self.shard.size)

    def span(self, buffer: np.ndarray) -> np.ndarray:
        return buffer[self.start : self.start + self.size]

    def grad_parts(self) -> list[tuple[str, np.ndarray]]:
        """This replica's part of the summed gradients, by variable."""
        return [
            (name, self.shard[lo - self.first : hi - self.first]) for name, lo, hi in self.pieces
        ]

    def apply(self, update: Update) -> None:
        """Apply this replica's part of the bucket to the variables and their slots."""
        store = self.store
        for (name, lo, hi), (_, grad) in zip(self.pieces, self.grad_parts(), strict=True):
            if name == LOSS:
                store.values[lo:hi] = grad
                continue
            slots = {k: buf[lo:hi] for k, buf in store.slots.items()}
            update(store.values[lo:hi], grad, slots)


def _count(spec: VariableSpec) -> int:
    return int(np.prod(spec.shape))


def _rows(spec: VariableSpec) -> int:
    """How many rows (along axis 0) a bucket may cut ``spec`` between: 1 for a vector."""
    return spec.shape[0] if len(spec.shape) >= 2 and spec.shape[0] > 1 and _count(spec) else 1


def _length(spec: VariableSpec) -> int:
    """Rows along axis 0, as ``ready(name, rows)`` counts them (1 for a scalar)."""
    return spec.shape[0] if spec.shape else 1


Segment = tuple[VariableSpec, int, int]  # rows [start, stop) of a variable


def segments(order: list[VariableSpec], bucket_bytes: int) -> list[list[Segment]]:
    """``order`` (backward's) cut into buckets: a bucket closes once it holds
    ``bucket_bytes``, and a matrix that would overfill it is cut between rows, so that its
    first rows are reduced while backward still writes the rest (a model says so with
    ``ready(name, rows)``). A bucket holds one dtype."""
    buckets: list[list[Segment]] = []
    current: list[Segment] = []
    size = 0
    for spec in order:
        if current and np.dtype(current[0][0].dtype) != np.dtype(spec.dtype):
            buckets.append(current)
            current, size = [], 0
        rows = _rows(spec)
        row_bytes = spec.nbytes // rows
        start = 0
        while start < rows:
            take = rows - start
            if size + take * row_bytes > bucket_bytes:
                take = min(take, max(1, -(-(bucket_bytes - size) // row_bytes)))
            current.append((spec, start, start + take))
            size, start = size + take * row_bytes, start + take
            if size >= bucket_bytes:
                buckets.append(current)
                current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def parts(n: int, size: int) -> list[int]:
    """How many of a bucket's ``n`` elements each of ``size`` replicas owns: parts that start
    on a line (ALIGN elements) where that leaves none empty, else as even as can be. Every
    replica owns some of a bucket of at least ``size`` elements, so none can finish a step's
    exchange before every replica has joined it."""
    step = -(-n // (size * ALIGN)) * ALIGN
    if (size - 1) * step < n:
        return [min(step, max(0, n - r * step)) for r in range(size)]
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def view(segment: np.ndarray, at: int, n: int, dtype: str) -> np.ndarray:
    """``n`` values of ``dtype`` at byte ``at`` of a shared-memory segment."""
    return segment[at : at + n * np.dtype(dtype).itemsize].view(dtype)


def padded(n: int, dtype: str) -> int:
    return -(-n * np.dtype(dtype).itemsize // 64) * 64


def order_of(specs: list[VariableSpec], replicas: int) -> list[VariableSpec]:
    """The variables in backward's order (the last layer's gradients first), then the loss:
    one entry a replica."""
    loss = VariableSpec(LOSS, (replicas,), specs[0].dtype if specs else "float32")
    return [*reversed(specs), loss]


def totals(order: list[VariableSpec]) -> dict[str, int]:
    """Elements a store of each dtype holds: with room to start every bucket on a line."""
    out: dict[str, int] = {}
    for spec in order:
        key = np.dtype(spec.dtype).str
        out[key] = out.get(key, 0) + _count(spec) + ALIGN
    return out


def private_stores(totals: dict[str, int], slot_names: tuple[str, ...]) -> dict[str, Store]:
    """A replica's own stores (no shared memory): gradients and values on pages of their
    own (a GPU replica locks them)."""
    return {
        d: Store(page_zeros(n, d), page_zeros(n, d), {k: np.zeros(n, d) for k in slot_names})
        for d, n in totals.items()
    }


def store_arrays(stores: dict[str, Store]) -> list[np.ndarray]:
    """The gradients and values of ``stores`` (what a GPU replica page-locks)."""
    return [a for s in stores.values() for a in (s.grads, s.values)]


# shard(store, where this replica's part of a bucket begins, its length): the buffer that
# receives this replica's part of the summed gradients
Shard = Callable[[Store, int, int], np.ndarray]


def zero_shard(store: Store, first: int, count: int) -> np.ndarray:
    """A buffer of its own for this replica's part of the summed gradients."""
    return np.zeros(count, store.values.dtype)


class Layout:
    """The buckets over ``stores``, and every variable's views into them: ``values``,
    ``grads`` and ``slots`` by name; ``buckets_of`` names each variable's buckets, in order."""

    def __init__(
        self,
        stores: dict[str, Store],
        order: list[VariableSpec],
        bucket_bytes: int,
        comm: MPI.Comm,
        shard: Shard = zero_shard,
    ):
        self.stores = stores
        self.size, self.rank = comm.size, comm.rank
        self.shard = shard
        self.buckets: list[Bucket] = []
        self.values: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self.buckets_of: dict[str, list[int]] = {}
        used = dict.fromkeys(stores, 0)
        for cut in segments(order, bucket_bytes):
            used = self._add(cut, used)

    def _views(self, spec: VariableSpec, store: Store, lo: int) -> None:
        """The whole variable, from ``lo`` on (a later bucket may hold its end)."""
        whole = slice(lo, lo + _count(spec))
        self.values[spec.name] = store.values[whole].reshape(spec.shape)
        self.grads[spec.name] = store.grads[whole].reshape(spec.shape)
        self.slots[spec.name] = {k: b[whole].reshape(spec.shape) for k, b in store.slots.items()}

    def _add(self, cut: list[Segment], used: dict[str, int]) -> dict[str, int]:
        key = np.dtype(cut[0][0].dtype).str
        store = self.stores[key]
        # a bucket that goes on with a variable begins where the last one ended; others on a line
        start = used[key] if cut[0][1] else -(-used[key] // ALIGN) * ALIGN
        sizes = [_count(s) // _rows(s) * (stop - first) for s, first, stop in cut]
        counts = parts(sum(sizes), self.size)
        displs = [sum(counts[:r]) for r in range(self.size)]
        mine_lo, mine_hi = start + displs[self.rank], start + displs[self.rank] + counts[self.rank]
        pieces = []
        offset = start
        index = len(self.buckets)
        for (s, first, _), size in zip(cut, sizes, strict=True):
            lo, hi = offset, offset + size
            if first == 0:
                self._views(s, store, lo)
            if max(lo, mine_lo) < min(hi, mine_hi):
                pieces.append((s.name, max(lo, mine_lo), min(hi, mine_hi)))
            self.buckets_of.setdefault(s.name, []).append(index)
            offset = hi
        shard = self.shard(store, mine_lo, counts[self.rank])
        # rows along axis 0 that ``ready(name, rows)`` must have said (all, where it ends)
        needs = {s.name: stop if stop < _rows(s) else _length(s) for s, _, stop in cut}
        self.buckets.append(Bucket(needs, store, start, counts, displs, pieces, shard, mine_lo))
        return {**used, key: offset}

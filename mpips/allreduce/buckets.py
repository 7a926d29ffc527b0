"""Synchronous replicas: gradient buckets reduced and the update sharded over the replicas,
the initial broadcast, and the replica check. With store/, the only code that moves data
over MPI.

A replica's variables, optimizer slots and gradients live in a few flat buffers (buckets),
filled in the order backward produces the gradients; a matrix that would overfill one is
cut between rows. When a bucket's last gradient (or its rows of one: ``ready(name, rows)``)
is written its ``Ireduce_scatter`` starts at once, so reducing it overlaps the rest of
backward: MPICH moves a nonblocking collective only inside MPI calls, so pending requests
are tested between layers, and a thread enters MPI every 100 us while a layer's matrix
products run (``_Pump``). Each replica then owns one contiguous part of every bucket: it
applies the update to that part only, with the summed gradients it received, and an
in-place ``Iallgatherv`` of the variables gives every replica the whole update. Whether a
step is applied (no replica asked to stop) is agreed in a small allreduce started with the
step, so a bucket reduced while backward still runs is updated and gathered then too
(backward no longer reads a variable it said ``ready``). That moves
the same bytes as an allreduce of the gradients, applies each update once instead of W
times, and leaves the replicas bitwise identical by construction: every value is computed
by one replica and copied to the others. Optimizer slots stay with their owner;
``collect_slots`` fetches the other parts (one-sided, the owners need not take part) when
the chief writes a checkpoint.
"""

from __future__ import annotations

import atexit
import math
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, cast

import numpy as np
from mpi4py import MPI

from ..device.backend import page_zeros
from ..errors import AlreadyReported, ReplicasDiverged, Stalled
from ..models.variables import VariableSpec
from ..process.waits import poll
from ..store import (
    Exposed,
    NodeShared,
    allgather_json,
    stall_limit,
    stall_timeout,
    start_timeout,
    wait,
)

LOSS = "__loss__"  # every replica's batch loss (its own entry): rides in the last bucket
ALIGN = 16  # elements: buckets (but one going on with a cut matrix), and parts where they
# can, start on a 64-byte line

# update(part of the variable, its summed gradient (mean once divided), its slots' parts):
# applies the optimizer in place to the part of one variable a replica owns
Update = Callable[[np.ndarray, np.ndarray, dict[str, np.ndarray]], None]
# clip(this replica's parts of the mean gradients, total): scale them in place by one factor
# from their joint norm; total(sum of squares here) sums the squares over the replicas
Clip = Callable[[list[np.ndarray], Callable[[float], float]], None]


@dataclass
class _Store:
    """Flat buffers of one dtype: variables, gradients and each optimizer slot; with node
    shared memory also every replica's gradients (``peers``)."""

    values: np.ndarray
    grads: np.ndarray
    slots: dict[str, np.ndarray]
    peers: list[np.ndarray] = field(default_factory=list)


@dataclass
class Bucket:
    needs: dict[str, int]  # variable: how many of its first rows backward must have written
    store: _Store
    start: int  # where the bucket begins in its store
    counts: list[int]  # the part of the bucket each replica owns, in elements
    displs: list[int]
    pieces: list[tuple[str, int, int]]  # (variable, start, stop) in the store: this replica's
    shard: np.ndarray  # this replica's part of the summed gradients
    request: MPI.Request | None = None  # the reduce-scatter, until it completed
    gather: MPI.Request | None = None  # the allgather of the updated variables

    @property
    def size(self) -> int:
        return sum(self.counts)

    def span(self, buffer: np.ndarray) -> np.ndarray:
        return buffer[self.start : self.start + self.size]


@dataclass
class _Step:
    """A step's plan: its update and clipping, and the replicas' agreement to apply it."""

    update: Update | None = None
    clip: Clip | None = None
    agreement: np.ndarray | None = None  # the votes, then their maxima (None: not cast)
    request: MPI.Request | None = None  # the agreement's allreduce, until it completed
    gathered: int = 0  # buckets updated and their allgathers started, in bucket order

    @property
    def early(self) -> bool:
        """Buckets reduced during backward may be updated then, once agreed (clipping needs
        every mean gradient first)."""
        return self.update is not None and self.clip is None


def _count(spec: VariableSpec) -> int:
    return int(np.prod(spec.shape))


def _rows(spec: VariableSpec) -> int:
    """How many rows (along axis 0) a bucket may cut ``spec`` between: 1 for a vector."""
    return spec.shape[0] if len(spec.shape) >= 2 and spec.shape[0] > 1 and _count(spec) else 1


def _length(spec: VariableSpec) -> int:
    """Rows along axis 0, as ``ready(name, rows)`` counts them (1 for a scalar)."""
    return spec.shape[0] if spec.shape else 1


Segment = tuple[VariableSpec, int, int]  # rows [start, stop) of a variable


def _segments(order: list[VariableSpec], bucket_bytes: int) -> list[list[Segment]]:
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


def _parts(n: int, size: int) -> list[int]:
    """How many of a bucket's ``n`` elements each of ``size`` replicas owns: parts that start
    on a line (ALIGN elements) where that leaves none empty, else as even as can be. Every
    replica owns some of a bucket of at least ``size`` elements, so none can finish a step's
    exchange before every replica has joined it."""
    step = -(-n // (size * ALIGN)) * ALIGN
    if (size - 1) * step < n:
        return [min(step, max(0, n - r * step)) for r in range(size)]
    return [n // size + (1 if r < n % size else 0) for r in range(size)]


def _view(segment: np.ndarray, at: int, n: int, dtype: str) -> np.ndarray:
    """``n`` values of ``dtype`` at byte ``at`` of a shared-memory segment."""
    return segment[at : at + n * np.dtype(dtype).itemsize].view(dtype)


def _padded(n: int, dtype: str) -> int:
    return -(-n * np.dtype(dtype).itemsize // 64) * 64


class GradientBuckets:
    """A replica's variables, slots and gradients, as views into fused buckets; the mean
    gradient of each part of a bucket is applied by the replica that owns that part, then
    shared.

    ``shared`` (every replica on one node): the replicas keep one copy of the variables and
    slots in MPI shared memory, and each replica's gradients there too. Once every replica
    has written its gradients, each one sums its part straight from the others' memory and
    updates that part of the one copy in place: no message moves a byte.

    One replica alone (one process) holds every part: its gradients are the mean, updated
    where they lie, and nothing is reduced, fenced or agreed over MPI.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        specs: list[VariableSpec],
        bucket_bytes: int,
        slot_names: tuple[str, ...] = (),
        shared: bool = False,
    ):
        self.comm = comm
        self.size, self.rank = comm.size, comm.rank
        self.solo = self.size == 1  # (nothing to share with: no shared window either)
        shared = shared and not self.solo
        self.buckets: list[Bucket] = []
        self.values: dict[str, np.ndarray] = {}
        self.grads: dict[str, np.ndarray] = {}
        self.slots: dict[str, dict[str, np.ndarray]] = {}
        self._buckets_of: dict[str, list[int]] = {}  # each variable's buckets, in order
        self._pending: dict[int, set[str]] = {}  # buckets not started: what they wait for
        self._exposed: list[tuple[Exposed, _Store]] = []  # the slots, for collect_slots
        self._shared: NodeShared | None = None
        self._pump: _Pump | None = None
        self._gathers: MPI.Comm | None = None  # the allgathers' own communicator
        self._step = _Step()
        self.reduce_seconds = 0.0  # time spent reducing and updating after backward
        loss = VariableSpec(LOSS, (self.size,), specs[0].dtype if specs else "float32")
        order = [*reversed(specs), loss]  # backward produces the last layer's gradients first
        totals: dict[str, int] = {}
        for spec in order:  # with room to start every bucket on a line
            key = np.dtype(spec.dtype).str
            totals[key] = totals.get(key, 0) + _count(spec) + ALIGN
        if shared:
            self.stores = self._shared_stores(totals, slot_names)
        else:
            self.stores = {
                # (gradients and values on pages of their own: a GPU replica locks them)
                d: _Store(
                    page_zeros(n, d), page_zeros(n, d), {k: np.zeros(n, d) for k in slot_names}
                )
                for d, n in totals.items()
            }
        used = dict.fromkeys(self.stores, 0)
        for segments in _segments(order, bucket_bytes):
            used = self._add(segments, used)
        threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        big = sum(s.nbytes for s in specs) >= PUMP_BYTES
        if not shared:  # (allgathers may start during backward, in another order)
            self._gathers = comm.Dup()
        if self.size > 1 and not shared and threads and big:
            self._pump = _Pump(comm)
        if self.size > 1 and slot_names and not shared:
            for store in self.stores.values():
                slots = list(store.slots.values())
                self._exposed.append((Exposed(cast(MPI.Intracomm, comm), slots), store))

    def _shared_stores(
        self, totals: dict[str, int], slot_names: tuple[str, ...]
    ) -> dict[str, _Store]:
        """Each replica's segment: its gradients; replica 0's also the variables and slots."""
        grads = sum(_padded(n, d) for d, n in totals.items())
        state = sum(_padded(n, d) * (1 + len(slot_names)) for d, n in totals.items())
        shared = NodeShared(
            cast(MPI.Intracomm, self.comm), grads + (state if self.rank == 0 else 0)
        )
        self._shared = shared
        segments = [shared.segment(r) for r in range(self.size)]
        stores = {}
        grads_at, state_at = 0, grads  # where the next dtype's arrays begin in a segment
        for d, n in totals.items():
            step = _padded(n, d)
            peers = [_view(segment, grads_at, n, d) for segment in segments]
            values, *slots = [
                _view(segments[0], state_at + i * step, n, d) for i in range(1 + len(slot_names))
            ]
            named = dict(zip(slot_names, slots, strict=True))
            stores[d] = _Store(values, peers[self.rank], named, peers)
            grads_at, state_at = grads_at + step, state_at + step * (1 + len(slot_names))
        self._fence("the replicas' shared memory")  # zeroed by every owner before any use
        return stores

    def _add(self, segments: list[Segment], used: dict[str, int]) -> dict[str, int]:
        key = np.dtype(segments[0][0].dtype).str
        store = self.stores[key]
        # a bucket that goes on with a variable begins where the last one ended; others on a line
        start = used[key] if segments[0][1] else -(-used[key] // ALIGN) * ALIGN
        sizes = [_count(s) // _rows(s) * (stop - first) for s, first, stop in segments]
        counts = _parts(sum(sizes), self.size)
        displs = [sum(counts[:r]) for r in range(self.size)]
        mine_lo, mine_hi = start + displs[self.rank], start + displs[self.rank] + counts[self.rank]
        pieces = []
        offset = start
        index = len(self.buckets)
        for (s, first, _), size in zip(segments, sizes, strict=True):
            lo, hi = offset, offset + size
            if first == 0:  # the whole variable, from here on (a later bucket may hold its end)
                whole = slice(lo, lo + _count(s))
                self.values[s.name] = store.values[whole].reshape(s.shape)
                self.grads[s.name] = store.grads[whole].reshape(s.shape)
                self.slots[s.name] = {k: b[whole].reshape(s.shape) for k, b in store.slots.items()}
            if max(lo, mine_lo) < min(hi, mine_hi):
                pieces.append((s.name, max(lo, mine_lo), min(hi, mine_hi)))
            self._buckets_of.setdefault(s.name, []).append(index)
            offset = hi
        # (alone, the shard is the gradients themselves: its own sum)
        own = store.grads[start : start + counts[0]]
        shard = own if self.solo else np.zeros(counts[self.rank], store.values.dtype)
        # rows along axis 0 that ``ready(name, rows)`` must have said (all, where it ends)
        needs = {s.name: stop if stop < _rows(s) else _length(s) for s, _, stop in segments}
        self.buckets.append(Bucket(needs, store, start, counts, displs, pieces, shard))
        return {**used, key: offset}

    @property
    def shared(self) -> bool:
        return self._shared is not None

    def host_arrays(self) -> list[np.ndarray]:
        """The memory gradients are written into and mean values read from (what a GPU
        replica page-locks): with shared memory, this replica's segment and the chief's
        (which holds the values)."""
        if self._shared is not None:
            return [self._shared.segment(r) for r in sorted({self.rank, 0})]
        return [a for s in self.stores.values() for a in (s.grads, s.values)]

    def share(self, root: int = 0) -> None:
        """Every replica's variables and slots become ``root``'s (at the start)."""
        if self._shared is not None:
            self._fence("the chief's variables")
            return
        arrays = [a for s in self.stores.values() for a in (s.values, *s.slots.values())]
        broadcast(self.comm, arrays, root)

    def start_step(
        self,
        update: Update | None = None,
        clip: Clip | None = None,
        votes: Sequence[int] | None = (),
    ) -> None:
        """Begin a step, before backward. It is applied with ``update`` (None: not applied,
        the mean gradients only) unless a replica's ``votes`` (small integers: a stop signal,
        a hook's request to stop) are not all 0; their maxima over the replicas are agreed
        in one small allreduce that runs meanwhile (``agreed``). Once it says the step is
        applied, and with no clipping (``clip`` needs every mean gradient first), a
        bucket whose reduction completes while backward runs is updated and its allgather
        started at once. ``votes`` None: cast later with ``vote``, and nothing is updated
        before."""
        self._step = _Step(update, clip)
        if votes is not None:
            self.vote(votes)
        if self._shared is None:  # (shared memory: nothing is reduced during backward)
            self._pending = {i: set(b.needs) for i, b in enumerate(self.buckets)}

    def ready(self, name: str, rows: int | None = None) -> None:
        """Backward has written gradient ``name`` and no longer reads variable ``name``
        (``rows``: only their first rows so far; a later call says more): start the reduction
        of each bucket this completes."""
        if self._shared is not None:
            return  # the others read it in place once every replica is done
        for index in self._buckets_of[name]:
            waiting = self._pending.get(index)
            if waiting is None or name not in waiting:
                continue
            if rows is not None and rows < self.buckets[index].needs[name]:
                break  # (a variable's later buckets need later rows)
            waiting.discard(name)
            if not waiting:
                self._reduce(index)
        for b in self.buckets:  # poke progress on what is in flight
            if b.request is not None and b.request.Test():
                b.request = None
            if b.gather is not None and b.gather.Test():
                b.gather = None
        if self._step.early and self._applied(wait=False):
            self._update_reduced()

    def set_loss(self, loss: float) -> None:
        """This replica's batch loss rides in the last bucket, in its own entry: every
        replica learns every replica's loss (``losses``) with the step's update."""
        self.grads[LOSS][...] = 0
        self.grads[LOSS][self.rank] = loss
        self.ready(LOSS)

    def vote(self, votes: Sequence[int]) -> None:
        """Cast this replica's votes on the step (once a step, at the same point on every
        replica): any nonzero maximum and the step is not applied."""
        step = self._step
        step.agreement = np.array(votes, np.int64)
        if len(votes) and not self.solo:
            step.request = self.comm.Iallreduce(MPI.IN_PLACE, step.agreement, MPI.MAX)

    def agreed(self) -> list[int]:
        """The maxima of the step's ``votes`` over the replicas (waits for them)."""
        self._applied(wait=True)
        assert self._step.agreement is not None
        return [int(v) for v in self._step.agreement]

    def losses(self) -> list[float]:
        """Every replica's batch loss, by replica, once a step was applied."""
        return [float(v) * self.size for v in self.values[LOSS]]

    def _applied(self, wait: bool) -> bool | None:
        """Whether this step is applied; None while the agreement is not yet known."""
        step = self._step
        if step.agreement is None:
            if wait:
                raise RuntimeError("finish or agreed before the step's vote")
            return None
        if step.request is not None:
            if wait:
                complete(self.comm, step.request, "the step's agreement")
            elif not step.request.Test():
                return None
            step.request = None
        return step.update is not None and not step.agreement.any()

    def _update_reduced(self) -> None:
        """Update, in bucket order, each bucket whose reduction completed, and start its
        allgather (every replica starts them in this order, some here, some in finish)."""
        step = self._step
        assert step.update is not None
        while step.gathered < len(self.buckets):
            b = self.buckets[step.gathered]
            if step.gathered in self._pending or b.request is not None:
                return  # not yet reduced
            self._mean(b)
            self._update(b, step.update)
            self._gather(b)
            step.gathered += 1

    def _gather(self, b: Bucket) -> None:
        if self.solo:
            return  # (updated in place: the only copy)
        assert self._gathers is not None
        b.gather = self._gathers.Iallgatherv(
            MPI.IN_PLACE, [b.span(b.store.values), (b.counts, b.displs)]
        )

    def _reduce(self, index: int) -> None:
        del self._pending[index]
        b = self.buckets[index]
        if self.solo:
            return  # (the shard is the gradients)
        b.request = self.comm.Ireduce_scatter(b.span(b.store.grads), b.shard, b.counts, MPI.SUM)
        if self._pump is not None:
            self._pump.on.set()  # until finish, which enters MPI itself

    def finish(self) -> float:
        """Complete the step: sum this replica's part of every bucket over the replicas,
        divide it by their number, update it (unless the step is not applied: then every
        variable stays as it was) and share the updated variables. A ``clip`` scales
        the mean gradients first (the sum of their squares over the replicas: one small
        allreduce more). Returns the mean loss over the replicas' batches (nan when not
        applied).

        Once the model's loss_and_grads has returned every gradient is final: buckets it did
        not report ready (a model that does not call ``ready``) start their reduction here,
        without the overlap with backward."""
        t0 = time.perf_counter()
        for index in sorted(self._pending):
            self._reduce(index)
        applied = self._applied(wait=True)
        update, clip = self._step.update, self._step.clip
        if self._shared is not None:
            if applied and update is not None:
                self._finish_shared(update, clip)
        else:
            self._finish_messages(update if applied else None, clip)
        self.reduce_seconds += time.perf_counter() - t0
        return float(self.values[LOSS].sum(dtype=np.float64)) if applied else math.nan

    def _finish_messages(self, update: Update | None, clip: Clip | None) -> None:
        if self._pump is not None:
            self._pump.on.clear()  # from here on this thread enters MPI itself
        whole_first = update is None or clip is not None  # every mean before any update
        if whole_first:
            for b in self.buckets:
                self._mean(b)
        if update is None:
            return
        if clip is not None:
            self._clip(clip)
        step = self._step
        for b in self.buckets[step.gathered :]:  # in the order their reductions started
            if not whole_first:
                self._mean(b)
            self._update(b, update)
            self._gather(b)
        step.gathered = len(self.buckets)
        for b in self.buckets:
            if b.gather is not None:
                complete(self.comm, b.gather, "the variables' allgather")
            b.gather = None

    def _finish_shared(self, update: Update, clip: Clip | None) -> None:
        self._fence("the replicas' gradients")  # every replica has written its gradients
        for b in self.buckets:
            self._mean_of_peers(b)
        if clip is not None:
            self._clip(clip)
        for b in self.buckets:
            self._update(b, update)
        self._fence("the replicas' updates")  # nobody reads a part before its owner wrote it

    def _mean_of_peers(self, b: Bucket) -> None:
        """The mean over the replicas of this replica's part of ``b``'s gradients, read in
        place from every replica's memory, into its shard."""
        first = b.start + b.displs[self.rank]
        part = slice(first, first + b.counts[self.rank])
        peers = b.store.peers
        if len(peers) > 1:  # one pass for the first two: memory is the cost here
            np.add(peers[0][part], peers[1][part], out=b.shard)
        else:
            np.copyto(b.shard, peers[0][part])
        for peer in peers[2:]:
            b.shard += peer[part]
        b.shard /= self.size

    def _fence(self, what: str) -> None:
        """Every replica's stores to the shared memory before any replica's later loads."""
        assert self._shared is not None
        self._shared.sync()
        complete(self.comm, self.comm.Ibarrier(), what)
        self._shared.sync()

    def _mean(self, b: Bucket) -> None:
        """This replica's part of ``b``'s mean gradient, once reduced."""
        if b.request is not None:
            complete(self.comm, b.request, "the gradient reduction")
            b.request = None
        if not self.solo:
            b.shard /= self.size

    def _grad_parts(self, b: Bucket) -> list[tuple[str, np.ndarray]]:
        first = b.start + b.displs[self.rank]
        return [(name, b.shard[lo - first : hi - first]) for name, lo, hi in b.pieces]

    def _clip(self, clip: Clip) -> None:
        """Scale every replica's parts of the mean gradients (the loss aside) by one factor,
        from their joint norm: each replica's sum of squares, summed over the replicas."""
        parts = [g for b in self.buckets for name, g in self._grad_parts(b) if name != LOSS]

        def over_replicas(squares: float) -> float:
            if self.solo:
                return squares
            total = np.array([squares])
            complete(self.comm, self.comm.Iallreduce(MPI.IN_PLACE, total, MPI.SUM), "the norm")
            return float(total[0])

        clip(parts, over_replicas)

    def _update(self, b: Bucket, update: Update) -> None:
        """Apply this replica's part of bucket ``b`` to the variables and their slots."""
        store = b.store
        for (name, lo, hi), (_, grad) in zip(b.pieces, self._grad_parts(b), strict=True):
            if name == LOSS:
                store.values[lo:hi] = grad
                continue
            slots = {k: buf[lo:hi] for k, buf in store.slots.items()}
            update(store.values[lo:hi], grad, slots)

    def collect_slots(self) -> None:
        """Fetch every other replica's parts of the optimizer slots (one-sided, passive
        target: the owners go on waiting in their collectives), so this replica holds them
        whole, e.g. to write a checkpoint. Owners change their parts only once the step's
        agreement is known (in ``ready`` or ``finish``), which cannot happen before this
        replica joins the next step. (With shared memory
        every replica sees them whole already.)"""
        for exposed, store in self._exposed:
            for r in range(self.size):
                if r == self.rank:
                    continue
                ranges = [
                    (b.start + b.displs[r], b.start + b.displs[r] + b.counts[r])
                    for b in self.buckets
                    if b.store is store
                ]
                exposed.fetch(r, ranges)

    def close(self) -> None:
        """At the end of the run, once the chief no longer reads the variables (its final
        evaluation): free the windows and shared memory (collective over the replicas)."""
        complete(self.comm, self.comm.Ibarrier(), "the end of the run")
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if self._gathers is not None:
            self._gathers.Free()
            self._gathers = None
        for exposed, _ in self._exposed:
            exposed.free()
        self._exposed = []
        if self._shared is not None:
            self._shared.free()
            self._shared = None


PUMP_SECONDS = 1e-4  # how often the pump enters MPI while a bucket is reduced during backward
PUMP_TAG = 7101  # never sent: the pump's Iprobe only drives MPICH's progress
# the pump runs for gradients this big in all (transfers of several ms): at 10 Gbit/s it made
# the wide MLP's 23 MB 5% faster, the reference MLP's 2.7 MB 5% slower (its wake-ups take the
# core from backward, and the tests between layers were enough)
PUMP_BYTES = 4 << 20


class _Pump:
    """While a big model's buckets are reduced during backward, a thread that enters MPI every
    PUMP_SECONDS (an Iprobe on a communicator of its own; set ``on``). Without shared memory
    MPICH moves a nonblocking collective only inside MPI calls, and a layer's matrix
    products make none for milliseconds; they release the GIL, so this thread runs beside
    them and the reduction goes on meanwhile (docs/scaling.md)."""

    def __init__(self, comm: MPI.Comm):
        self.comm = comm.Dup()  # collective, like the buckets
        self.on = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mpips-progress", daemon=True)
        self._thread.start()
        atexit.register(self._halt)  # before MPI_Finalize (mpi4py's, registered earlier)

    def _run(self) -> None:
        while self.on.wait() and not self._closed:
            self.comm.Iprobe(MPI.ANY_SOURCE, PUMP_TAG)
            time.sleep(PUMP_SECONDS)

    def _halt(self) -> None:
        self._closed = True
        self.on.set()
        self._thread.join()

    def close(self) -> None:
        """Stop the thread and free its communicator (collective)."""
        self._halt()
        atexit.unregister(self._halt)
        self.comm.Free()


SPIN_SECONDS = 0.02  # yield the core this long before sleeping: a step's collective
# usually completes within it (a sleep right away doubled the step time)
STOP_TAG = 7100  # a PS rank's preemption signal, sent to the chief


def complete(comm: MPI.Comm, request: MPI.Request, what: str) -> None:
    """Wait for a collective of every replica: yield the core for a short spin, then sleep
    (backing off to 1 ms), so a replica waiting on a hung peer does not burn a core. A replica
    that never joins (hung, yet alive) ends the job after MPIPS_STALL_TIMEOUT s (later ranks
    a little longer, so one rank says it)."""

    def late(waited: float) -> NoReturn:
        raise Stalled(
            f"{what} did not complete within {stall_timeout():.0f} s: a replica "
            f"is hung? (MPIPS_STALL_TIMEOUT sets the limit); aborting the job"
        )

    poll(request.Test, stall_limit(comm.rank), late, spin=SPIN_SECONDS)


def agree_max(comm: MPI.Comm, values: list[int], what: str = "the step's agreement") -> list[int]:
    """The element-wise largest ``values`` over all ranks of ``comm`` (one small allreduce)."""
    buf = np.array(values, dtype=np.int64)
    complete(comm, comm.Iallreduce(MPI.IN_PLACE, buf, MPI.MAX), what)
    return [int(v) for v in buf]


def idle_until_end(comm: MPI.Comm, value: int, meanwhile: Callable[[], None]) -> int:
    """A rank with nothing to hold (a PS rank in sync mode): its part in the replicas'
    end-of-run ``agree_max`` of ``value``, waited for asleep (calling ``meanwhile``) and
    without a deadline: the replicas police each other, and this wait ends with them."""
    buf = np.array([value], dtype=np.int64)
    wait(comm.Iallreduce(MPI.IN_PLACE, buf, MPI.MAX), "the end of the run", math.inf, meanwhile)
    return int(buf[0])


def forward_stop(comm: MPI.Comm, chief_rank: int, signum: int) -> None:
    """A PS rank in sync mode (it holds nothing) passes a preemption signal to the chief."""
    comm.Send(np.array([signum], np.int64), dest=chief_rank, tag=STOP_TAG)


def stop_from_ps(comm: MPI.Comm) -> int:
    """Chief: a signal a PS rank forwarded (0: none), without waiting."""
    status = MPI.Status()
    if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=STOP_TAG, status=status):
        return 0
    buf = np.zeros(1, np.int64)
    comm.Recv(buf, source=status.Get_source(), tag=STOP_TAG)
    return int(buf[0])


def broadcast(comm: MPI.Comm, arrays: list[np.ndarray], root: int = 0) -> None:
    """Broadcast arrays in place from ``root`` (waiting ranks sleep)."""
    for a in arrays:
        wait(comm.Ibcast(a, root=root), "the chief's broadcast of the variables", start_timeout())


def replica_hash(arrays: list[np.ndarray]) -> int:
    """CRC32 of the bytes of all arrays: equal only if the replicas are bitwise identical."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data, crc)  # zero-copy
    return crc


def check_replicas(comm: MPI.Comm, arrays: list[np.ndarray], step: int) -> None:
    """Unless all replicas are bitwise identical, raise on every one: ReplicasDiverged on the
    chief (rank 0 of ``comm``), naming the replicas that differ; AlreadyReported elsewhere."""
    hashes = allgather_json(comm, replica_hash(arrays), "the replica check", stall_timeout())
    if len(set(hashes)) > 1:
        first = hashes[0]
        bad = [task for task, h in enumerate(hashes) if h != first]
        message = (
            f"replicas diverged at global_step {step}: the variables of worker task(s) "
            f"{', '.join(map(str, bad))} differ from task 0's (a non-deterministic op, "
            f"or a replica changed outside the update)"
        )
        raise ReplicasDiverged(message) if comm.rank == 0 else AlreadyReported(message)

"""Replicas that exchange messages (across nodes, or without shared memory): each has its own
copy of the buckets. When a bucket's last gradient (or its rows of one: ``ready(name, rows)``)
is written its ``Ireduce_scatter`` starts at once, so reducing it overlaps the rest of
backward: MPICH moves a nonblocking collective only inside MPI calls, so pending requests
are tested between layers, and a thread enters MPI every 100 us while a layer's matrix
products run (``_Pump``). Each replica applies the update to the part of every bucket it
owns, with the summed gradients it received, and an in-place ``Iallgatherv`` of the
variables gives every replica the whole update. Optimizer slots stay with their owner;
``collect_slots`` fetches the other parts (one-sided, the owners need not take part) when
the chief writes a checkpoint.
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import cast

import numpy as np
from mpi4py import MPI

from ..models.variables import VariableSpec
from ..store import Exposed
from .agreement import broadcast, complete, start_max, sum_over
from .layout import Bucket, Layout, Update, private_stores, store_arrays
from .step import Backward, Clip, Step, clip_parts


class Messages:
    """The transport of replicas with a copy each: reduce-scatter, update, allgather."""

    shared = False

    def __init__(
        self,
        comm: MPI.Comm,
        order: list[VariableSpec],
        bucket_bytes: int,
        totals: dict[str, int],
        slot_names: tuple[str, ...],
    ):
        self.comm = comm
        self.size = comm.size
        stores = private_stores(totals, slot_names)
        self.layout = Layout(stores, order, bucket_bytes, comm)
        self.buckets = self.layout.buckets
        self.backward = Backward(self.layout)
        threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        big = sum(s.nbytes for s in order[:-1]) >= PUMP_BYTES  # (the loss aside)
        # the allgathers' own communicator: they may start during backward, in another order
        self._gathers: MPI.Comm | None = comm.Dup()
        self._pump = _Pump(comm) if threads and big else None
        self._exposed = [  # the slots, for collect_slots
            (Exposed(cast(MPI.Intracomm, comm), list(store.slots.values())), store)
            for store in stores.values()
            if slot_names
        ]

    def host_arrays(self) -> list[np.ndarray]:
        return store_arrays(self.layout.stores)

    def share(self, root: int) -> None:
        stores = self.layout.stores.values()
        broadcast(self.comm, [a for s in stores for a in (s.values, *s.slots.values())], root)

    def agree(self, votes: np.ndarray) -> MPI.Request | None:
        return start_max(self.comm, votes)

    def start_step(self) -> None:
        self.backward.start()

    def ready(self, step: Step, name: str, rows: int | None) -> None:
        """Start the reduction of each bucket this completes, test what is in flight, and
        update the buckets reduced meanwhile where the step allows it."""
        for index in self.backward.ready(name, rows):
            self._reduce(self.buckets[index])
        for b in self.buckets:  # poke progress on what is in flight
            if b.request is not None and b.request.Test():
                b.request = None
            if b.gather is not None and b.gather.Test():
                b.gather = None
        if step.early and step.applied(wait=False):
            self._update_reduced(step)

    def _reduce(self, b: Bucket) -> None:
        b.request = self.comm.Ireduce_scatter(b.span(b.store.grads), b.shard, b.counts, MPI.SUM)
        if self._pump is not None:
            self._pump.on.set()  # until finish, which enters MPI itself

    def _update_reduced(self, step: Step) -> None:
        """Update, in bucket order, each bucket whose reduction completed, and start its
        allgather (every replica starts them in this order, some here, some in finish)."""
        assert step.update is not None
        while (b := self.backward.next_reduced(step)) is not None:
            self._mean(b)
            b.apply(step.update)
            self._gather(b)
            step.gathered += 1

    def _gather(self, b: Bucket) -> None:
        assert self._gathers is not None
        b.gather = self._gathers.Iallgatherv(
            MPI.IN_PLACE, [b.span(b.store.values), (b.counts, b.displs)]
        )

    def _mean(self, b: Bucket) -> None:
        """This replica's part of ``b``'s mean gradient, once reduced."""
        if b.request is not None:
            complete(self.comm, b.request, "the gradient reduction")
            b.request = None
        b.shard /= self.size

    def finish(self, step: Step) -> bool:
        for index in self.backward.rest():
            self._reduce(self.buckets[index])
        applied = bool(step.applied(wait=True))
        self._finish(step, step.update if applied else None, step.clip)
        return applied

    def _finish(self, step: Step, update: Update | None, clip: Clip | None) -> None:
        if self._pump is not None:
            self._pump.on.clear()  # from here on this thread enters MPI itself
        whole_first = update is None or clip is not None  # every mean before any update
        if whole_first:
            for b in self.buckets:
                self._mean(b)
        if update is None:
            return
        if clip is not None:
            clip_parts(self.buckets, clip, lambda squares: sum_over(self.comm, squares))
        for b in self.buckets[step.gathered :]:  # in the order their reductions started
            if not whole_first:
                self._mean(b)
            b.apply(update)
            self._gather(b)
        step.gathered = len(self.buckets)
        for b in self.buckets:
            if b.gather is not None:
                complete(self.comm, b.gather, "the variables' allgather")
            b.gather = None

    def collect_slots(self) -> None:
        """Fetch every other replica's parts of the optimizer slots (one-sided, passive
        target: the owners go on waiting in their collectives)."""
        for exposed, store in self._exposed:
            for r in range(self.size):
                if r == self.comm.rank:
                    continue
                ranges = [
                    (b.start + b.displs[r], b.start + b.displs[r] + b.counts[r])
                    for b in self.buckets
                    if b.store is store
                ]
                exposed.fetch(r, ranges)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.close()
            self._pump = None
        if self._gathers is not None:
            self._gathers.Free()
            self._gathers = None
        for exposed, _ in self._exposed:
            exposed.free()
        self._exposed = []


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

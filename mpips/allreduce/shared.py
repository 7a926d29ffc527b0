"""Replicas on one node that share one copy of the variables and slots in MPI shared memory,
and each replica's gradients there too. Once every replica has written its gradients, each
one sums its part straight from the others' memory and updates that part of the one copy in
place: no message moves a byte (so nothing is reduced while backward runs)."""

from __future__ import annotations

from typing import cast

import numpy as np
from mpi4py import MPI

from ..models.variables import VariableSpec
from ..store import NodeShared
from .agreement import complete, start_max, sum_over
from .layout import Bucket, Layout, Store, padded, store_arrays, view
from .step import Step, clip_parts


class NodeMemory:
    """The transport of replicas sharing a node's memory: fences around reads in place."""

    def __init__(
        self,
        comm: MPI.Comm,
        order: list[VariableSpec],
        bucket_bytes: int,
        totals: dict[str, int],
        slot_names: tuple[str, ...],
    ):
        self.comm = comm
        self.size, self.rank = comm.size, comm.rank
        self._shared: NodeShared | None = None
        stores = self._stores(totals, slot_names)
        self.layout = Layout(stores, order, bucket_bytes, comm)
        self.buckets = self.layout.buckets

    def _stores(self, totals: dict[str, int], slot_names: tuple[str, ...]) -> dict[str, Store]:
        """Each replica's segment: its gradients; replica 0's also the variables and slots."""
        grads = sum(padded(n, d) for d, n in totals.items())
        state = sum(padded(n, d) * (1 + len(slot_names)) for d, n in totals.items())
        shared = NodeShared(
            cast(MPI.Intracomm, self.comm), grads + (state if self.rank == 0 else 0)
        )
        self._shared = shared
        segments = [shared.segment(r) for r in range(self.size)]
        stores = {}
        grads_at, state_at = 0, grads  # where the next dtype's arrays begin in a segment
        for d, n in totals.items():
            step = padded(n, d)
            peers = [view(segment, grads_at, n, d) for segment in segments]
            values, *slots = [
                view(segments[0], state_at + i * step, n, d) for i in range(1 + len(slot_names))
            ]
            named = dict(zip(slot_names, slots, strict=True))
            stores[d] = Store(values, peers[self.rank], named, peers)
            grads_at, state_at = grads_at + step, state_at + step * (1 + len(slot_names))
        self._fence("the replicas' shared memory")  # zeroed by every owner before any use
        return stores

    def _fence(self, what: str) -> None:
        """Every replica's stores to the shared memory before any replica's later loads."""
        assert self._shared is not None
        self._shared.sync()
        complete(self.comm, self.comm.Ibarrier(), what)
        self._shared.sync()

    @property
    def shared(self) -> bool:
        return self._shared is not None  # (until closed)

    def host_arrays(self) -> list[np.ndarray]:
        """This replica's segment and the chief's (which holds the values)."""
        if self._shared is None:
            return store_arrays(self.layout.stores)
        return [self._shared.segment(r) for r in sorted({self.rank, 0})]

    def share(self, root: int) -> None:
        self._fence("the chief's variables")  # (the one copy is every replica's)

    def agree(self, votes: np.ndarray) -> MPI.Request | None:
        return start_max(self.comm, votes)

    def start_step(self) -> None:
        """Nothing is reduced during backward."""

    def ready(self, step: Step, name: str, rows: int | None) -> None:
        """The others read the gradients in place once every replica is done."""

    def finish(self, step: Step) -> bool:
        applied = bool(step.applied(wait=True))
        if not applied or step.update is None:
            return applied
        self._fence("the replicas' gradients")  # every replica has written its gradients
        for b in self.buckets:
            self._mean_of_peers(b)
        if step.clip is not None:
            clip_parts(self.buckets, step.clip, lambda squares: sum_over(self.comm, squares))
        for b in self.buckets:
            b.apply(step.update)
        self._fence("the replicas' updates")  # nobody reads a part before its owner wrote it
        return applied

    def _mean_of_peers(self, b: Bucket) -> None:
        """The mean over the replicas of this replica's part of ``b``'s gradients, read in
        place from every replica's memory, into its shard."""
        part = b.own
        peers = b.store.peers
        if len(peers) > 1:  # one pass for the first two: memory is the cost here
            np.add(peers[0][part], peers[1][part], out=b.shard)
        else:
            np.copyto(b.shard, peers[0][part])
        for peer in peers[2:]:
            b.shard += peer[part]
        b.shard /= self.size

    def collect_slots(self) -> None:
        """Every replica sees the slots whole already."""

    def close(self) -> None:
        if self._shared is not None:
            self._shared.free()
            self._shared = None

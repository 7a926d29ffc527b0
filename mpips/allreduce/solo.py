"""One replica alone (one process): it holds every part of every bucket, its gradients are
the mean, updated where they lie, and nothing is reduced, fenced or agreed over MPI."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..models.variables import VariableSpec
from .layout import Layout, Store, private_stores, store_arrays
from .step import Backward, Step, clip_parts


def own_grads(store: Store, first: int, count: int) -> np.ndarray:
    """Alone, this replica's part of the summed gradients is its gradients: their own sum."""
    return store.grads[first : first + count]


class Solo:
    """The transport of one replica: no other to move anything to or from."""

    shared = False

    def __init__(
        self,
        comm: MPI.Comm,
        order: list[VariableSpec],
        bucket_bytes: int,
        totals: dict[str, int],
        slot_names: tuple[str, ...],
    ):
        stores = private_stores(totals, slot_names)
        self.layout = Layout(stores, order, bucket_bytes, comm, own_grads)
        self.backward = Backward(self.layout)

    def host_arrays(self) -> list[np.ndarray]:
        return store_arrays(self.layout.stores)

    def share(self, root: int) -> None:
        """Nothing to share: the initial state is this replica's."""

    def agree(self, votes: np.ndarray) -> MPI.Request | None:
        return None  # (the votes are their own maxima)

    def start_step(self) -> None:
        self.backward.start()

    def ready(self, step: Step, name: str, rows: int | None) -> None:
        """Nothing to reduce: a bucket backward completed is updated at once where the step
        allows it."""
        self.backward.ready(name, rows)
        if step.early and step.applied(wait=False):
            self._update_reduced(step)

    def _update_reduced(self, step: Step) -> None:
        assert step.update is not None
        while (b := self.backward.next_reduced(step)) is not None:
            b.apply(step.update)
            step.gathered += 1

    def finish(self, step: Step) -> bool:
        self.backward.rest()
        applied = bool(step.applied(wait=True))
        if applied:
            if step.clip is not None:
                clip_parts(self.layout.buckets, step.clip, lambda squares: squares)
            self._update_reduced(step)
        return applied

    def collect_slots(self) -> None:
        """Every part of the slots is this replica's already."""

    def close(self) -> None:
        """Nothing of its own to free."""

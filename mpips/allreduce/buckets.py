"""Synchronous replicas: gradient buckets reduced and the update sharded over the replicas.
``GradientBuckets`` is what the modes hold; it composes the bucket layout (layout.py), a
step's plan and agreement (step.py) and one transport chosen at construction: one replica
alone (solo.py), one copy in a node's shared memory (shared.py) or messages (messages.py).

A replica's variables, optimizer slots and gradients live in a few flat buffers (buckets),
filled in the order backward produces the gradients. Each replica owns one contiguous part
of every bucket: it takes the mean of the replicas' gradients for that part, applies the
update to that part only, and the replicas share the result. Whether a step is applied (no
replica asked to stop) is agreed in a small allreduce started with the step, so a bucket
reduced while backward still runs is updated and shared then too (backward no longer reads
a variable it said ``ready``). That moves the same bytes as an allreduce of the gradients,
applies each update once instead of W times, and leaves the replicas bitwise identical by
construction: every value is computed by one replica and copied to the others.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from mpi4py import MPI

from ..models.variables import VariableSpec
from .agreement import complete
from .layout import LOSS, Bucket, Layout, Update, order_of, totals
from .messages import Messages
from .shared import NodeMemory
from .solo import Solo
from .step import Clip, Step


class Transport(Protocol):
    """How the replicas' buckets move (solo.py, shared.py, messages.py): the layout over its
    stores, and every step's reduction, update and sharing."""

    layout: Layout

    @property
    def shared(self) -> bool: ...

    def host_arrays(self) -> list[np.ndarray]: ...

    def share(self, root: int) -> None: ...

    def agree(self, votes: np.ndarray) -> MPI.Request | None: ...

    def start_step(self) -> None: ...

    def ready(self, step: Step, name: str, rows: int | None) -> None: ...

    def finish(self, step: Step) -> bool: ...

    def collect_slots(self) -> None: ...

    def close(self) -> None: ...


def transport(
    comm: MPI.Comm,
    specs: list[VariableSpec],
    bucket_bytes: int,
    slot_names: tuple[str, ...],
    shared: bool,
) -> Transport:
    """One replica alone, replicas sharing a node's memory (``shared``), or messages."""
    order = order_of(specs, comm.size)
    kind = Solo if comm.size == 1 else NodeMemory if shared else Messages
    return kind(comm, order, bucket_bytes, totals(order), slot_names)


class GradientBuckets:
    """A replica's variables, slots and gradients, as views into fused buckets; the mean
    gradient of each part of a bucket is applied by the replica that owns that part, then
    shared.

    ``shared`` (every replica on one node): the replicas keep one copy of the variables and
    slots in MPI shared memory, and each replica's gradients there too (shared.py).
    Otherwise they exchange messages (messages.py). One replica alone (one process) holds
    every part: its gradients are the mean, updated where they lie, and nothing is reduced,
    fenced or agreed over MPI (solo.py).
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
        self.transport = transport(comm, specs, bucket_bytes, slot_names, shared)
        layout = self.transport.layout
        self.stores = layout.stores
        self.buckets: list[Bucket] = layout.buckets
        self.values: dict[str, np.ndarray] = layout.values
        self.grads: dict[str, np.ndarray] = layout.grads
        self.slots: dict[str, dict[str, np.ndarray]] = layout.slots
        self._step = Step(comm)
        self.reduce_seconds = 0.0  # time spent reducing and updating after backward

    @property
    def shared(self) -> bool:
        return self.transport.shared

    def host_arrays(self) -> list[np.ndarray]:
        """The memory gradients are written into and mean values read from (what a GPU
        replica page-locks): with shared memory, this replica's segment and the chief's
        (which holds the values)."""
        return self.transport.host_arrays()

    def share(self, root: int = 0) -> None:
        """Every replica's variables and slots become ``root``'s (at the start)."""
        self.transport.share(root)

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
        self._step = Step(self.comm, update, clip)
        if votes is not None:
            self.vote(votes)
        self.transport.start_step()

    def ready(self, name: str, rows: int | None = None) -> None:
        """Backward has written gradient ``name`` and no longer reads variable ``name``
        (``rows``: only their first rows so far; a later call says more): start the reduction
        of each bucket this completes."""
        self.transport.ready(self._step, name, rows)

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
        if len(votes):
            step.request = self.transport.agree(step.agreement)

    def agreed(self) -> list[int]:
        """The maxima of the step's ``votes`` over the replicas (waits for them)."""
        self._step.applied(wait=True)
        assert self._step.agreement is not None
        return [int(v) for v in self._step.agreement]

    def losses(self) -> list[float]:
        """Every replica's batch loss, by replica, once a step was applied."""
        return [float(v) * self.size for v in self.values[LOSS]]

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
        applied = self.transport.finish(self._step)
        self.reduce_seconds += time.perf_counter() - t0
        return float(self.values[LOSS].sum(dtype=np.float64)) if applied else math.nan

    def collect_slots(self) -> None:
        """Fetch every other replica's parts of the optimizer slots (one-sided, passive
        target: the owners go on waiting in their collectives), so this replica holds them
        whole, e.g. to write a checkpoint. Owners change their parts only once the step's
        agreement is known (in ``ready`` or ``finish``), which cannot happen before this
        replica joins the next step. (With shared memory
        every replica sees them whole already.)"""
        self.transport.collect_slots()

    def close(self) -> None:
        """At the end of the run, once the chief no longer reads the variables (its final
        evaluation): free the windows and shared memory (collective over the replicas)."""
        complete(self.comm, self.comm.Ibarrier(), "the end of the run")
        self.transport.close()

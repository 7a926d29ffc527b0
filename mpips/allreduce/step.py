"""One step over the buckets, whatever moves them: its plan (update and clipping), the
replicas' agreement to apply it, and (where buckets are reduced while backward runs) which
buckets still wait for backward's gradients."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .agreement import complete
from .layout import LOSS, Bucket, Layout, Update

# clip(this replica's parts of the mean gradients, total): scale them in place by one factor
# from their joint norm; total(sum of squares here) sums the squares over the replicas
Clip = Callable[[list[np.ndarray], Callable[[float], float]], None]


@dataclass
class Step:
    """A step's plan: its update and clipping, and the replicas' agreement to apply it."""

    comm: MPI.Comm
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

    def applied(self, wait: bool) -> bool | None:
        """Whether this step is applied; None while the agreement is not yet known."""
        if self.agreement is None:
            if wait:
                raise RuntimeError("finish or agreed before the step's vote")
            return None
        if self.request is not None:
            if wait:
                complete(self.comm, self.request, "the step's agreement")
            elif not self.request.Test():
                return None
            self.request = None
        return self.update is not None and not self.agreement.any()


def clip_parts(buckets: list[Bucket], clip: Clip, total: Callable[[float], float]) -> None:
    """Scale every replica's parts of the mean gradients (the loss aside) by one factor, from
    their joint norm: each replica's sum of squares, summed over the replicas (``total``)."""
    clip([g for b in buckets for name, g in b.grad_parts() if name != LOSS], total)


class Backward:
    """Which buckets still wait for backward's gradients in a step (``waiting``: what each
    one waits for), so each starts its reduction once the last is written, and the order
    buckets are updated in: bucket order, as their reductions complete (every replica
    starts their allgathers in this order)."""

    def __init__(self, layout: Layout):
        self.buckets = layout.buckets
        self.buckets_of = layout.buckets_of
        self.waiting: dict[int, set[str]] = {}  # buckets not started: what they wait for

    def start(self) -> None:
        self.waiting = {i: set(b.needs) for i, b in enumerate(self.buckets)}

    def ready(self, name: str, rows: int | None) -> list[int]:
        """Backward has written gradient ``name`` (``rows``: only its first rows so far): the
        buckets this completes, no longer waiting, in order."""
        done = []
        for index in self.buckets_of[name]:
            waiting = self.waiting.get(index)
            if waiting is None or name not in waiting:
                continue
            if rows is not None and rows < self.buckets[index].needs[name]:
                break  # (a variable's later buckets need later rows)
            waiting.discard(name)
            if not waiting:
                del self.waiting[index]
                done.append(index)
        return done

    def rest(self) -> list[int]:
        """The buckets still waiting, in order, no longer waiting: every gradient is final."""
        rest = sorted(self.waiting)
        self.waiting = {}
        return rest

    def next_reduced(self, step: Step) -> Bucket | None:
        """The next bucket to update, in bucket order, if its reduction completed."""
        if step.gathered >= len(self.buckets):
            return None
        b = self.buckets[step.gathered]
        if step.gathered in self.waiting or b.request is not None:
            return None  # not yet reduced
        return b

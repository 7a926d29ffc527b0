"""The training modes, one object each (base.Mode): async, sync, sync_replicas and hybrid.
``select`` chooses the one a job runs in, once; the rest of mpips asks it what differs."""

from __future__ import annotations

from ..job import Job
from .asynchronous import Async
from .base import Mode
from .hybrid import Hybrid
from .sync import Sync
from .sync_replicas import SyncReplicas

MODES: dict[str, type[Mode]] = {m.name: m for m in (Async, Sync, SyncReplicas, Hybrid)}


def select(job: Job, world_size: int) -> Mode:
    """The mode ``job`` trains in on ``world_size`` ranks: its train.mode, except on one
    process (no mpirun), which trains as a single synchronous replica (``Mode.single``,
    set when train.mode said otherwise). The Job is left as it is."""
    if world_size == 1 and job.train.mode != Sync.name:
        return Sync(single=True)
    kind = MODES[job.train.mode]
    return kind(job.train.max_staleness if kind.has_staleness else None)


__all__ = ["MODES", "Async", "Hybrid", "Mode", "Sync", "SyncReplicas", "select"]

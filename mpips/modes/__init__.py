"""The training modes, one object each (base.Mode): async, sync, sync_replicas and hybrid.
``select`` chooses the one a job runs in, once; the rest of mpips asks it what differs."""

from __future__ import annotations

from ..errors import ConfigError
from ..job import Job
from .asynchronous import Async
from .base import Mode, RunContext
from .hybrid import Hybrid
from .sync import Sync
from .sync_replicas import SyncReplicas

MODES: dict[str, type[Mode]] = {m.name: m for m in (Async, Sync, SyncReplicas, Hybrid)}


def check_job(job: Job) -> Job:
    """``job`` as its mode takes it: the mode's own rules (Mode.check_job); returns it."""
    if job.train.mode not in MODES:  # (a Job built in code: a file's value is checked)
        raise ConfigError(f"train.mode: {job.train.mode!r} is not one of {', '.join(MODES)}")
    MODES[job.train.mode].check_job(job)
    return job


def select(job: Job, world_size: int) -> Mode:
    """The mode ``job`` trains in on ``world_size`` ranks, the rules of its train.mode
    checked (check_job): that mode, except on one process (no mpirun), which trains as a
    single synchronous replica (``Mode.single``, set when train.mode said otherwise). The
    Job is left as it is."""
    check_job(job)
    if world_size == 1 and job.train.mode != Sync.name:
        return Sync(single=True)
    kind = MODES[job.train.mode]
    return kind(job.train.max_staleness if kind.has_staleness else None)


__all__ = [
    "MODES",
    "Async",
    "Hybrid",
    "Mode",
    "RunContext",
    "check_job",
    "Sync",
    "SyncReplicas",
    "select",
]

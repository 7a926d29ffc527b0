"""A run's checkpoints as the modes write them: the manifest's metadata (the job, the layout,
the data position) and the whole checkpoint the chief writes where it holds every variable."""

from __future__ import annotations

from typing import Any

from .. import checkpoint
from ..job import Job
from ..store import Cluster
from .hooks import (
    PendingSave,
)


def _data_source(job: Job) -> str:
    """Where the run's data came from, for the manifest (a file, the built-in set, .npy
    files, or arrays handed to mpips.train)."""
    d = job.data
    if d.builtin:
        return f"builtin:{d.builtin}"
    return d.path or (f"npy:{d.train_x}" if d.train_x else "arrays (Python API)")


def manifest_meta(job: Job, cluster: Cluster, clocks: list[int]) -> dict[str, Any]:
    """What a checkpoint manifest records besides the variables: the job, the layout and
    the data position (updates, i.e. batches, each worker task has used)."""
    layout = cluster.layout
    return {
        "job": job.source,
        "job_sha256": checkpoint.job_digest(job),
        "model": job.model.kind,
        "layout": {
            "world_size": cluster.comm.size,
            "ps": layout.num_ps,
            "workers": layout.num_workers,
            "mode": job.train.mode,
        },
        "clocks": clocks,
        "data": {
            "path": _data_source(job),
            "batch_size": job.train.batch_size,
            "seed": job.train.seed,
        },
    }


def save_whole(
    job: Job,
    cluster: Cluster,
    step: int,
    variables: dict[str, Any],
    slots: dict[str, Any],
    clocks: list[int],
) -> PendingSave:
    """Chief, holding every variable: write one shard and commit it (done at once)."""
    c = job.checkpoint
    checkpoint.write_shard(c.dir, step, 0, 1, variables, slots)
    path = checkpoint.commit(
        c.dir,
        step,
        1,
        checkpoint.whole_index(variables),
        checkpoint.whole_index(slots),
        manifest_meta(job, cluster, clocks),
        c.max_to_keep,
    )
    return PendingSave(step, lambda block: path)

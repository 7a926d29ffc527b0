"""Asynchronous training (``train.mode = "async"``): PS tasks serve the variables from their
windows; each worker pulls, computes gradients on its own batch and pushes an update
without waiting for the others (bounded by ``train.max_staleness``; engines/async_worker.py).
The chief also initialises or restores the variables, commits checkpoints and evaluates at
the end."""

from __future__ import annotations

from ..errors import ConfigError
from ..job import TABLE_KINDS, Job
from ..run.result import TrainResult
from .base import Mode, RunContext
from .engines.async_worker import AsyncWorker
from .engines.ps import close_store, open_store, run_ps, shard_count


class Async(Mode):
    """PS tasks hold every variable; each worker steps on its own (TensorFlow's between-graph
    replication without SyncReplicasOptimizer), its lead bounded by ``max_staleness``."""

    name = "async"
    note = "(update {info.local_updates} of this worker, pulled {info.delay} steps earlier)"
    trains_tables = True
    takes_clip_norm = True
    chief_speaks_for_all = False
    has_staleness = True
    zero_copy_on_one_node = True  # measured faster on one node (docs/guide/modes.md)

    @classmethod
    def check_job(cls, job: Job) -> None:
        super().check_job(job)
        if job.train.overlap_pull:
            _check_overlap_pull(job)

    def train(self, ctx: RunContext) -> TrainResult:
        """Every rank: create the windows, then PS tasks serve and workers train until the
        chief ends the run."""
        windows = open_store(ctx)
        if ctx.cluster.is_ps:
            result = run_ps(ctx, windows, shard_count(ctx.cluster.layout.num_ps, ctx.model))
        else:
            result = AsyncWorker(ctx, windows).train()
        return close_store(ctx.cluster, windows, result)


def _check_overlap_pull(job: Job) -> None:
    """What train.overlap_pull (the next pull during backward) does not go with."""
    if job.train.max_staleness is not None:
        raise ConfigError(
            "train.overlap_pull: not with train.max_staleness (variables pulled a step ahead "
            "miss the worker's own last update, which the bound counts)"
        )
    if job.model.kind in TABLE_KINDS:
        raise ConfigError(
            f"train.overlap_pull: model.kind = {job.model.kind!r} pulls the rows of each "
            f"batch's ids, which the next batch only tells"
        )
    if job.train.zero_copy:
        raise ConfigError(
            "train.overlap_pull: nothing to pull ahead with train.zero_copy (the device copies "
            "straight from the PS memory)"
        )

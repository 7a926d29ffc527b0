"""``train.mode = "sync_replicas"``: TensorFlow's SyncReplicasOptimizer through the PS tasks.
Each worker posts its gradient for the PS tasks' current step; each PS task averages the
first ``train.replicas_to_aggregate`` gradients of a step, applies the mean once and moves
on (gradients that come later are dropped, so backup workers hide a slow one). The engines
(the PS tasks' Averager, the worker) are in engines/replicas_worker.py.

With backup workers and several PS tasks, each PS task chooses its step's gradients on its
own, as TensorFlow's accumulators (one per variable) do: two PS tasks may average different
workers' gradients for the same step. A worker posts only for a step every PS task is at
(common_step), so the PS tasks are never more than one step apart, each step waits for
gradients that are posted, and global_step (advanced by ps:0) counts every step once."""

from __future__ import annotations

from typing import Any

from ..data.batches import DatasetInfo, full_batches
from ..errors import ConfigError, DataError
from ..job import TABLE_KINDS, Job
from ..placement.layout import Layout
from ..run.result import TrainResult
from ..store import Apply, Cluster
from .base import Mode, RunContext
from .engines.ps import close_store, open_store, run_ps, shard_count
from .engines.replicas_worker import Averager, ReplicasWorker


class SyncReplicas(Mode):
    """PS tasks hold every variable and apply each step's averaged gradients once."""

    name = "sync_replicas"
    note = (
        "(the chief's batch; the PS tasks average the step's first replicas_to_aggregate gradients)"
    )
    aggregates = True
    no_clip_norm = "each PS applies the mean of its own variables' gradients"

    @classmethod
    def check_job(cls, job: Job) -> None:
        if not job.train.steps:
            raise ConfigError(
                'train.steps: mode = "sync_replicas" ends at a step target (give '
                "train.steps; each worker cycles through its part of the data)"
            )
        super().check_job(job)
        if job.model.kind in TABLE_KINDS:
            raise ConfigError('train.mode = "sync_replicas": dense models only, for now')

    def check(self, job: Job, cluster: Cluster, model: Any, info: DatasetInfo) -> None:
        check_sync_replicas(job, cluster, info)
        super().check(job, cluster, model, info)

    def aggregate_count(self, job: Job, layout: Layout) -> int:
        """The gradients a PS task averages for each step."""
        return job.train.replicas_to_aggregate or layout.num_workers

    def train(self, ctx: RunContext) -> TrainResult:
        """Every rank: create the windows, then PS tasks aggregate and workers post their
        gradients until the chief ends the run."""
        windows, cluster = open_store(ctx), ctx.cluster
        if cluster.is_ps:
            n, task = self.aggregate_count(ctx.job, cluster.layout), cluster.role.task

            def average(apply: Apply) -> Averager:
                return Averager(windows, task, apply, ctx.optimizer.slots, n)

            shards = shard_count(cluster.layout.num_ps, ctx.model)
            result = run_ps(ctx, windows, shards, average)
        else:
            result = ReplicasWorker(ctx, windows).train()
        return close_store(cluster, windows, result)


def check_sync_replicas(job: Job, cluster: Cluster, info: DatasetInfo) -> None:
    """What sync_replicas needs of the layout and the data: no more gradients a step than
    workers; a full batch a step on every worker."""
    aggregate, workers = job.train.replicas_to_aggregate, cluster.layout.num_workers
    if aggregate > workers:
        raise ConfigError(
            f"train.replicas_to_aggregate = {aggregate}: more than the {workers} worker(s) "
            f"of this layout"
        )
    if full_batches(info.rows["train"], workers, job.train.batch_size) == 0:
        raise DataError(
            f"{info.path}: {info.rows['train']} train rows make no full batch of "
            f"{job.train.batch_size} on each of {workers} workers (sync_replicas)"
        )

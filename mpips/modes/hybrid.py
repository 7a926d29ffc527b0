"""``train.mode = "hybrid"`` (PERSIA-style): the embedding tables stay on the PS tasks and
move row by row, asynchronously, as in async mode; the dense part of the model (wide &
deep's MLP, biases) is trained by the workers as synchronous replicas, as in sync mode.

A step of every worker: pull the rows of its batch's ids from the PS tasks, forward and
backward (the dense gradients' reduction starts during it across nodes), agree on stopping
and on every replica's loss being finite (so every replica has pulled, and nothing of a
step whose loss is not finite is pushed), push its rows' gradients to the PS tasks
(Accumulate for SGD, the inbox for stateful optimizers; applied before the push returns),
then update its part of the dense variables and share it (which waits for every replica,
so every push has landed before any replica's next pull: unlike sync mode, no part is
shared during backward). The tables thus see the workers' gradients in lockstep, each
worker's applied on its own (as in async mode), while every replica's dense variables stay
identical (checked every ``train.check_every`` steps); one step is one global step.

A checkpoint holds the tables' partitions in the PS tasks' shards and the dense variables
(with their slots) in one more shard the chief writes, so it restores in any mode.
"""

from __future__ import annotations

from typing import Any

from ..data.batches import DatasetInfo
from ..errors import ConfigError
from ..job import Job
from ..optim import Optimizer
from ..placement.layout import Layout
from ..run.result import TrainResult
from ..store import Cluster
from .base import Mode, RunContext, replica_bytes
from .engines.ps import close_store, open_store, run_ps, shard_count
from .engines.replica import Replica
from .engines.replica_rows import TableRows


class Hybrid(Mode):
    """The tables on the PS tasks, row by row; the dense variables on the workers, as
    synchronous replicas."""

    name = "hybrid"
    note = "(update {info.local_updates} of this worker, pulled {info.delay} steps earlier)"
    dense_on_ps = False
    chief_holds_dense = True
    trains_tables = True
    no_clip_norm = "the dense mean and the table rows are applied in different places"

    def check(self, job: Job, cluster: Cluster, model: Any, info: DatasetInfo) -> None:
        if not model.tables():
            raise ConfigError(
                f'train.mode = "hybrid": {type(model).__name__} has no tables to keep on the '
                f'PS tasks; train its dense variables with mode = "sync" (or "async")'
            )
        super().check(job, cluster, model, info)

    def rank_bytes(
        self,
        job: Job,
        layout: Layout,
        model: Any,
        optimizer: Optimizer,
        info: DatasetInfo,
        zero_copy: bool | None = None,
    ) -> list[int]:
        """The PS tasks' windows of the tables; the workers' buffers, and the dense part
        each holds as a replica."""
        replica = replica_bytes(model, optimizer)
        per_rank = super().rank_bytes(job, layout, model, optimizer, info, zero_copy)
        return [n + (0 if layout.role(r).job == "ps" else replica) for r, n in enumerate(per_rank)]

    def train(self, ctx: RunContext) -> TrainResult:
        """Every rank: the windows of the tables; PS tasks serve them, workers train as
        synchronous replicas of the dense part (pulling and pushing their batches' rows:
        engines/replica_rows.py) until the chief ends the run."""
        windows, cluster = open_store(ctx), ctx.cluster
        num_shards = shard_count(cluster.layout.num_ps, ctx.model, chief_writes=True)
        if cluster.is_ps:
            result = run_ps(ctx, windows, num_shards)
        else:
            result = Replica(ctx, TableRows(ctx, windows)).train()
        return close_store(cluster, windows, result)

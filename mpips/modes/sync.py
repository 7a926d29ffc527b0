"""Synchronous replicas (``train.mode = "sync"``): every worker holds every variable and the
replicas apply the mean gradient of each step together (engines/replica.py): no PS, no counter, no
chief that can run ahead. PS ranks, if the layout has any, hold nothing in this mode and
sleep (passing on a preemption signal they receive). One process (no mpirun) trains in this
mode, as a single replica, whatever train.mode says."""

from __future__ import annotations

from typing import Any

from ..allreduce import agree_max, forward_stop, idle_until_end
from ..data.batches import DatasetInfo
from ..errors import ConfigError
from ..job import TABLE_KINDS, Job
from ..optim import Optimizer
from ..placement.layout import Layout
from ..placement.plan import job_placement
from ..process import preemption
from ..run.result import TrainResult
from ..store import Cluster
from .base import Mode, RunContext, replica_bytes
from .engines.replica import Replica
from .engines.replica_rows import DenseOnly


class Sync(Mode):
    """Synchronous replicas on the workers; the PS tasks, if any, hold nothing."""

    name = "sync"
    note = "(mean over all replicas' batches)"
    ps_holds_variables = False
    chief_holds_dense = True
    takes_clip_norm = True

    @classmethod
    def check_job(cls, job: Job) -> None:
        super().check_job(job)
        if job.model.kind in TABLE_KINDS:
            raise ConfigError(
                f"model.kind: {job.model.kind!r} keeps its tables on the PS tasks; "
                f'it trains in mode = "async"'
            )

    def rank_bytes(
        self,
        job: Job,
        layout: Layout,
        model: Any,
        optimizer: Optimizer,
        info: DatasetInfo,
        zero_copy: bool | None = None,
    ) -> list[int]:
        replica = replica_bytes(model, optimizer)
        return [0 if layout.role(r).job == "ps" else replica for r in range(layout.world_size)]

    def train(self, ctx: RunContext) -> TrainResult:
        """Train as synchronous replicas on the workers (collective over the world).

        PS ranks, if the layout names any, hold nothing: they wait for the end of the run,
        passing a preemption signal they receive to the chief. At the end every rank agrees
        on the signal that stopped the run (if any), so every rank exits with the same code.
        """
        cluster = ctx.cluster
        specs = ctx.model.variables()
        cluster.check_placement(job_placement(ctx.job, specs, 1))  # same variables on every rank
        if cluster.is_ps:
            return _idle_ps(cluster)
        result = Replica(ctx, DenseOnly(ctx)).train()
        # every rank, PS included, learns the signal that stopped the run: the same exit code
        result.stopped_by = agree_max(
            cluster.comm, [result.stopped_by or preemption.requested()], "the end of the run"
        )[0]
        return result


def _idle_ps(cluster: Cluster) -> TrainResult:
    """A PS rank of a sync job: wait for the end of the run, passing a signal it receives
    on to the chief."""
    comm, chief = cluster.comm, cluster.layout.chief_rank
    result = TrainResult(cluster.role, 0, 0)
    forwarded = [False]

    def forward() -> None:
        if preemption.requested() and not forwarded[0]:
            forward_stop(comm, chief, preemption.requested())
            forwarded[0] = True

    agreed_stop = idle_until_end(comm, preemption.requested(), forward)
    result.stopped_by = agreed_stop  # a signal too late to stop the run changes nothing
    return result

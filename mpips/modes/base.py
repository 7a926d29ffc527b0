"""The training mode as an object: what differs between async, sync, sync_replicas and
hybrid training (how a worker steps, what a PS task does, who holds the variables, what a
step's log line says), chosen once (``mpips.modes.select``). Start-up, the loop's hooks,
summaries and the run's result ask it; nothing outside this package compares train.mode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..data.batches import DatasetInfo
from ..device.backend import Device
from ..errors import ConfigError
from ..job import Job, OptimizerConfig, TrainConfig
from ..optim import Optimizer
from ..placement.layout import Layout, Role
from ..placement.plan import job_layout, job_placement
from ..placement.table import Placement, slot_placement
from ..process import settings
from ..process.log import detail
from ..process.memory import SHM_DIR, human, shared_memory_fits, shared_memory_free
from ..process.settings import launch_hint
from ..run.hooks import Hook, StepInfo
from ..run.result import TrainResult
from ..run.startup import Prepared
from ..store import Cluster, WindowPlan, has_inboxes
from .tables import check as check_tables


class Mode:
    """One training mode. The class attributes are its answers; ``train`` runs it on a rank.

    ``max_staleness``: async's bound on a worker's lead (None: none, and in every other
    mode); ``single``: one process (no mpirun) trains as a single synchronous replica,
    whatever train.mode says (the Job itself is left as it was)."""

    name = ""
    ps_holds_variables = True  # False (sync): the PS tasks hold nothing and wait
    dense_on_ps = True  # False (hybrid): the PS tasks hold the tables only
    chief_holds_dense = False  # sync, hybrid: a restore reads the dense variables on the chief
    aggregates = False  # sync_replicas: every gradient goes to a PS inbox and is averaged
    trains_tables = False  # async, hybrid: a model with row-partitioned tables trains here
    takes_clip_norm = False  # async, sync: optimizer.clip_norm is honoured
    no_clip_norm = ""  # where it is not: why (said when a job sets it)
    chief_speaks_for_all = True  # every worker makes the same step: the chief logs it once
    has_staleness = False  # async: steps are made from stale pulls (lead, delay)
    zero_copy_on_one_node = False  # async: train.zero_copy unset means on, on one node
    note = ""  # what a step's log line adds after its loss and epoch ({info}: the StepInfo)

    def __init__(self, max_staleness: int | None = None, single: bool = False):
        self.max_staleness = max_staleness
        self.single = single

    @classmethod
    def check_job(cls, job: Job) -> None:
        """What this mode refuses in a job before anything runs: the settings of other modes
        (job.py checks a job file's types and ranges; the mode, its own rules)."""
        t, name = job.train, cls.name
        if t.max_staleness is not None and not cls.has_staleness:
            raise ConfigError('train.max_staleness: only for mode = "async" (sync is lock-step)')
        if t.replicas_to_aggregate and not cls.aggregates:
            raise ConfigError('train.replicas_to_aggregate: only for mode = "sync_replicas"')
        if t.zero_copy and not cls.zero_copy_on_one_node:
            raise ConfigError(
                f'train.zero_copy: only for mode = "async" (mode = "{name}" reads '
                f"consistent copies of the variables)"
            )
        if t.overlap_pull and (not cls.has_staleness or t.device == "cpu"):
            raise ConfigError(
                'train.overlap_pull: only for mode = "async" with device = "gpu" (it overlaps '
                "the host's next pull with the device's backward)"
            )
        if job.optimizer.clip_norm and not cls.takes_clip_norm:
            raise ConfigError(f'optimizer.clip_norm: not with mode = "{name}" ({cls.no_clip_norm})')

    def ps_applies(self, stateful: bool) -> bool:
        """Whether a PS task applies the updates itself (then it needs inboxes)."""
        return stateful or self.aggregates

    def layout(self, job: Job, world_size: int, nodes: list[int] | None = None) -> Layout:
        """The job's rank layout for this mode (one with no PS task holding variables may
        have no PS task at all). One process (``single``, the debugging run) has no PS
        task, whatever the job's [layout] says: its ps and world_size are for a launch
        with several ranks (training.one_process_note says so)."""
        if self.single:
            return Layout(world_size, ())
        return job_layout(job, world_size, nodes, sync=not self.ps_holds_variables)

    def store_placement(self, job: Job, model: Any, num_ps: int) -> Placement:
        """What the PS tasks hold: the model's tables and (but in hybrid) its variables."""
        dense = model.variables() if self.dense_on_ps else []
        # (dynamic tables live in the PS tasks' own memory, not in a window)
        tables = model.tables() if job.tables.kind == "fixed" else []
        return job_placement(job, dense, num_ps, tables)

    def check(self, job: Job, cluster: Cluster, model: Any, info: DatasetInfo) -> None:
        """What this mode refuses at start-up (one message, before anything is allocated)."""
        check_tables(job, model, info.max_nnz)
        if model.tables() and not self.trains_tables:
            raise ConfigError(
                f"{type(model).__name__} keeps row-partitioned tables on the PS "
                f'tasks: it trains in mode = "async" or "hybrid" (2 ranks or more, e.g. '
                f"{launch_hint(3)})"
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
        """What each rank allocates for the model: the PS windows, the workers' buffers
        (``zero_copy``: with or without it; None: as the job says)."""
        in_place = bool(job.train.zero_copy if zero_copy is None else zero_copy)
        placement = self.store_placement(job, model, layout.num_ps)
        slots = slot_placement(placement, optimizer.slots) if optimizer.stateful else None
        inboxes = has_inboxes(placement, in_place, self.ps_applies(optimizer.stateful))
        plan = WindowPlan(placement, slots, job.train.batch_size * max(1, info.max_nnz))
        return plan.rank_bytes(layout, inboxes, in_place)

    def zero_copy(self, ctx: RunContext) -> bool:
        """Whether this rank would have the workers read and update the PS memory in place:
        train.zero_copy when set; unset, the default of a mode that reads in place on one
        node (async) when every rank is on one node, the workers compute on the CPU,
        MPIPS_SHARED_MEMORY is not 0 and the node's /dev/shm holds the PS windows (MPI
        shared memory lives there: past its end a process dies of SIGBUS). Local: the
        ranks agree on it afterwards (mpips.train: all of them, or none)."""
        job, cluster = ctx.job, ctx.cluster
        if job.train.zero_copy is not None:
            return job.train.zero_copy
        if job.tables.kind == "dynamic":  # (workers never address a dynamic table's rows)
            return False
        if not (self.zero_copy_on_one_node and cluster.one_node and job.train.device == "cpu"):
            return False
        if not settings.current().shared_memory:  # (MPIPS_SHARED_MEMORY=0: none wanted)
            return False
        per_rank = self.rank_bytes(
            job, cluster.layout, ctx.model, ctx.optimizer, ctx.prep.info, zero_copy=True
        )
        need = sum(per_rank[r] for r in cluster.layout.ps_ranks)
        free = shared_memory_free(need)
        if shared_memory_fits(need, free):
            return True
        if cluster.is_chief:
            detail(
                cluster.role,
                f"{self.name}: {SHM_DIR} has {human(free)} free, the PS memory read in place "
                f"would take {human(need)} (and a quarter to spare): copied pulls instead "
                f"(train.zero_copy; in a container, give it more: docker run --shm-size)",
            )
        return False

    def step_note(self, info: StepInfo) -> str:
        """What a step's log line adds after its loss and epoch (the mode's ``note``)."""
        return self.note.format(info=info)

    def train(self, ctx: RunContext) -> TrainResult:
        """Every rank of the world: train ``ctx.model`` as this mode does (collective)."""
        raise NotImplementedError


@dataclass(frozen=True)
class RunContext:
    """One rank's run, built once at start-up (``mpips.training``) and handed to the mode
    and to every engine it starts: the job (this run's copy), its mode, where the rank
    stands in the cluster, the optimizer, what start-up prepared, the device it computes
    on and the hooks a worker's loop runs."""

    job: Job
    mode: Mode
    cluster: Cluster
    optimizer: Optimizer
    prep: Prepared
    device: Device
    hooks: list[Hook] = field(default_factory=list)

    @property
    def model(self) -> Any:
        return self.prep.model

    @property
    def role(self) -> Role:
        return self.cluster.role

    @property
    def tc(self) -> TrainConfig:
        """The job's [train] table."""
        return self.job.train

    @property
    def oc(self) -> OptimizerConfig:
        """The job's [optimizer] table."""
        return self.job.optimizer


def replica_bytes(model: Any, optimizer: Optimizer) -> int:
    """What a synchronous replica holds of the dense variables: values, gradients, slots."""
    return sum(s.nbytes for s in model.variables()) * (2 + len(optimizer.slots))

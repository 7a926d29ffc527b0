"""A synchronous replica: the engine of sync mode (every variable) and of hybrid mode (the
dense part). Every worker computes gradients on its own batch. Each replica owns one part
of every bucket of variables: it takes the mean of the replicas' gradients for that part and
applies the same optimizer code as the async path to it, and the replicas share the result
(mpips.allreduce: one copy in the node's shared memory, or reduce-scatter and allgather
across nodes). Every update is applied once and the replicas are identical by construction
(with a copy each, checked every ``train.check_every`` steps and at the end). global_step
advances once per aggregated step, identically on every replica.

One class, composed of two collaborators: where the variables live (replica_variables.py:
host buckets or the device) and what a batch brings from the PS tasks (replica_rows.py:
nothing in sync mode, table rows in hybrid mode).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NoReturn, Protocol

import numpy as np

from ...allreduce import GradientBuckets, Update, agree_max, broadcast, check_replicas, replica_hash
from ...data.batches import full_batches
from ...device.staging import StagedGradients
from ...errors import AgreedError, AlreadyReported, NonFinite
from ...models.contract import first_loss_and_grads, said_once
from ...models.variables import VariableSpec
from ...optim import global_norm_clip, learning_rate
from ...process import settings
from ...process.log import detail, log
from ...process.memory import SHM_DIR, shared_memory_free
from ...run.hooks import PendingSave, Run, StepInfo
from ...run.report import (
    evaluate_on,
    loss_not_finite,
    report,
    say_nothing_to_train,
    say_position_lost,
    say_preempted,
    say_restored,
)
from ...run.result import TrainResult
from ...run.session import Session, target_steps
from ...run.startup import Prepared
from ...run.statistics import recompute_at_end
from ...run.summaries import job_timeline
from ...run.timeline import Phases
from ...store import Cluster
from ..base import RunContext
from .replica_variables import DeviceVariables, HostVariables


class Variables(Protocol):
    """Where a replica's variables live (replica_variables.py)."""

    slots_in_buckets: bool
    live: dict[str, Any]
    grads: dict[str, Any]

    def bucketed(self, specs: list[VariableSpec]) -> list[VariableSpec]: ...
    def attach(self, buckets: GradientBuckets, specs: list[VariableSpec]) -> None: ...
    def set_initial(self, prep: Prepared) -> None: ...
    def shared_initial(self, buckets: GradientBuckets) -> None: ...
    def host_params(self) -> dict[str, np.ndarray]: ...
    def whole_slots(self, buckets: GradientBuckets) -> dict[str, np.ndarray]: ...
    def on_device(
        self, x: Any, y: Any, params: dict[str, Any], host_grads: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any], StagedGradients]: ...
    def update_rule(self, lr: float, step: int) -> Update: ...
    def apply_mean(self, lr: float, step: int, timed: bool) -> None: ...
    def release(self, buckets: GradientBuckets) -> None: ...


class Rows(Protocol):
    """What a replica's batch brings from the PS tasks (replica_rows.py)."""

    vote_after_compute: bool
    pulls: bool

    def start(self) -> None: ...
    def end(self, clock: int) -> None: ...
    def inputs(
        self, x: Any, params: dict[str, Any], grads: dict[str, Any]
    ) -> tuple[Any, dict[str, Any], dict[str, Any]]: ...
    def signal(self) -> int: ...
    def push(self, grads: dict[str, Any], lr: float, clock: int) -> None: ...
    def evaluated(self, x: Any, live: dict[str, Any]) -> tuple[Any, dict[str, Any]]: ...
    def save(
        self, step: int, variables: dict[str, Any], slots: dict[str, Any], clocks: list[int]
    ) -> PendingSave: ...


def node_shared(cluster: Cluster, nbytes: int) -> bool:
    """The replicas share one copy of the variables in the node's memory: every worker on
    this node, unless MPIPS_SHARED_MEMORY=0 (then they exchange messages, as across nodes)
    or the node's shared-memory file system (/dev/shm) lacks the ``nbytes`` it takes: MPI
    shared memory lives there, and a process that runs past its end dies of SIGBUS."""
    if cluster.workers.size == 1:  # one replica: nothing to share (see GradientBuckets)
        return False
    if not cluster.workers_on_one_node or not settings.current().shared_memory:
        return False
    free = shared_memory_free(nbytes)
    fits = free >= nbytes * 1.25
    if not agree_max(cluster.workers, [0 if fits else 1], "the shared-memory check")[0]:
        return True
    if cluster.is_chief:
        log(
            cluster.role,
            f"sync replicas: {SHM_DIR} has {free / 1e6:.0f} MB free, shared memory for "
            f"the variables would take {nbytes / 1e6:.0f} MB: exchanging messages instead "
            f"(in a container, give it more: docker run --shm-size)",
        )
    return False


def _batches_per_epoch(ctx: RunContext, workers: int) -> int:
    """Full batches every worker can make each epoch (the same count on all replicas)."""
    rows, batch_size = ctx.prep.info.rows["train"], ctx.tc.batch_size
    per = full_batches(rows, workers, batch_size)
    if per == 0:
        raise AgreedError(
            f"{rows} train rows give some of the {workers} workers less than "
            f"one batch of {batch_size}: lower train.batch_size"
        )
    return per


class Replica:
    """One worker as a synchronous replica: compute, average, apply, once per batch."""

    def __init__(self, ctx: RunContext, rows: Rows):
        self.ctx, self.rows = ctx, rows
        self.model, self.prep, self.device = ctx.model, ctx.prep, ctx.device
        self.role, self.tc = ctx.role, ctx.tc
        self.comm, self.workers = ctx.cluster.workers, ctx.cluster.layout.num_workers
        # first: every replica refuses too few rows alike, before anything is pinned
        self.per_epoch = _batches_per_epoch(ctx, self.workers)
        home: Variables = HostVariables(ctx) if ctx.device.on_host else DeviceVariables(ctx)
        self.home = home
        specs = home.bucketed(self.model.variables())
        # each replica updates its part of every bucket, and the batch loss rides in the
        # last one; shared memory holds every replica's gradients, the variables and slots
        slot_names = ctx.optimizer.slots if home.slots_in_buckets else ()
        need = sum(s.nbytes for s in specs) * (self.workers + 1 + len(slot_names))
        self.buckets = GradientBuckets(
            self.comm,
            specs,
            self.tc.bucket_bytes,
            slot_names,
            shared=node_shared(ctx.cluster, need),
        )
        home.attach(self.buckets, specs)
        self.step_count = self.clock = self.updates = 0
        self.stopped = 0  # the signal every replica agreed to stop on (0: none)
        self.stop_asked = 0  # a hook on this replica asked to stop the run
        self.timeline = job_timeline(ctx.job, "worker", self.role.task)
        self.phases = Phases(self.timeline)
        self.clip = global_norm_clip(ctx.oc.clip_norm)

    def train(self) -> TrainResult:
        try:
            result = self._train()
        finally:  # (page-locked buffers released whatever happened: the process may go on)
            self.device.unpin()
        self.rows.end(self.clock)
        return result

    def _train(self) -> TrainResult:
        self.rows.start()
        start_step = self._start()
        run = Run(
            self.ctx.job,
            self.role,
            start_step,
            target_steps(self.tc.steps, self.tc.epochs, self.per_epoch),
            lambda: self.step_count,
            self.save,
            lambda: {k: v.copy() for k, v in self.home.host_params().items()},
            self._hook_stop,
            self._validate if self.prep.val is not None else None,
            self.home.live,
            mode=self.ctx.mode,
        )
        session = Session(self.ctx.job, run, self.ctx.hooks, self.timeline)
        session.loop(self)
        arrays = list(self.home.host_params().values())  # what the replica check compares
        check_replicas(self.comm, arrays, self.step_count)
        session.done(
            f"; replica crc32 {replica_hash(arrays):08x}; "
            f"{self.buckets.reduce_seconds:.2f} s reducing and updating after backward"
        )
        result, gathered = session.finish(
            self.comm,
            start_step,
            "the replicas' summaries",
            stopped_by=self.stopped,
            before_end=lambda: recompute_at_end(
                self.ctx, lambda x: self.rows.evaluated(x, self.home.live)
            ),
        )
        if self.ctx.cluster.is_chief:
            if self.stopped:
                say_preempted(self.role, self.stopped, self.ctx.job)
            self._report(result, gathered)
        self.home.release(self.buckets)
        self.device.unpin()  # (before the buckets' memory goes)
        self.buckets.close()
        return result

    def _report(self, result: TrainResult, gathered: list[Any]) -> None:
        """Chief: the test split's metrics and the final line."""
        assert self.prep.test is not None
        x, params = self.rows.evaluated(self.prep.test[0], self.home.live)
        report(
            self.ctx.cluster,
            self.model,
            self.device,
            params,
            (x, self.prep.test[1]),
            result,
            gathered,
        )

    def _validate(self) -> dict[str, float]:
        assert self.prep.val is not None
        x, params = self.rows.evaluated(self.prep.val[0], self.home.live)
        return evaluate_on(self.model, self.device, params, (x, self.prep.val[1]))

    def _check_losses(self, step: int) -> None:
        """The first replica whose loss is not finite, if any, ends the job on every replica:
        all of them see every replica's loss once the step is shared."""
        losses = self.buckets.losses()
        bad = [task for task, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:
            self._not_finite(bad[0], losses[bad[0]], step)

    def _not_finite(self, task: int, loss: float | str, step: int) -> NoReturn:
        """End the job on every replica: NonFinite, said by the chief."""
        message = loss_not_finite(task, loss, step, self.ctx.mode.takes_clip_norm)
        raise NonFinite(message) if self.ctx.cluster.is_chief else AlreadyReported(message)

    def _first_loss_and_grads(
        self, params: dict[str, Any], x: Any, y: Any, grads: dict[str, Any], ready: Any
    ) -> float:
        """This replica's first step, its gradient buffers checked (first_loss_and_grads);
        the replicas agree on a mistake (one small allreduce, this step only), and the
        first replica that found it says it, before the step is applied or pushed."""
        loss, problem = first_loss_and_grads(self.model, params, x, y, grads, ready)
        mine = self.workers - self.role.task if problem else 0  # the lowest task wins
        worst = agree_max(self.comm, [mine], "the first step's gradient check")[0]
        if worst:
            raise said_once(
                problem or "another replica's gradients were not written", worst == mine
            )
        return loss

    def _start(self) -> int:
        """The chief's initial or restored state, broadcast: every replica starts identical.
        Returns the start global_step; sets the data position."""
        header = np.zeros(2, np.int64)  # start step, data position (batches used per worker)
        if self.ctx.cluster.is_chief:
            self.home.set_initial(self.prep)
            header[:] = self.prep.start_step, self._restored_position()
        broadcast(self.comm, [header])
        self.buckets.share()
        self.home.shared_initial(self.buckets)
        self.step_count, self.clock = int(header[0]), int(header[1])
        if self.ctx.cluster.is_chief and self.tc.steps and self.step_count >= self.tc.steps:
            say_nothing_to_train(self.role, self.step_count, self.tc.steps)
        start, stop = self.prep.rows
        buckets = self.buckets
        detail(
            self.role,
            f"sync replica: train rows [{start}, {stop}), {self.per_epoch} batches of "
            f"{self.tc.batch_size} an epoch, {len(buckets.buckets)} bucket(s) "
            + (
                "updated where they lie (one replica)"
                if buckets.solo
                else "updated in node shared memory"
                if buckets.shared
                else "updated through Ireduce_scatter and Iallgatherv"
            )
            + (f", resuming at batch {self.clock}" if self.clock else ""),
        )
        return self.step_count

    def _restored_position(self) -> int:
        """Chief: the data position the replicas resume at (batches used per worker): the
        checkpoint's, when every worker of it had used as many as there are replicas now
        (else 0, said)."""
        prep, role = self.prep, self.role
        clocks = prep.clocks or []  # (none where not restored: startup.data_position)
        same = bool(clocks) and len(clocks) == self.workers and len(set(clocks)) == 1
        if prep.restored is not None:
            say_restored(role, prep.start_step, prep.restored, prep.model_changed)
            lost = prep.position_lost or (
                f"the checkpoint's workers had used different numbers of batches "
                f"({clocks}), and the replicas share one data position"
                if clocks and not same
                else ""
            )
            if lost:
                say_position_lost(role, lost)
        return clocks[0] if same else 0

    def _hook_stop(self) -> None:
        self.stop_asked = 1  # said at the next step's agreement: all replicas stop together

    def save(self) -> PendingSave:
        slots = self.home.whole_slots(self.buckets)
        variables = {**self.home.host_params(), **self.model.state()}  # (the chief's buffers)
        return self.rows.save(self.step_count, variables, slots, [self.clock] * self.workers)

    def batches(self) -> Iterable[tuple[int, Any, Any]]:
        assert self.prep.train is not None
        return self.prep.train.batches(
            self.tc.batch_size,
            self.tc.seed,
            self.role.task,
            self.tc.epochs,
            start_batch=self.clock,
            per_epoch=self.per_epoch,
        )

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Gradients of this replica's batch, averaged over all; every replica applies the
        same update (or all stop together: a signal, or a loss that is not finite)."""
        step = self.step_count
        if self.tc.steps and step >= self.tc.steps:
            return None
        self.phases.begin()
        lr = learning_rate(self.ctx.oc, step)
        loss, host_grads, votes = self._compute(x, y, lr, step)
        go = self._agree(loss, step, votes)
        if go:
            self.rows.push(host_grads, lr, self.clock)
            self.phases.mark("push and ack", self.rows.pulls)
        mean_loss = self.buckets.finish()
        self.phases.mark("reduce and update")
        if not go:
            return None
        self.home.apply_mean(lr, step, self.timeline is not None)
        self.phases.mark("update on the device", not self.device.on_host)
        if not self.rows.vote_after_compute:  # (voted on already otherwise)
            self._check_losses(step)
        self.step_count, self.clock, self.updates = step + 1, self.clock + 1, self.updates + 1
        if self.tc.check_every and self.step_count % self.tc.check_every == 0:
            check_replicas(self.comm, list(self.home.host_params().values()), self.step_count)
        return StepInfo(self.step_count, mean_loss, epoch, self.updates)

    def _compute(
        self, x: Any, y: Any, lr: float, step: int
    ) -> tuple[float, dict[str, Any], list[int]]:
        """Forward and backward on this replica's batch, its buckets reduced as backward
        fills them; the loss, the host gradient buffers (table rows' included) and this
        replica's votes (a stop signal, a hook's request)."""
        buckets, home = self.buckets, self.home
        x, params, host_grads = self.rows.inputs(x, home.live, home.grads)
        self.phases.mark("pull", self.rows.pulls)
        x, y, params, grads, staged = home.on_device(x, y, params, host_grads)
        self.phases.mark("copy in", not self.device.on_host)
        # whether to stop (a signal on any replica or forwarded by a PS rank, a hook's
        # request) is agreed while backward runs, so buckets reduced meanwhile are updated
        # then too; not applied when stopping: the checkpoint is exact at `step`
        votes = [self.rows.signal(), self.stop_asked]
        late = self.rows.vote_after_compute
        buckets.start_step(home.update_rule(lr, step), self.clip, None if late else votes)
        # (one copy in shared memory: nothing is reduced during backward, so nothing to say)
        ready = staged.ready(None if buckets.shared else buckets.ready)
        if self.updates:
            loss = self.model.loss_and_grads(params, x, y, grads, ready=ready)
        else:
            loss = self._first_loss_and_grads(params, x, y, grads, ready)
        staged.finish()
        self.phases.mark("compute")
        return loss, host_grads, votes

    def _agree(self, loss: float, step: int, votes: list[int]) -> bool:
        """The replicas' agreement on this step: whether to go on (no stop signal, no hook
        asked to stop); a loss that is not finite anywhere ends the job (hybrid: checked
        here, before any row is pushed)."""
        buckets = self.buckets
        buckets.set_loss(loss)
        if self.rows.vote_after_compute:  # (hybrid) after compute: every replica has pulled
            buckets.vote([*votes, 0 if math.isfinite(loss) else self.role.task + 1])
        stopped, asked, *bad = buckets.agreed()
        if bad and bad[0]:  # nothing of the step is pushed
            task = bad[0] - 1
            self._not_finite(task, loss if task == self.role.task else "not finite", step)
        self.stopped = stopped
        self.phases.mark("agreement")
        return not (stopped or asked)

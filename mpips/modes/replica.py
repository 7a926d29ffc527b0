"""A synchronous replica: the engine of sync mode (every variable) and of hybrid mode (the
dense part). Every worker computes gradients on its own batch. Each replica owns one part
of every bucket of variables: it takes the mean of the replicas' gradients for that part and
applies the same optimizer code as the async path to it, and the replicas share the result
(allreduce.py: one copy in the node's shared memory, or reduce-scatter and allgather across
nodes). Every update is applied once and the replicas are identical by construction (with a
copy each, checked every ``train.check_every`` steps and at the end). global_step advances
once per aggregated step, identically on every replica.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np

from ..allreduce import (
    GradientBuckets,
    Update,
    agree_max,
    broadcast,
    check_replicas,
    replica_hash,
    stop_from_ps,
)
from ..data.batches import full_batches
from ..device.backend import Device, StagedGradients
from ..errors import AgreedError, AlreadyReported, NonFinite
from ..job import Job
from ..models.contract import first_loss_and_grads, said_once
from ..models.variables import VariableSpec
from ..optim import Optimizer, global_norm_clip, learning_rate
from ..process import preemption, settings
from ..process.log import detail, log
from ..process.memory import SHM_DIR, shared_memory_free
from ..run.hooks import Hook, PendingSave, Run, StepInfo
from ..run.session import (
    Session,
    TrainResult,
    evaluate_on,
    loss_not_finite,
    report,
    save_whole,
    say_nothing_to_train,
    say_position_lost,
    say_preempted,
    say_restored,
    target_steps,
)
from ..run.startup import Prepared
from ..run.summaries import job_timeline
from ..store import Cluster
from .base import Mode


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


def _batches_per_epoch(job: Job, rows: int, workers: int) -> int:
    """Full batches every worker can make each epoch (the same count on all replicas)."""
    per = full_batches(rows, workers, job.train.batch_size)
    if per == 0:
        raise AgreedError(
            f"{rows} train rows give some of the {workers} workers less than "
            f"one batch of {job.train.batch_size}: lower train.batch_size"
        )
    return per


class Replica:
    """One worker as a synchronous replica: compute, average, apply, once per batch."""

    slots_in_buckets = True  # the optimizer slots are bucket views too (updated in parts)

    def __init__(
        self,
        job: Job,
        mode: Mode,
        cluster: Cluster,
        optimizer: Optimizer,
        prep: Prepared,
        device: Device,
    ):
        self.job, self.mode, self.cluster, self.optimizer = job, mode, cluster, optimizer
        self.model, self.prep, self.device = prep.model, prep, device
        model = prep.model
        self.role, self.tc, self.oc = cluster.role, job.train, job.optimizer
        self.comm, self.workers = cluster.workers, cluster.layout.num_workers
        self.listen_to_ps = cluster.is_chief and cluster.layout.num_ps > 0
        specs = self._bucketed(model.variables())
        # variables, slots and gradients are views into the buckets; each replica updates
        # its part of every bucket, and the batch loss rides in the last one
        # shared memory holds every replica's gradients, the variables and their slots
        slot_names = optimizer.slots if self.slots_in_buckets else ()
        need = sum(s.nbytes for s in specs) * (self.workers + 1 + len(slot_names))
        self.buckets = GradientBuckets(
            self.comm,
            specs,
            self.tc.bucket_bytes,
            slot_names,
            shared=node_shared(cluster, need),
        )
        self.params = {s.name: self.buckets.values[s.name] for s in specs}
        self.slots = {s.name: self.buckets.slots[s.name] for s in specs}
        self.grads = {s.name: self.buckets.grads[s.name] for s in specs}  # (not the loss)
        self.live: dict[str, Any] = self.params  # what the model reads (run.params)
        self.per_epoch = _batches_per_epoch(job, prep.info.rows["train"], self.workers)
        self.step_count = self.clock = self.updates = 0
        self.stopped = 0  # the signal every replica agreed to stop on (0: none)
        # the replicas vote on stopping before compute, so buckets reduced during backward
        # are updated and shared then (hybrid: after compute, with the loss: nothing is
        # updated before its pushes, and nothing of a step whose loss is not finite pushed)
        self.vote_after_compute = False
        self.stop_asked = 0  # a hook on this replica asked to stop the run
        self.timeline = job_timeline(job, "worker", self.role.task)
        self.clip = global_norm_clip(self.oc.clip_norm)

    def train(self, extra_hooks: list[Hook]) -> TrainResult:
        try:
            return self._train(extra_hooks)
        finally:  # (page-locked buffers released whatever happened: the process may go on)
            self.device.unpin()

    def _train(self, extra_hooks: list[Hook]) -> TrainResult:
        start_step = self._start()
        run = Run(
            self.job,
            self.role,
            start_step,
            target_steps(self.tc.steps, self.tc.epochs, self.per_epoch),
            lambda: self.step_count,
            self.save,
            lambda: {k: v.copy() for k, v in self.host_params().items()},
            self._hook_stop,
            self._validate if self.prep.val is not None else None,
            self.live,
            mode=self.mode,
        )
        session = Session(self.job, run, extra_hooks, self.timeline)
        session.loop(self)
        arrays = list(self.host_params().values())  # what the replica check compares
        check_replicas(self.comm, arrays, self.step_count)
        session.done(
            f"; replica crc32 {replica_hash(arrays):08x}; "
            f"{self.buckets.reduce_seconds:.2f} s reducing and updating after backward"
        )
        result, gathered = session.finish(
            self.comm, start_step, "the replicas' summaries", stopped_by=self.stopped
        )
        if self.cluster.is_chief:
            if self.stopped:
                say_preempted(self.role, self.stopped, self.job)
            self._report(result, gathered)
        if self.buckets.shared:  # the shared memory goes: params (run.params) become copies
            for name, value in self.params.items():
                self.params[name] = value.copy()
        self.device.unpin()  # (before the buckets' memory goes)
        self.buckets.close()
        return result

    def _report(self, result: TrainResult, gathered: list[Any]) -> None:
        """Chief: the test split's metrics and the final line."""
        assert self.prep.test is not None
        report(self.cluster, self.model, self.device, self.live, self.prep.test, result, gathered)

    def _inputs(self, x: Any) -> tuple[Any, dict[str, Any], dict[str, Any]]:
        """The batch as the model takes it, the parameters it reads and where its gradients
        go (the buckets)."""
        return x, self.params, self.grads

    def _signal(self) -> int:
        """A stop signal this replica knows of: its own, or one a PS rank forwarded."""
        return preemption.requested() or (
            stop_from_ps(self.cluster.comm) if self.listen_to_ps else 0
        )

    def _check_losses(self, step: int) -> None:
        """The first replica whose loss is not finite, if any, ends the job on every replica:
        all of them see every replica's loss once the step is shared."""
        losses = self.buckets.losses()
        bad = [task for task, loss in enumerate(losses) if not math.isfinite(loss)]
        if bad:
            self._not_finite(bad[0], losses[bad[0]], step)

    def _not_finite(self, task: int, loss: float | str, step: int) -> NoReturn:
        """End the job on every replica: NonFinite, said by the chief."""
        message = loss_not_finite(task, loss, step, self.mode.takes_clip_norm)
        raise NonFinite(message) if self.cluster.is_chief else AlreadyReported(message)

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

    def _push_rows(self, grads: dict[str, Any], lr: float) -> None:
        """Hybrid mode sends its table rows' gradients to the PS tasks (sync has none)."""

    def _start(self) -> int:
        """The chief's initial or restored state, broadcast: every replica starts identical.
        Returns the start global_step; sets the data position."""
        prep, role = self.prep, self.role
        header = np.zeros(2, np.int64)  # start step, data position (batches used per worker)
        if self.cluster.is_chief:
            self._set_initial(prep)
            clocks = prep.clocks or []  # (none where not restored: startup.data_position)
            same = bool(clocks) and len(clocks) == self.workers and len(set(clocks)) == 1
            header[:] = prep.start_step, clocks[0] if same else 0
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
        broadcast(self.comm, [header])
        self.buckets.share()
        self._shared_initial()
        self.step_count, self.clock = int(header[0]), int(header[1])
        if self.cluster.is_chief and self.tc.steps and self.step_count >= self.tc.steps:
            say_nothing_to_train(role, self.step_count, self.tc.steps)
        start, stop = prep.rows
        detail(
            role,
            f"sync replica: train rows [{start}, {stop}), {self.per_epoch} batches of "
            f"{self.tc.batch_size} an epoch, {len(self.buckets.buckets)} bucket(s) "
            + (
                "updated where they lie (one replica)"
                if self.buckets.solo
                else "updated in node shared memory"
                if self.buckets.shared
                else "updated through Ireduce_scatter and Iallgatherv"
            )
            + (f", resuming at batch {self.clock}" if self.clock else ""),
        )
        return self.step_count

    def _bucketed(self, specs: list[VariableSpec]) -> list[VariableSpec]:
        """The variables the buckets hold (every one, here)."""
        return specs

    def _set_initial(self, prep: Prepared) -> None:
        """Chief: the initial or restored variables and slots, before they are shared."""
        for name in self.params:
            self.params[name][...] = prep.values[name]
            for k in self.optimizer.slots:
                self.slots[name][k][...] = prep.slots[f"{name}/{k}"]

    def _shared_initial(self) -> None:
        """Every replica, once the chief's initial state is its own (buckets.share)."""

    def host_params(self) -> dict[str, np.ndarray]:
        """This replica's variables in host memory (checkpoints, the replica check)."""
        return self.params

    def _validate(self) -> dict[str, float]:
        assert self.prep.val is not None
        return evaluate_on(self.model, self.device, self.live, self.prep.val)

    def _hook_stop(self) -> None:
        self.stop_asked = 1  # said at the next step's agreement: all replicas stop together

    def whole_slots(self) -> dict[str, np.ndarray]:
        """Chief: every optimizer slot whole (each replica updates only its part), by name
        as a checkpoint holds them."""
        self.buckets.collect_slots()
        return {f"{n}/{k}": a for n, s in self.slots.items() for k, a in s.items()}

    def save(self) -> PendingSave:
        flat = self.whole_slots()
        return save_whole(
            self.job,
            self.cluster,
            self.step_count,
            {**self.host_params(), **self.model.state()},  # (and the chief's buffers)
            flat,
            [self.clock] * self.workers,
        )

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

    def _on_device(
        self, x: Any, y: Any, params: dict[str, Any], host_grads: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any], dict[str, Any], StagedGradients]:
        """The batch, the variables and the gradient buffers where the model computes, and
        how gradients get back to the host buffers: on the CPU the buckets themselves (a
        GPU replica is a DeviceReplica)."""
        return x, y, params, host_grads, self.device.staged(host_grads, host_grads)

    def _update_rule(self, lr: float, step: int) -> Update:
        """What a replica does with its part of each bucket's mean gradient: apply it."""

        def update(var: Any, grad: Any, slots: dict[str, Any]) -> None:
            self.optimizer.apply(var, grad, slots, lr, step + 1)

        return update

    def _apply_mean(self, lr: float, step: int) -> None:
        """After the step is shared (the variables in the buckets are updated already)."""

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Gradients of this replica's batch, averaged over all; every replica applies the
        same update (or all stop together: a signal, or a loss that is not finite)."""
        step = self.step_count
        if self.tc.steps and step >= self.tc.steps:
            return None
        buckets, tl = self.buckets, self.timeline
        t = tl.now() if tl else 0.0  # the timeline's phases (summary.timeline), if on
        x, params, host_grads = self._inputs(x)
        if tl and params is not self.params:
            t = tl.span("pull", t)
        x, y, params, grads, staged = self._on_device(x, y, params, host_grads)
        if tl and not self.device.on_host:
            t = tl.span("copy in", t)
        lr = learning_rate(self.oc, step)

        # whether to stop (a signal on any replica or forwarded by a PS rank, a hook's
        # request) is agreed while backward runs, so buckets reduced meanwhile are updated
        # then too; not applied when stopping: the checkpoint is exact at `step`
        late = self.vote_after_compute
        votes = [self._signal(), self.stop_asked]
        buckets.start_step(self._update_rule(lr, step), self.clip, None if late else votes)
        # (one copy in shared memory: nothing is reduced during backward, so nothing to say)
        ready = staged.ready(None if buckets.shared else buckets.ready)
        if self.updates:
            loss = self.model.loss_and_grads(params, x, y, grads, ready=ready)
        else:
            loss = self._first_loss_and_grads(params, x, y, grads, ready)
        staged.finish()
        if tl:
            t = tl.span("compute", t)
        buckets.set_loss(loss)
        if late:  # (hybrid) after compute: every replica has pulled, and its loss
            buckets.vote([*votes, 0 if math.isfinite(loss) else self.role.task + 1])
        stopped, asked, *bad = buckets.agreed()
        if bad and bad[0]:  # nothing of the step is pushed
            task = bad[0] - 1
            self._not_finite(task, loss if task == self.role.task else "not finite", step)
        self.stopped, go = stopped, not (stopped or asked)
        if tl:
            t = tl.span("agreement", t)
        if go:
            self._push_rows(host_grads, lr)
            if tl and params is not self.params:
                t = tl.span("push and ack", t)
        mean_loss = buckets.finish()
        if tl:
            t = tl.span("reduce and update", t)
        if not go:
            return None
        self._apply_mean(lr, step)
        if tl and not self.device.on_host:
            tl.span("update on the device", t)
        if not late:  # (voted on already otherwise)
            self._check_losses(step)
        self.step_count, self.clock, self.updates = step + 1, self.clock + 1, self.updates + 1
        if self.tc.check_every and self.step_count % self.tc.check_every == 0:
            check_replicas(self.comm, list(self.host_params().values()), self.step_count)
        return StepInfo(self.step_count, mean_loss, epoch, self.updates)

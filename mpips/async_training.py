"""Asynchronous training (``train.mode = "async"``): PS tasks serve the variables from their
windows; each worker pulls, computes gradients on its own batch and pushes an update
without waiting for the others (bounded by ``train.max_staleness``). The chief also
initialises or restores the variables, commits checkpoints and evaluates at the end."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from . import checkpoint, preemption
from .backend import Device
from .data import epoch_batches, full_batches
from .errors import AlreadyReported, NonFinite
from .hooks import Hook, PendingSave, Run, StepInfo
from .job import Job, store_placement
from .log import detail, log
from .model import first_loss_and_grads, said_once
from .optim import Optimizer, clip_by_global_norm, learning_rate
from .placement import imbalance, slot_placement
from .run import (
    Session,
    TrainResult,
    evaluate_on,
    loss_not_finite,
    manifest_meta,
    report,
    say_nothing_to_train,
    say_preempted,
    say_restored,
    target_steps,
)
from .startup import Prepared, table_initial
from .store import (
    NO_MORE_TICKETS,
    STALL_TIMEOUT,
    Cluster,
    RunControl,
    StoreClient,
    Watchdog,
    Windows,
    barrier,
    has_inboxes,
    publish_start_step,
    serve,
    stall_limit,
    start_limit,
    updates_in_place,
    watched_barrier,
)
from .summaries import job_timeline, ps_summaries


def train_async(
    job: Job,
    cluster: Cluster,
    model: Any,
    optimizer: Optimizer,
    prep: Prepared,
    hooks: list[Hook],
    device: Device,
) -> TrainResult:
    """Every rank: create the windows, then PS tasks serve and workers train until the
    chief ends the run."""
    windows = open_store(job, cluster, model, optimizer, prep)
    if cluster.is_ps:
        result = run_ps(job, cluster, windows, optimizer, cluster.layout.num_ps, model)
    else:
        replicas = job.train.mode == "sync_replicas"
        kind = ReplicasWorker if replicas else AsyncWorker
        result = kind(job, cluster, windows, model, optimizer, prep, device).train(hooks)
    return close_store(cluster, windows, result)


def open_store(
    job: Job, cluster: Cluster, model: Any, optimizer: Optimizer, prep: Prepared
) -> Windows:
    """Every rank: the windows of what the PS tasks hold (store_placement), each PS task's
    memory filled (restored state, fresh table partitions), up to the start barrier."""
    placement = store_placement(job, model, cluster.layout.num_ps)
    replicas = job.train.mode == "sync_replicas"  # every push goes through the inboxes
    # zero copy: the workers apply their updates in PS memory (store/stripes.py), else a
    # PS task applies those of stateful optimizers and sync_replicas
    in_place = updates_in_place(placement, job.train.zero_copy)
    inboxes = has_inboxes(placement, job.train.zero_copy, optimizer.stateful or replicas)
    if (cluster.is_ps and inboxes) or (in_place and not cluster.is_ps):
        optimizer.prepare()  # its fused kernel compiles meanwhile, not at the first update
    cluster.check_placement(placement)
    warning = imbalance(placement, job.layout.placement)
    if warning and cluster.is_chief:
        log(cluster.role, warning)
    slots = slot_placement(placement, optimizer.slots) if optimizer.stateful else None
    windows = Windows(
        cluster.comm,
        cluster.layout,
        placement,
        slots,
        inboxes,
        row_capacity=job.train.batch_size * max(1, prep.info.max_nnz),
        shared=job.train.zero_copy,
    )
    if prep.local:  # a PS task: restored state or fresh table partitions
        windows.fill_own(cluster.role.task, prep.local)
    if cluster.is_ps and windows.inboxes:
        # the step it starts from is set before any worker reads it (sync_replicas) or an
        # update is posted (async: a worker counts its update before it is applied)
        publish_start_step(windows, cluster.role.task, cluster.rank, prep.start_step)
    barrier(cluster.comm, "the start of training")  # filled before the chief raises ready
    return windows


def run_ps(
    job: Job,
    cluster: Cluster,
    windows: Windows,
    optimizer: Optimizer,
    num_shards: int,
    model: Any = None,
) -> TrainResult:
    """A PS task: serve until the chief ends the run (applying updates itself for stateful
    optimizers and sync_replicas), writing its checkpoint shard (one of ``num_shards``)
    when asked: its table partitions sparsely where that pays (with ``model``, whose
    initial rows the untouched ones are)."""
    task = cluster.role.task
    tables = sparse_tables(job, windows, task, model, optimizer)

    def write_shard(step: int, variables: dict[str, Any], slots: dict[str, Any]) -> None:
        checkpoint.write_shard(job.checkpoint.dir, step, task, num_shards, variables, slots, tables)

    replicas = job.train.mode == "sync_replicas"
    timeline = job_timeline(job, "ps", task)
    apply = optimizer.apply if windows.inboxes else None
    rate = None  # this PS's apply rate, when it applies and summaries are on
    if apply is not None and (rate := ps_summaries(job, task)):
        apply = rate.timed(apply)
    if timeline is not None:
        apply = apply and timeline.timed("apply", apply)
        write_shard = timeline.timed("checkpoint write", write_shard)
    serve(
        cluster,
        windows,
        apply,
        optimizer.slots,
        write_shard if job.checkpoint.dir else None,
        preemption.requested,
        aggregate=(job.train.replicas_to_aggregate or cluster.layout.num_workers)
        if replicas
        else 0,
        on_applied=rate.applied if rate else None,
    )
    if rate is not None:
        rate.close()
    if timeline is not None:
        timeline.write()
    return TrainResult(cluster.role, 0, 0)


def sparse_tables(
    job: Job, windows: Windows, task: int, model: Any, optimizer: Optimizer
) -> checkpoint.SparseTables | None:
    """What PS ``task`` needs to write its table partitions sparsely: their rows, the seed
    and the model's initial values; None (every array whole) without a model or tables, or
    with MPIPS_SPARSE_CHECKPOINTS=0."""
    rows = {e.name: e.rows for e in windows.placement.on_ps(task) if e.table and e.rows}
    if model is None or not rows or os.environ.get("MPIPS_SPARSE_CHECKPOINTS", "1") == "0":
        return None
    return checkpoint.SparseTables(rows, job.model.init_seed, table_initial(model, optimizer))


def save_from_ps(
    job: Job,
    cluster: Cluster,
    windows: Windows,
    step: int,
    clocks: list[int],
    chief_part: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> PendingSave:
    """Chief: ask every PS task to write its shard of a checkpoint at ``step`` (in parallel,
    while the chief trains on); ``chief_part`` (variables, slots): what the chief holds
    itself, written now as one more shard (hybrid mode's dense part). The manifest is
    committed once every shard is written (PendingSave.commit)."""
    control, c = RunControl(windows), job.checkpoint
    num_ps = windows.placement.num_ps
    number, asked = control.request_checkpoint(step), time.monotonic()
    variables, slots = checkpoint.index_of(windows.placement, windows.slots)
    shards = num_ps
    if chief_part is not None:
        shards += 1
        checkpoint.write_shard(c.dir, step, num_ps, shards, *chief_part)
        variables.update(checkpoint.whole_index(chief_part[0], num_ps))
        slots.update(checkpoint.whole_index(chief_part[1], num_ps))

    def commit(block: bool) -> Path | None:
        if block:
            control.wait_shards(number, step, STALL_TIMEOUT - (time.monotonic() - asked))
        elif control.shards_missing(number):
            if time.monotonic() - asked > STALL_TIMEOUT:
                control.wait_shards(number, step, 0)  # raises, naming the PS tasks
            return None
        return checkpoint.commit(
            c.dir,
            step,
            shards,
            variables,
            slots,
            manifest_meta(job, cluster, clocks),
            c.max_to_keep,
        )

    return PendingSave(step, commit)


def close_store(cluster: Cluster, windows: Windows, result: TrainResult) -> TrainResult:
    """Every rank, once the chief has ended the run (its last checkpoint and evaluation are
    done): the end barrier (a backstop only: a hung chief is named first by the PS tasks'
    watchdogs), the signal that stopped the run, the windows freed."""
    barrier(cluster.comm, "the end of the run", stall_limit(cluster.comm.size) + 5)
    result.stopped_by = RunControl(windows).stop_signal()
    windows.free()  # collective, so never in a finally: a failing rank must reach Abort
    return result


class AsyncWorker:
    """One worker task: pull, compute, push, once per batch (``step``)."""

    def __init__(
        self,
        job: Job,
        cluster: Cluster,
        windows: Windows,
        model: Any,
        optimizer: Optimizer,
        prep: Prepared,
        device: Device,
    ):
        self.job, self.cluster, self.windows, self.device = job, cluster, windows, device
        self.model, self.optimizer, self.prep = model, optimizer, prep
        self.role, self.tc, self.oc = cluster.role, job.train, job.optimizer
        replicas = job.train.mode == "sync_replicas"
        stateful = optimizer.stateful or replicas
        self.client = StoreClient(
            windows, self.role.task, stateful, optimizer.apply, optimizer.slots
        )
        self.control = self.client.control
        self.stats = Staleness()
        self.watchdog = Watchdog(self.control, cluster.layout, self.role.task)
        self.timeline = job_timeline(job, "worker", self.role.task)
        self.clock = 0  # batches of this worker's part used (its data position)
        self.updates = 0

    def train(self, extra_hooks: list[Hook]) -> TrainResult:
        control = self.control
        per_epoch = epoch_batches(
            self.prep.info.rows["train"], self.cluster.layout.num_workers, self.tc.batch_size
        )
        run = Run(
            self.job,
            self.role,
            self.prep.start_step,
            target_steps(self.tc.steps, self.tc.epochs, per_epoch),
            control.global_step,
            self.start_save,
            lambda: {k: v.copy() for k, v in self.client.pull().items()},
            control.end_tickets,
            self._validate if self.prep.val is not None else None,
        )
        # hooks begin before the chief raises ready, so their set-up (the progress bar's)
        # does not delay the chief's first update behind every other worker's
        session = Session(self.job, run, extra_hooks, self.timeline)
        start_step = self._start()
        session.loop(self)
        self.client.settle()  # its last update is applied before it says it is done
        control.publish_clock(self.role.task, self.clock, done=True)
        session.done(
            f"; {run.save_seconds:.2f} s of it writing checkpoints, the chief's duty"
            if run.save_seconds
            else ""
        )
        # every push has landed, so global_step is final; a worker that never gets here is hung
        watched_barrier(self.cluster.workers, "the other workers", self.watchdog.check)
        summary = self.stats.summary()
        result, gathered = session.finish(
            self.cluster.workers, start_step, "the workers' summaries", summary, staleness=[summary]
        )
        if self.cluster.is_chief:
            self._conclude(result, gathered)
        return result

    def _validate(self) -> dict[str, float]:
        """Chief: the model now on the validation split (the others train on meanwhile)."""
        assert self.prep.val is not None
        x, ids = self.model.prepare(self.prep.val[0])
        return evaluate_on(self.model, self.device, self.client.pull(ids), (x, self.prep.val[1]))

    def batches(self) -> Iterable[tuple[int, Any, Any]]:
        assert self.prep.train is not None  # host memory; batches go to the device one at a time
        return self.prep.train.batches(
            self.tc.batch_size, self.tc.seed, self.role.task, self.tc.epochs, start_batch=self.clock
        )

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Take a ticket (or stop), pull, compute, push: one update of the global step."""
        control, client, model, tl = self.control, self.client, self.model, self.timeline
        t = tl.now() if tl else 0.0  # the timeline's phases (summary.timeline), if on
        if preemption.requested():  # every worker stops at its next ticket
            control.request_stop(preemption.requested())
            return None
        ticket, pulled_at, lead = control.begin_step(self.clock)
        if ticket >= (self.tc.steps or NO_MORE_TICKETS):
            return None
        bound = self.tc.max_staleness
        if bound is not None and lead > bound:  # wait for the slowest worker
            lead = control.wait_for_slowest(self.clock, bound, self.watchdog.check)
            pulled_at = control.global_step()
        if tl:
            t = tl.span("ticket and staleness wait", t)
        x, ids = model.prepare(x)  # sparse models: the batch's unique ids (rows to pull)
        device = self.device
        params = device.stage_in(client.pull(ids))
        x, y = device.to_device(x), device.to_device(y)
        grads = device.mirrors(client.gradients())  # on the CPU: the push buffers themselves
        if tl:
            t = tl.span("pull", t)
        loss = self._loss_and_grads(params, x, y, grads)
        if not math.isfinite(loss):  # nothing of it is pushed; said once over all workers
            message = loss_not_finite(self.role.task, loss, pulled_at, self.job.train.mode)
            raise NonFinite(message) if control.claim_failure() else AlreadyReported(message)
        clip_by_global_norm(list(grads.values()), self.oc.clip_norm)
        lr = learning_rate(self.oc, pulled_at)
        if not (self.optimizer.stateful or client.applies_in_place):
            for g in grads.values():
                g *= -lr  # plain SGD: push the delta, Accumulate adds it on the PS
        device.stage_out(grads, client.gradients())
        if tl:
            t = tl.span("compute", t)
        # applied while this worker prepares its next batch; with a staleness bound it
        # waits, so the clock it publishes counts only updates every pull can see (zero
        # copy: applied here, as update ticket + 1, the count a PS task would give it)
        client.push(lr, wait=bound is not None, t=ticket + 1)
        step = control.end_step(self.role.task)  # global_step and this worker's clock
        if tl:
            tl.span("push and ack", t)
        self.clock, self.updates = self.clock + 1, self.updates + 1
        self.stats.add(lead, step - 1 - pulled_at)
        return StepInfo(step, loss, epoch, self.updates, lead, step - 1 - pulled_at)

    def _loss_and_grads(self, params: Any, x: Any, y: Any, grads: dict[str, Any]) -> float:
        """The model's loss and gradients; on this worker's first step with its gradient
        buffers checked (first_loss_and_grads), a mistake said once over all workers
        before anything is pushed."""
        if self.updates:
            return self.model.loss_and_grads(params, x, y, grads)
        loss, problem = first_loss_and_grads(self.model, params, x, y, grads)
        if problem:
            raise said_once(problem, self.control.claim_failure())
        return loss

    def _start(self) -> int:
        """Chief: write variables and slots, set the counters, raise ready. Others: wait for it.
        Returns the start global_step; sets this worker's clock (its data position)."""
        control, role, prep, tc = self.control, self.role, self.prep, self.tc
        workers = self.cluster.layout.num_workers
        if self.cluster.is_chief:
            clocks = prep.clocks
            if prep.restored is None:  # else the PS tasks have restored their shards
                self.client.initialise(prep.values, prep.slots)
            control.set_counters(
                prep.start_step, clocks if clocks and len(clocks) == workers else None
            )
            control.raise_ready()
            if prep.restored is not None:
                say_restored(role, prep.start_step, prep.restored)
                if clocks and len(clocks) != workers:
                    log(
                        role,
                        f"data position not restored: the checkpoint was written by "
                        f"{len(clocks)} workers, this run has {workers} (parts start "
                        f"afresh)",
                    )
            if tc.steps and prep.start_step >= tc.steps:
                say_nothing_to_train(role, prep.start_step, tc.steps)
        else:
            control.wait_ready(start_limit(role.task))
        self.clock = int(control.clocks()[0][role.task])
        start, stop = prep.rows
        detail(
            role,
            f"train rows [{start}, {stop}) of {prep.info.rows['train']}, "
            f"batch {tc.batch_size}, pulls {self.client.nbytes / 1e6:.2f} MB per step "
            f"from {self.windows.placement.num_ps} ps task(s)"
            + (
                f", reads {self.client.in_place_bytes / 1e6:.2f} MB in place (zero copy)"
                + (" and applies its updates there" if self.client.applies_in_place else "")
                if self.client.reads_in_place
                else ""
            )
            + (f", resuming at batch {self.clock}" if self.clock else ""),
        )
        return prep.start_step  # global_step itself may have moved on: others are pushing

    def start_save(self) -> PendingSave:
        """Ask every PS task to write its shard (in parallel, while the chief trains on);
        the chief commits the manifest when all are written."""
        control = self.control
        self.client.settle()  # the chief's own last update is in the checkpoint
        step, clocks = control.global_step(), [int(c) for c in control.clocks()[0]]
        return save_from_ps(self.job, self.cluster, self.windows, step, clocks)

    def _conclude(self, result: TrainResult, gathered: list[Any]) -> None:
        """Chief: who made how many updates, staleness, evaluation; then end the run."""
        role = self.role
        stopped = self.control.stop_signal()
        if stopped:
            say_preempted(role, stopped, self.job)
        result.staleness = [g[2] for g in gathered]
        counts = [s["updates"] for s in result.staleness]
        fewer = len(counts) > 1 and counts[0] < 0.8 * sum(counts[1:]) / (len(counts) - 1)
        log(
            role,
            "updates per worker task: "
            + " ".join(map(str, counts))
            + (
                " (the chief made fewer: it also evaluates, logs and commits checkpoints)"
                if fewer
                else ""
            ),
        )
        dropped = [s.get("dropped", 0) for s in result.staleness]
        if self.job.train.mode == "sync_replicas":
            log(role, "gradients dropped as late, per worker task: " + " ".join(map(str, dropped)))
        for task, s in enumerate(result.staleness):
            if s["updates"] and self.job.train.mode == "async":
                detail(role, f"staleness of /job:worker/task:{task}: {Staleness.describe(s)}")
        assert self.prep.test is not None
        x_test, ids = self.model.prepare(self.prep.test[0])
        report(
            self.cluster,
            self.model,
            self.device,
            self.client.pull(ids),
            (x_test, self.prep.test[1]),
            result,
            gathered,
        )
        self.control.end_run()  # the PS tasks may stop serving


class ReplicasWorker(AsyncWorker):
    """A worker of ``train.mode = "sync_replicas"``, TensorFlow's SyncReplicasOptimizer
    through the PS: each step it pulls the variables of the PS tasks' current step, posts
    its gradient tagged with that step, and waits until every PS task has aggregated the
    step (the first ``train.replicas_to_aggregate`` gradients for it, averaged and applied
    once). A gradient that comes after its step was aggregated is dropped, so with backup
    workers (replicas_to_aggregate below the number of workers) a slow worker no longer
    slows every step: it catches up on the next one."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.dropped = 0
        # equal full batches on every worker, as sync replicas make them (checked > 0)
        self.per_epoch = full_batches(
            self.prep.info.rows["train"], self.cluster.layout.num_workers, self.tc.batch_size
        )

    def batches(self) -> Iterable[tuple[int, Any, Any]]:
        assert self.prep.train is not None
        return self.prep.train.batches(
            self.tc.batch_size,
            self.tc.seed,
            self.role.task,
            0,  # ends at train.steps
            start_batch=self.clock,
            per_epoch=self.per_epoch,
        )

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Post a gradient for the PS tasks' current step and wait until they move on."""
        control, client, model, device = self.control, self.client, self.model, self.device
        tl = self.timeline
        t = tl.now() if tl else 0.0
        if preemption.requested():
            control.request_stop(preemption.requested())
            return None
        if control.tickets_ended():  # a stop (a signal or a hook's) ends the tickets
            return None
        tags = client.ps_steps()
        if tags[0] >= self.tc.steps:
            return None
        x, _ = model.prepare(x)
        params = device.stage_in(client.pull())
        x, y = device.to_device(x), device.to_device(y)
        grads = device.mirrors(client.gradients())
        if tl:
            t = tl.span("pull", t)
        loss = self._loss_and_grads(params, x, y, grads)
        if not math.isfinite(loss):
            message = loss_not_finite(self.role.task, loss, tags[0], self.job.train.mode)
            raise NonFinite(message) if control.claim_failure() else AlreadyReported(message)
        device.stage_out(grads, client.gradients())
        if tl:
            t = tl.span("compute", t)
        if not client.push(learning_rate(self.oc, tags[0]), tags):
            self.dropped += 1
        if tl:
            t = tl.span("push and ack", t)
        client.wait_steps(tags, control.tickets_ended)
        if tl:
            tl.span("wait for the step", t)
        self.clock, self.updates = self.clock + 1, self.updates + 1
        control.publish_clock(self.role.task, self.clock)
        self.stats.add(0, 0)
        self.stats.dropped = self.dropped
        return StepInfo(tags[0] + 1, loss, epoch, self.updates)


class Staleness:
    """Per-worker distribution of two staleness measures of its updates.

    * lead: how many updates this worker was ahead of the slowest running worker when it
      pulled (what ``train.max_staleness`` bounds: stale-synchronous-parallel clocks);
    * delay: how many global steps other workers applied between its pull and its push.
    """

    def __init__(self) -> None:
        self.leads: list[int] = []
        self.delays: list[int] = []
        self.dropped = 0  # sync_replicas: gradients the PS dropped as too late

    def add(self, lead: int, delay: int) -> None:
        self.leads.append(lead)
        self.delays.append(delay)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"updates": len(self.leads), "dropped": self.dropped}
        for name, values in (("lead", self.leads), ("delay", self.delays)):
            if values:
                a = np.asarray(values)
                out[name] = {
                    "mean": round(float(a.mean()), 3),
                    "p50": int(np.percentile(a, 50)),
                    "p90": int(np.percentile(a, 90)),
                    "max": int(a.max()),
                }
        return out

    @staticmethod
    def describe(s: dict[str, Any]) -> str:
        def one(d: dict[str, Any]) -> str:
            return f"mean {d['mean']:.2f} p50 {d['p50']} p90 {d['p90']} max {d['max']}"

        return (
            f"{s['updates']} updates; lead over slowest worker {one(s['lead'])}; "
            f"delay in global steps {one(s['delay'])}"
        )

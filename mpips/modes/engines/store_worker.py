"""The worker engine of the modes whose PS tasks hold the variables (async, sync_replicas):
the chief initialises or restores the variables, raises ready, commits checkpoints and
evaluates at the end; every worker trains on its part of the data until the run ends. How
a worker makes one step is the mode's (async_worker.py, replicas_worker.py)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np

from ... import checkpoint
from ...data.batches import epoch_batches
from ...errors import AlreadyReported, CheckpointError, NonFinite
from ...models.contract import first_loss_and_grads, said_once
from ...process.log import detail, log
from ...run.hooks import Hook, PendingSave, Run, StepInfo
from ...run.report import (
    describe_lost,
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
from ...run.startup import load_chief_splits
from ...run.statistics import recompute_at_end
from ...run.summaries import job_timeline
from ...run.timeline import Phases
from ...store import StoreClient, Watchdog, Windows, liveness, start_limit, watched_barrier
from ..base import RunContext
from .ps import save_from_ps

LOOK_SECONDS = 0.05  # survive mode: how often a worker looks whether it became the chief


class StoreWorker:
    """One worker task of a mode whose PS tasks hold the variables (async, sync_replicas):
    the run's start, end and checkpoints; the mode's subclass says how a worker ``step``s."""

    def __init__(self, ctx: RunContext, windows: Windows):
        self.ctx, self.windows = ctx, windows
        self.job, self.mode, self.cluster, self.optimizer = (
            ctx.job,
            ctx.mode,
            ctx.cluster,
            ctx.optimizer,
        )
        self.model, self.prep, self.device = ctx.model, ctx.prep, ctx.device
        self.role, self.tc, self.oc = ctx.role, ctx.tc, ctx.oc
        optimizer, device = ctx.optimizer, ctx.device
        stateful = ctx.mode.ps_applies(optimizer.stateful)
        self.client = StoreClient(
            windows, self.role.task, stateful, optimizer.apply, optimizer.slots
        )
        self.client.serve_from(getattr(ctx.model, "table_offsets", dict)())
        self.control = self.client.control
        device.pin(self.client.host_buffers())  # a GPU's copies run from page-locked memory
        self.client.on_new_buffers = device.pin  # (so do a CTR table's rows, kept)
        self.stats = Staleness()
        self.watchdog = Watchdog(self.control, ctx.cluster.layout, self.role.task)
        self.timeline = job_timeline(ctx.job, "worker", self.role.task)
        self.phases = Phases(self.timeline)  # a step's phases on it (summary.timeline), if on
        self.clock = 0  # batches of this worker's part used (its data position)
        self.updates = 0
        self.acting_chief = self.role.is_chief  # survive mode: True once it took over
        self.next_look = 0.0  # when _is_chief reads the control words next
        self.run: Run | None = None
        self.session: Session | None = None

    def train(self) -> TrainResult:
        try:
            return self._train(self.ctx.hooks)
        finally:  # (page-locked buffers released whatever happened: the process may go on)
            self.device.unpin()

    def _train(self, extra_hooks: list[Hook]) -> TrainResult:
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
            mode=self.mode,
            chief=self._is_chief if liveness.SURVIVAL.survivable else None,
        )
        # hooks begin before the chief raises ready, so their set-up (the progress bar's)
        # does not delay the chief's first update behind every other worker's
        session = Session(self.job, run, extra_hooks, self.timeline)
        self.run, self.session = run, session
        start_step = self._start()
        session.loop(self)
        self.client.settle()  # its last update is applied before it says it is done
        control.publish_clock(self.role.task, self.clock, done=True)
        if line := self.client.cache_line():
            log(self.role, line)
        session.done(
            f"; {run.save_seconds:.2f} s of it writing checkpoints, the chief's duty"
            if run.save_seconds
            else ""
        )
        # every push has landed, so global_step is final; a worker that never gets here is hung
        lost = control.lost_tasks() if liveness.SURVIVAL.survivable else []
        workers = self.cluster.workers
        if lost:  # (the workers' comm is in task order)
            dead = [self.cluster.layout.rank_of("worker", t) for t in lost]
            workers = liveness.survivors(workers, lost, dead)
        watched_barrier(workers, "the other workers", self.watchdog.check)
        summary = self.stats.summary()
        result, gathered = session.finish(
            workers,
            start_step,
            "the workers' summaries",
            summary,
            staleness=[summary],
            before_end=lambda: recompute_at_end(self.ctx, self._evaluated, run.is_chief),
        )
        if run.is_chief:
            result.acting_chief = self.acting_chief and not self.role.is_chief
            for task in lost:  # (in task order, as the gathered summaries are)
                gathered.insert(task, [0, 0.0, {"updates": 0, "dropped": 0, "lost": True}])
            result.lost = [liveness.lost_rank(control, t) for t in lost]
            self._conclude(result, gathered)
        run.close(result.global_step)  # (the store is freed next: a kept Run must not read it)
        return result

    def _is_chief(self) -> bool:
        """Whether this worker does the chief's duties now (survive mode): worker 0, or the
        lowest live worker once the chief was lost, which then takes them over."""
        if self.acting_chief:
            return True
        now = time.monotonic()  # (hooks ask several times a step: the words are read
        if now < self.next_look:  # at most every LOOK_SECONDS)
            return False
        self.next_look = now + LOOK_SECONDS
        if liveness.acting_chief(self.control, self.cluster.layout.num_workers) == self.role.task:
            self._take_over()
        return self.acting_chief

    def _take_over(self) -> None:
        """The chief was lost: this worker does its duties from now on (survive mode). It
        takes the checkpoint directory's lock under the run's id, loads the splits the chief
        evaluates on, and begins the chief's hooks; its next step starts a checkpoint (the
        lost chief's pending one is never committed)."""
        job, run, session = self.job, self.run, self.session
        assert run is not None and session is not None
        self.acting_chief = True
        log(
            self.role,
            "the chief (/job:worker/task:0) was lost: this worker takes over its duties "
            "(checkpoints, evaluation, the final report)",
        )
        c = job.checkpoint
        if c.dir:
            try:
                checkpoint.lock_directory(c.dir, job.source, checkpoint.run_of(c.dir))
            except CheckpointError as e:
                log(self.role, f"warning: {e}")
        load_chief_splits(job, self.prep)
        if self.prep.val is not None:
            run.validate = self._validate
        session.take_over()

    def _validate(self) -> dict[str, float]:
        """Chief: the model now on the validation split (the others train on meanwhile)."""
        assert self.prep.val is not None
        x, ids = self.model.prepare(self.prep.val[0])
        return evaluate_on(self.model, self.device, self.client.pull(ids), (x, self.prep.val[1]))

    def _evaluated(self, x: Any) -> tuple[Any, dict[str, Any]]:
        """Inputs as the model takes them, and the variables it reads for them (pulled)."""
        x, ids = self.model.prepare(x)
        return x, self.client.pull(ids)

    def batches(self) -> Iterable[tuple[int, Any, Any]]:
        assert self.prep.train is not None  # (on a GPU: on the device, or copied a batch at a time)
        return self.prep.train.batches(
            self.tc.batch_size, self.tc.seed, self.role.task, self.tc.epochs, start_batch=self.clock
        )

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
            clocks = prep.clocks  # (None where not restored: startup.data_position)
            if prep.restored is None:  # else the PS tasks have restored their shards
                self.client.initialise(prep.values, prep.slots)
            control.set_counters(
                prep.start_step, clocks if clocks and len(clocks) == workers else None
            )
            control.raise_ready()
            if prep.restored is not None:
                say_restored(role, prep.start_step, prep.restored, prep.model_changed)
                if prep.position_lost:
                    say_position_lost(role, prep.position_lost)
            if tc.steps and prep.start_step >= tc.steps:
                say_nothing_to_train(role, prep.start_step, tc.steps)
        else:
            control.wait_ready(start_limit(role.task))
        self.clock = int(control.clocks()[0][role.task])
        start, stop = prep.rows
        client, ps = self.client, f"{self.windows.placement.num_ps} ps task(s)"
        pulls = f"pulls {client.nbytes / 1e6:.2f} MB per step from {ps}"
        if client.reads_in_place:  # (zero copy: what is read in place is not pulled)
            in_place = f"reads {client.in_place_bytes / 1e6:.2f} MB per step in place"
            pulls = f"{pulls}, {in_place}" if client.nbytes else f"{in_place} from {ps}"
            pulls += " (zero copy)" + (
                " and applies its updates there" if client.applies_in_place else ""
            )
        detail(
            role,
            f"train rows [{start}, {stop}) of {prep.info.rows['train']}, "
            f"batch {tc.batch_size}, {pulls}"
            + (f", resuming at batch {self.clock}" if self.clock else ""),
        )
        return prep.start_step  # global_step itself may have moved on: others are pushing

    def start_save(self) -> PendingSave:
        """Ask every PS task to write its shard (in parallel, while the chief trains on);
        the chief commits the manifest when all are written."""
        control = self.control
        self.client.settle()  # the chief's own last update is in the checkpoint
        step, clocks = control.global_step(), [int(c) for c in control.clocks()[0]]
        state = self.model.state()  # (the chief's buffers: one more shard, if any)
        kept: tuple[dict[str, Any], dict[str, Any]] | None = (state, {}) if state else None
        return save_from_ps(self.ctx, self.windows, step, clocks, kept)

    def _conclude(self, result: TrainResult, gathered: list[Any]) -> None:
        """Chief: who made how many updates, staleness, evaluation; then end the run."""
        role = self.role
        stopped = self.control.stop_signal()
        if stopped:
            say_preempted(role, stopped, self.job)
        result.staleness = [g[2] for g in gathered]
        counts = [s["updates"] for s in result.staleness if not s.get("lost")]
        fewer = (
            not result.staleness[0].get("lost")  # (the chief's own count, not a successor's)
            and len(counts) > 1
            and counts[0] < 0.8 * sum(counts[1:]) / (len(counts) - 1)
        )
        for lost in result.lost or []:
            log(role, f"lost: {describe_lost(lost)}")
        log(
            role,
            "updates per worker task: "
            + " ".join("lost" if s.get("lost") else str(s["updates"]) for s in result.staleness)
            + (
                " (the chief made fewer: it also evaluates, logs and commits checkpoints)"
                if fewer
                else ""
            ),
        )
        self._per_worker(result.staleness)
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

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """One update of this worker (None: its part of the run is over)."""
        raise NotImplementedError

    def _per_worker(self, staleness: list[dict[str, Any]]) -> None:
        """Chief: what the mode says of each worker's updates at the end."""

    def _not_finite(self, loss: float, step: int) -> NoReturn:
        """A loss that is not finite: nothing of it is pushed; said once over all workers."""
        message = loss_not_finite(self.role.task, loss, step, self.mode.takes_clip_norm)
        raise NonFinite(message) if self.control.claim_failure() else AlreadyReported(message)


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

"""What every training mode shares around its step: the loop and its hooks (Session), and
the step target."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from ..job import Job
from ..process.log import detail
from ..store import allgather_json
from .hooks import (
    CheckpointSaver,
    Hook,
    ProgressBar,
    Run,
    StepInfo,
    StepLogger,
    Validation,
)
from .result import TrainResult
from .summaries import Summaries, summary_root
from .timeline import Timeline


class Steps(Protocol):
    """One training mode's worker: its batches, and one update per batch."""

    def batches(self) -> Iterable[tuple[int, Any, Any]]: ...

    def step(self, epoch: int, x: Any, y: Any) -> StepInfo | None:
        """Train on one batch; None: the run is over for this worker (no update made)."""


def run_steps(steps: Steps, run: Run, hooks: Sequence[Hook]) -> tuple[int, int, float]:
    """The training loop of every mode: a step per batch until the mode says stop, the
    hooks after each. Returns (updates, examples, seconds)."""
    updates = examples = 0
    t0 = time.perf_counter()
    for epoch, x, y in steps.batches():
        for h in hooks:
            h.before_step(run)
        info = steps.step(epoch, x, y)
        if info is None:
            break
        updates, examples = updates + 1, examples + len(y)
        for h in hooks:
            h.after_step(run, info)
    return updates, examples, time.perf_counter() - t0


def target_steps(steps: int, epochs: int, per_epoch: int) -> int:
    """The global step a run ends at, as far as it is known before it starts (the progress
    bar's total and ETA): train.steps, or train.epochs times the global steps of an epoch,
    whichever comes first; 0 if neither is set."""
    return min((t for t in (steps, epochs * per_epoch) if t), default=0)


def standard_hooks(job: Job, extra: Iterable[Hook] = ()) -> list[Hook]:
    """The hooks every job gets (step logging, validation every train.eval_every steps, the
    chief's progress bar, checkpoints, summaries), then the caller's."""
    out: list[Hook] = [StepLogger(job.train.log_every)]
    if job.train.eval_every:
        out.append(Validation(job.train.eval_every))
    if job.train.progress:
        out.append(ProgressBar())
    if job.checkpoint.dir:
        out.append(CheckpointSaver(job.checkpoint.every_steps, job.checkpoint.every_secs))
    root = summary_root(job)
    if root and job.summary.every_steps:
        out.append(
            Summaries(
                root, job.summary.every_steps, job.summary.all_workers, job.summary.tensorboard
            )
        )
    return out + list(extra)


class Session:
    """A worker's run as every mode makes it (like TensorFlow's MonitoredTrainingSession):
    the job's standard hooks and the caller's, begun here (where the mode creates it) and
    ended in ``finish``; the loop; the "done" line; the summaries every worker shares; and
    this worker's TrainResult."""

    def __init__(
        self, job: Job, run: Run, extra_hooks: Iterable[Hook], timeline: Timeline | None = None
    ):
        self.run, self.timeline = run, timeline
        self.hooks = standard_hooks(job, extra_hooks)
        for h in self.hooks:
            h.begin(run)
        self.updates = self.examples = 0
        self.seconds = 0.0

    def take_over(self) -> None:
        """This worker has become the chief mid-run (survive mode): the standard hooks that
        set up for the chief alone in ``begin`` (the progress bar, the summaries) begin now;
        the others read ``run.is_chief`` at each step."""
        for h in self.hooks:
            if isinstance(h, ProgressBar) or (isinstance(h, Summaries) and h.out is None):
                h.begin(self.run)

    def loop(self, steps: Steps) -> None:
        """The training loop (run_steps), counted."""
        self.updates, self.examples, self.seconds = run_steps(steps, self.run, self.hooks)

    def done(self, note: str = "") -> None:
        """This worker's last line about its loop, ``note`` (the mode's) at its end: a
        detail (verbose runs), as the result file holds its updates and examples."""
        detail(
            self.run.role,
            f"done: {self.updates} updates, {self.examples} examples in {self.seconds:.1f} s{note}",
        )

    def finish(
        self,
        comm: Any,
        start_step: int,
        what: str,
        *summary: Any,
        before_end: Callable[[], bool] | None = None,
        **result: Any,
    ) -> tuple[TrainResult, list[Any]]:
        """Gather every worker's ``[examples, seconds, *summary]`` over ``comm`` (collective),
        call ``before_end`` (the chief's batch statistics made anew: True if the model's
        state changed, so the final checkpoint holds it), end the hooks, and make this
        worker's result (``result``: the mode's own fields). Returns (result, the gathered
        summaries, in worker task order)."""
        gathered = allgather_json(comm, [self.examples, self.seconds, *summary], what)
        if before_end is not None and before_end():
            self.run.state_changed = True
        for h in self.hooks:
            h.end(self.run)  # the final checkpoint first: the timeline is only a trace
        if self.timeline is not None:
            self.timeline.write()
        out = TrainResult(
            self.run.role,
            start_step,
            self.run.global_step(),
            self.updates,
            self.examples,
            self.seconds,
            validation=self.run.validation or None,
            **result,
        )
        return out, gathered

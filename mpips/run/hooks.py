"""Training-loop hooks: step logging, the chief's progress bar and periodic checkpoints."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tqdm import tqdm

from ..errors import MpipsError
from ..process.log import log

if TYPE_CHECKING:
    from ..job import Job
    from ..placement.layout import Role


class LoopMode(Protocol):
    """What the loop's hooks ask of the training mode (mpips.modes.Mode), nothing more."""

    @property
    def chief_speaks_for_all(self) -> bool: ...

    @property
    def has_staleness(self) -> bool: ...

    def step_note(self, info: StepInfo) -> str: ...


@dataclass
class PendingSave:
    """A checkpoint at ``step`` being written; ``commit(block)`` commits its manifest once
    every shard is in place and returns it (None while shards are still being written, unless
    ``block``: then it waits, with a deadline naming the PS task that does not write)."""

    step: int
    commit: Callable[[bool], Path | None]


@dataclass
class Run:
    """What hooks can see and do, the same in async and sync mode."""

    job: Job
    role: Role
    start_step: int
    target_steps: int
    global_step: Callable[[], int]
    start_save: Callable[[], PendingSave]  # chief: begin a checkpoint (see CheckpointSaver)
    read_variables: Callable[[], dict[str, Any]] = dict  # see variables()
    stop_run: Callable[[], None] = lambda: None  # see request_stop()
    validate: Callable[[], dict[str, float]] | None = None  # chief, train.eval_every
    params: dict[str, Any] | None = None  # sync mode: this replica's variables, live
    validation: list[dict[str, Any]] = field(default_factory=list)  # what Validation found
    save_seconds: float = 0.0  # chief: time spent writing checkpoints so far
    stop_requested: bool = False  # a hook asked to stop (this worker saw it)
    mode: LoopMode | None = None  # the training mode (mpips.modes), as hooks see it
    state_changed: bool = False  # the model's state changed at the end (checkpointed again)
    chief: Callable[[], bool] | None = None  # survive mode: whether this worker acts as chief

    @property
    def is_chief(self) -> bool:
        """Whether this worker does the chief's duties now: worker 0, or in survive mode
        the worker that took them over when the chief was lost (docs/guide/failures.md)."""
        return self.chief() if self.chief is not None else self.role.is_chief

    def variables(self) -> dict[str, Any]:
        """The model's dense variables now, by name (numpy copies): pulled from the PS tasks
        in async mode, this replica's own in sync mode. Costs a pull: call it when needed."""
        return self.read_variables()

    def close(self, global_step: int) -> None:
        """The run is over and its store about to be freed (async mode): a hook that kept
        this Run reads the final ``global_step``, and ``variables()`` is an error (it read
        freed memory: a segfault)."""

        def over() -> dict[str, Any]:
            raise MpipsError(
                "mpips.Run.variables(): the run is over and its PS store freed; call it "
                "from a hook during the run, or read the final checkpoint"
            )

        self.global_step, self.read_variables = (lambda: global_step), over
        self.stop_run = lambda: None

    def request_stop(self) -> None:
        """End the run early, as a normal end: every worker stops at its next step (async:
        at its next ticket; sync: all replicas together), the final checkpoint and the
        evaluation happen, the exit code is 0. Like TensorFlow's request_stop()."""
        self.stop_requested = True
        self.stop_run()


@dataclass(frozen=True)
class StepInfo:
    """One update just applied by this worker."""

    step: int  # the global step this update produced (unique across workers)
    loss: float
    epoch: int  # epoch of this worker's part of the data
    local_updates: int  # updates made by this worker in this run
    lead: int = 0  # updates this worker was ahead of the slowest one when it pulled
    delay: int = 0  # global steps other workers applied between its pull and its push


class Hook:
    """Override any of these; they run on every worker unless the hook says otherwise."""

    def begin(self, run: Run) -> None: ...

    def before_step(self, run: Run) -> None: ...

    def after_step(self, run: Run, info: StepInfo) -> None: ...

    def end(self, run: Run) -> None: ...


class StepLogger(Hook):
    """Every ``every`` local updates: the unique global step this worker's push produced."""

    def __init__(self, every: int):
        self.every = every

    def after_step(self, run: Run, info: StepInfo) -> None:
        mode = run.mode
        assert mode is not None
        if mode.chief_speaks_for_all and not run.is_chief:
            return  # every replica makes the same step: the chief says it once
        if not self.every or info.local_updates % self.every:
            return
        note = mode.step_note(info)
        log(run.role, f"step {info.step} loss {info.loss:.4f} epoch {info.epoch} {note}")


class ProgressBar(Hook):
    """The chief's progress in global steps: a tqdm bar (with rate and ETA when train.steps
    gives the total) on a terminal; elsewhere (a Slurm log file) a plain log line every
    ``every_secs`` seconds instead of carriage-return fragments."""

    def __init__(self, every_secs: float = 30.0, terminal: bool | None = None) -> None:
        self.bar: tqdm | None = None
        self.every_secs = every_secs
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.plain = False
        self.t0 = self.last = 0.0
        self.step0 = 0

    def begin(self, run: Run) -> None:
        if not run.is_chief:
            return
        if self.terminal:
            self.bar = tqdm(
                total=run.target_steps or None,
                initial=run.start_step,
                desc="global_step",
                unit="step",
                file=sys.stderr,
                mininterval=0.5,
                dynamic_ncols=True,
            )
        else:
            self.plain, self.step0 = True, run.start_step
            self.t0 = self.last = time.monotonic()
            target = f" of {run.target_steps}" if run.target_steps else ""
            log(
                run.role,
                f"progress: from global_step {run.start_step}{target}, a line every "
                f"{self.every_secs:.0f} s",
            )

    def after_step(self, run: Run, info: StepInfo) -> None:
        if self.bar is not None and info.step > self.bar.n:
            self.bar.update(info.step - self.bar.n)
        elif self.plain and time.monotonic() - self.last >= self.every_secs:
            self.say(run, info.step)

    def say(self, run: Run, step: int) -> None:
        """One plain progress line: step, rate, and the ETA when the target is known."""
        now = time.monotonic()
        self.last = now
        rate = (step - self.step0) / max(now - self.t0, 1e-9)
        line = f"progress: global_step {step}"
        if run.target_steps:
            left = max(run.target_steps - step, 0)
            line += (
                f"/{run.target_steps} ({100 * step / run.target_steps:.0f}%), "
                f"{rate:.1f} steps/s, ETA {left / rate if rate else float('inf'):.0f} s"
            )
        else:
            line += f", {rate:.1f} steps/s"
        log(run.role, line)

    def end(self, run: Run) -> None:
        if self.bar is not None:
            final = run.global_step()  # other workers' last steps too
            if final > self.bar.n:
                self.bar.update(final - self.bar.n)
            self.bar.close()


class CheckpointSaver(Hook):
    """Chief: commit a checkpoint every N global steps and/or seconds, and once at the end
    (where and how many to keep: the job's [checkpoint] section).

    In async mode a periodic checkpoint does not stop the chief: it asks the PS tasks for
    their shards and goes on training; a later step commits the manifest once every shard is
    written. The checkpoint at the end of the run is waited for.
    """

    def __init__(self, every_steps: int, every_secs: float):
        self.every_steps = every_steps
        self.every_secs = every_secs
        self.last_step = 0
        self.last_time = 0.0
        self.pending: PendingSave | None = None
        self.started = 0.0  # when the pending save was asked for
        self.paused = 0.0  # the chief's own time in it so far

    def begin(self, run: Run) -> None:
        self.last_step, self.last_time = run.start_step, time.monotonic()

    def after_step(self, run: Run, info: StepInfo) -> None:
        if not run.is_chief:
            return
        if self.pending is not None:
            self._finish(run, block=False)
            return
        due_steps = self.every_steps and info.step >= self.last_step + self.every_steps
        due_secs = self.every_secs and time.monotonic() - self.last_time >= self.every_secs
        if due_steps or due_secs:
            self._start(run)

    def end(self, run: Run) -> None:
        if not run.is_chief:
            return
        if self.pending is not None:
            self._finish(run, block=True)
        if run.global_step() != self.last_step or run.state_changed:
            self.save(run)

    def save(self, run: Run) -> Path:
        """Variables, optimizer slots, global_step and each worker's clock (data position),
        committed before this returns."""
        self._start(run)
        path = self._finish(run, block=True)
        assert path is not None
        return path

    def _start(self, run: Run) -> None:
        t0 = time.perf_counter()
        self.pending = run.start_save()
        self.started, self.paused = t0, time.perf_counter() - t0
        self.last_step, self.last_time = self.pending.step, time.monotonic()

    def _finish(self, run: Run, block: bool) -> Path | None:
        """Commit the pending save if its shards are written (``block``: wait for them)."""
        assert self.pending is not None
        t0 = time.perf_counter()
        path = self.pending.commit(block)
        self.paused += time.perf_counter() - t0
        if path is None:
            return None
        run.save_seconds += self.paused
        took = time.perf_counter() - self.started
        log(
            run.role,
            f"saved checkpoint {path} (global_step {self.pending.step}, {took * 1e3:.0f} "
            f"ms; the chief paused {self.paused * 1e3:.0f} ms)",
        )
        self.pending = None
        return path


class StopAtStep(Hook):
    """Stop the run once this worker has made an update at or past global step ``step``
    (a train.steps that a script sets; every worker stops at its next step)."""

    def __init__(self, step: int):
        self.step = step

    def after_step(self, run: Run, info: StepInfo) -> None:
        if info.step >= self.step and not run.stop_requested:
            run.request_stop()


class StopAtLoss(Hook):
    """Stop the run when a worker's batch loss falls to ``loss`` or below (averaged over the
    last ``window`` updates of that worker, so one lucky batch does not end it)."""

    def __init__(self, loss: float, window: int = 20):
        self.loss, self.window = loss, window
        self.recent: list[float] = []

    def after_step(self, run: Run, info: StepInfo) -> None:
        self.recent = (self.recent + [info.loss])[-self.window :]
        if (
            len(self.recent) == self.window
            and sum(self.recent) / self.window <= self.loss
            and not run.stop_requested
        ):
            log(
                run.role,
                f"mean loss of the last {self.window} updates "
                f"{sum(self.recent) / self.window:.4f} <= {self.loss} at global_step "
                f"{info.step}: stopping the run",
            )
            run.request_stop()


class Validation(Hook):
    """The chief evaluates the model on the validation split every ``every`` global steps
    (train.eval_every) while the other workers train on (async; in sync mode the replicas
    wait for it at the next step's agreement), and logs the metrics."""

    def __init__(self, every: int):
        self.every = every
        self.next = 0

    def begin(self, run: Run) -> None:
        self.next = run.start_step + self.every

    def after_step(self, run: Run, info: StepInfo) -> None:
        if run.validate is None or info.step < self.next:
            return
        self.next = (info.step // self.every + 1) * self.every
        metrics = run.validate()
        run.validation.append({"global_step": info.step, **metrics})
        shown = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        log(run.role, f"validation at global_step {info.step}: {shown}")

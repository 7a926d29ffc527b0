"""Scalars of a run, as JSON lines and TensorBoard event files.

Each worker that writes (the chief, or every worker with ``summary.all_workers``) has a
folder ``<summary.dir>/worker-K/`` holding ``metrics.jsonl`` (one object per scalar:
``time``, ``task``, ``step``, ``name``, ``value``; easy to load with pandas) and TensorBoard
event files (tensorboardX), so ``tensorboard --logdir <summary.dir>`` shows each worker as a
run; a hook writes them. A PS task that applies updates itself (stateful optimizers,
sync_replicas) writes its apply rate to ``<summary.dir>/ps-K/`` the same way. A resumed run
appends to the same files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .hooks import Hook, Run, StepInfo
from .log import log
from .optim import learning_rate
from .timeline import Timeline

# the scalar names, stable: docs/observability.md lists them
LOSS = "loss"  # mean batch loss of this worker since the last record
LEARNING_RATE = "learning_rate"  # at the record's global step
EXAMPLES_PER_SEC = "examples_per_sec"  # this worker, since the last record
STEPS_PER_SEC = "global_steps_per_sec"  # all workers together (chief)
LEAD = "staleness/lead"  # async: mean lead over the slowest worker
DELAY = "staleness/delay"  # async: mean global steps between pull and push
CHECKPOINT_PAUSE = "checkpoint/pause_ms"  # chief: time the last checkpoint took from it
VALIDATION = "validation/"  # prefix of the validation metrics (chief)
PS_UPDATES_PER_SEC = "ps/updates_per_sec"  # a PS task: updates it applied per second
PS_APPLY_BUSY = "ps/apply_busy"  # a PS task: share of that time spent applying them


def summary_root(job: Any) -> str:
    """Where a job's summaries and timeline go: summary.dir, else checkpoint.dir ("" if
    neither is set: no summaries)."""
    return job.summary.dir or job.checkpoint.dir


def job_timeline(job: Any, job_name: str, task: int) -> Timeline | None:
    """The task's timeline if the job asks for one (summary.timeline), else None."""
    return Timeline(summary_root(job), job_name, task) if job.summary.timeline else None


def ps_summaries(job: Any, task: int) -> PsSummaries | None:
    """PS ``task``'s apply-rate summaries, if the job's summaries are on (the caller asks
    only when this PS applies updates itself)."""
    root = summary_root(job)
    if not root or not job.summary.every_steps:
        return None
    return PsSummaries(root, task, job.summary.every_steps, job.summary.tensorboard)


def summary_dir(run_dir: str | Path, task: int) -> Path:
    """Where worker ``task`` writes its summaries inside a run's summary directory."""
    return Path(run_dir) / f"worker-{task}"


def validation_at(run_dir: str | Path, step: int) -> dict[str, float]:
    """The chief's last validation metrics at or before global ``step``, from the run's
    metrics.jsonl ({} if none were recorded). Unreadable lines are skipped: this only
    annotates listings."""
    path = summary_dir(run_dir, 0) / "metrics.jsonl"
    best: dict[str, float] = {}
    best_step = -1
    if not path.is_file():
        return best
    for line in path.read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
            name, at, value = r["name"], int(r["step"]), float(r["value"])
        except (ValueError, KeyError, TypeError):
            continue
        if name.startswith(VALIDATION) and best_step <= at <= step:
            if at > best_step:
                best, best_step = {}, at
            best[name[len(VALIDATION) :]] = value
    return best


def where_to_look(run_dir: str | Path) -> str:
    """A line pointing to a run's summaries and how to view them ("" if it has none)."""
    if not summary_dir(run_dir, 0).is_dir():
        return ""
    return (
        f"summaries in {run_dir}/worker-*/ (metrics.jsonl; tensorboard --logdir "
        f"{run_dir}; python -m mpips plot {run_dir})"
    )


def _ends_mid_line(path: Path) -> bool:
    """Whether a file exists and its last byte is not a newline (a writer was killed)."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            return f.read(1) != b"\n"
    except OSError:  # missing, or empty (seek before the start)
        return False


class MetricsWriter:
    """One task's scalars: appended to ``<folder>/metrics.jsonl`` and, with ``tensorboard``,
    to TensorBoard event files in the same folder."""

    def __init__(self, folder: Path, task: str, tensorboard: bool):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "metrics.jsonl"
        torn = _ends_mid_line(path)
        self.file = open(path, "a", buffering=1)  # line-buffered
        if torn:  # a killed run's half line stays a line of its own (plot skips it)
            self.file.write("\n")
        self.writer: Any = None
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported only when summaries are on

            self.writer = SummaryWriter(str(folder), flush_secs=10)
        self.task = task

    def record(self, step: int, values: dict[str, float]) -> None:
        """Write scalars at a global step (both formats)."""
        now = time.time()
        self.file.write(
            "".join(
                json.dumps(
                    {"time": round(now, 3), "task": self.task, "step": step, "name": k, "value": v}
                )
                + "\n"
                for k, v in values.items()
            )
        )
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step, walltime=now)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.file.close()


class Summaries(Hook):
    """Every ``every`` local updates of this worker: its scalars to metrics.jsonl and
    TensorBoard. Validation results and checkpoint pauses are recorded when they happen."""

    def __init__(
        self, directory: str | Path, every: int, all_workers: bool = False, tensorboard: bool = True
    ):
        self.directory, self.every = Path(directory), every
        self.all_workers, self.tensorboard = all_workers, tensorboard
        self.out: MetricsWriter | None = None
        self._reset(time.perf_counter(), 0)
        self.validations = 0
        self.save_seconds = 0.0

    def _reset(self, now: float, step: int) -> None:
        self.t0, self.step0 = now, step
        self.losses: list[float] = []
        self.leads: list[int] = []
        self.delays: list[int] = []
        self.examples = 0

    def _writes(self, run: Run) -> bool:
        return run.is_chief or self.all_workers

    def begin(self, run: Run) -> None:
        if not self._writes(run):
            return
        folder = summary_dir(self.directory, run.role.task)
        self.out = MetricsWriter(folder, str(run.role), self.tensorboard)
        self._reset(time.perf_counter(), run.start_step)

    def record(self, step: int, values: dict[str, float]) -> None:
        """Write scalars at a global step (both formats), if this worker writes."""
        if self.out is not None:
            self.out.record(step, values)

    def after_step(self, run: Run, info: StepInfo) -> None:
        if self.out is None:
            return
        self.losses.append(info.loss)
        self.leads.append(info.lead)
        self.delays.append(info.delay)
        self.examples += run.job.train.batch_size
        self._events(run, info.step)
        if not self.every or info.local_updates % self.every:
            return
        now = time.perf_counter()
        seconds = max(now - self.t0, 1e-9)
        values = {
            LOSS: sum(self.losses) / len(self.losses),
            LEARNING_RATE: learning_rate(run.job.optimizer, info.step),
            EXAMPLES_PER_SEC: self.examples / seconds,
        }
        if run.job.train.mode == "async":
            values[LEAD] = sum(self.leads) / len(self.leads)
            values[DELAY] = sum(self.delays) / len(self.delays)
        if run.is_chief:
            values[STEPS_PER_SEC] = (info.step - self.step0) / seconds
        self.record(info.step, values)
        self._reset(now, info.step)

    def _events(self, run: Run, step: int) -> None:
        """Record validations and checkpoint pauses that happened since the last look."""
        if len(run.validation) > self.validations:
            for v in run.validation[self.validations :]:
                self.record(
                    v["global_step"],
                    {VALIDATION + k: float(x) for k, x in v.items() if k != "global_step"},
                )
            self.validations = len(run.validation)
        if run.save_seconds > self.save_seconds:
            self.record(step, {CHECKPOINT_PAUSE: 1e3 * (run.save_seconds - self.save_seconds)})
            self.save_seconds = run.save_seconds

    def end(self, run: Run) -> None:
        if self.out is not None:
            # a checkpoint committed at the end (the last one, or one still pending when
            # the loop ended): the saver's end ran before this one
            self._events(run, run.global_step())
            self.out.close()
            self.out = None
            if run.is_chief:
                log(run.role, where_to_look(self.directory))


class PsSummaries:
    """A PS task's apply rate: every ``every`` updates it applied, the updates per second
    and the share of that time spent in the optimizer's rule (the rest is waiting for
    pushes, reading them and acknowledging)."""

    def __init__(self, directory: str | Path, task: int, every: int, tensorboard: bool = True):
        self.out = MetricsWriter(
            Path(directory) / f"ps-{task}", f"/job:ps/task:{task}", tensorboard
        )
        self.every = every
        self.updates, self.busy, self.t0 = 0, 0.0, time.perf_counter()

    def timed(self, apply: Callable[..., None]) -> Callable[..., None]:
        """``apply``, adding the seconds it takes to the busy time."""

        def run(*args: Any) -> None:
            t = time.perf_counter()
            apply(*args)
            self.busy += time.perf_counter() - t

        return run

    def applied(self, step: int) -> None:
        """One update applied; ``step``: the global step it made."""
        self.updates += 1
        if self.updates % self.every == 0:
            now = time.perf_counter()
            seconds = max(now - self.t0, 1e-9)
            self.out.record(
                step,
                {PS_UPDATES_PER_SEC: self.every / seconds, PS_APPLY_BUSY: self.busy / seconds},
            )
            self.busy, self.t0 = 0.0, now

    def close(self) -> None:
        self.out.close()

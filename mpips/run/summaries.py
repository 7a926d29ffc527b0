"""Scalars of a run, as JSON lines and TensorBoard event files.

Each worker that writes (the chief, or every worker with ``summary.all_workers``) has a
folder ``<summary.dir>/worker-K/`` holding ``metrics.jsonl`` (one object per scalar:
``time``, ``task``, ``step``, ``name``, ``value``; easy to load with pandas) and TensorBoard
event files (tensorboardX), so ``tensorboard --logdir <summary.dir>`` shows each worker as a
run; a hook writes them every ``summary.every_steps`` global steps. A thread per task writes
the files: a disk that fails or hangs switches that task's summaries off with one warning,
never training or its stop. A PS task that applies updates itself (stateful optimizers,
sync_replicas) writes its apply rate to ``<summary.dir>/ps-K/`` the same way. A resumed run
appends to the same files.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..optim import learning_rate
from ..process.log import log
from .hooks import Hook, Run, StepInfo
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


# what reading a line of metrics.jsonl can raise when the line is not a record (half a line
# of a killed run, garbage, JSON nested too deep for the parser): such lines are skipped
UNREADABLE = (ValueError, KeyError, TypeError, RecursionError)


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
        except UNREADABLE:
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


CLOSE_SECONDS = 5.0  # the most the end of a run (or a stop) waits for a task's summaries
QUEUE_RECORDS = 1000  # records waiting for the writer thread; more: it is stuck
FLUSH_SECONDS = 10.0  # event files reach the disk at least this often
_CLOSE = object()  # the writer thread's last item


def _problem(e: BaseException) -> str:
    """An error in a few words: "No space left on device" rather than a traceback."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} (errno {e.errno})"
    return f"{type(e).__name__}: {e}"


class MetricsWriter:
    """One task's scalars: appended to ``<folder>/metrics.jsonl`` and, with ``tensorboard``,
    to a TensorBoard event file in the same folder.

    A thread of its own writes them, so a slow, full or vanished disk never stalls training
    or a stop. When writing fails (disk full, folder removed, the thread stuck or gone) this
    task's summaries are switched off with one warning naming the folder and the cause, and
    training goes on, as in TensorFlow; ``close`` waits at most CLOSE_SECONDS."""

    def __init__(self, folder: Path, task: str, tensorboard: bool):
        self.folder, self.task, self.tensorboard = folder, task, tensorboard
        self.failed = ""  # why this task's summaries are off ("" while they are on)
        self.warned = False
        self.queue: queue.Queue[Any] = queue.Queue(QUEUE_RECORDS)
        if tensorboard:
            # imported here, before training starts: importing tensorboardX (protobuf) in the
            # thread took the GIL from the first steps (the default job's chief made 3 of
            # its ~100 updates); later imports in the thread find the modules loaded
            import tensorboardX.event_file_writer  # noqa: F401
            import tensorboardX.proto.event_pb2  # noqa: F401
            import tensorboardX.summary  # noqa: F401
        self.thread = threading.Thread(
            target=self._write_all, name=f"summaries {folder}", daemon=True
        )
        self.thread.start()

    def record(self, step: int, values: dict[str, float]) -> None:
        """Write scalars at a global step (both formats), without waiting for the disk."""
        if not self.failed and not self.thread.is_alive():
            self.failed = "its writer thread ended"
        if not self.failed:
            try:
                self.queue.put_nowait((time.time(), step, values))
            except queue.Full:
                self.failed = (
                    f"{QUEUE_RECORDS} records wait to be written, none was for a while "
                    f"(a hung file system?)"
                )
        self._warn()

    def close(self) -> None:
        """Write what waits and close the files, within CLOSE_SECONDS (then leave the thread
        behind: a stop must not hang on the disk); warn if summaries were switched off."""
        if not self.failed and self.thread.is_alive():
            deadline = time.monotonic() + CLOSE_SECONDS
            try:
                self.queue.put(_CLOSE, timeout=CLOSE_SECONDS)
            except queue.Full:
                pass
            self.thread.join(max(deadline - time.monotonic(), 0.0))
            if self.thread.is_alive() and not self.failed:
                self.failed = (
                    f"its last records were not written within {CLOSE_SECONDS:g} s "
                    f"(a hung file system?)"
                )
        self._warn()

    def _warn(self) -> None:
        if self.failed and not self.warned:
            self.warned = True
            log(
                self.task,
                f"warning: cannot write summaries in {self.folder} ({self.failed}): they are "
                f"switched off, training goes on",
            )

    def _write_all(self) -> None:
        """The writer thread: every record queued, until _CLOSE or a failure."""
        jsonl: Any = None
        events: Any = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            path = self.folder / "metrics.jsonl"
            torn = _ends_mid_line(path)
            jsonl = open(path, "a")
            if torn:  # a killed run's half line stays a line of its own (plot skips it)
                jsonl.write("\n")
            if self.tensorboard:  # imported only when summaries are on
                from tensorboardX.event_file_writer import EventsWriter

                events = EventsWriter(str(self.folder / "events"))
            flush_at = time.monotonic() + FLUSH_SECONDS
            while True:
                try:
                    item = self.queue.get(timeout=max(flush_at - time.monotonic(), 0.01))
                except queue.Empty:
                    item = None
                if item is _CLOSE:
                    break
                if item is not None:
                    self._write(jsonl, events, *item)
                if time.monotonic() >= flush_at:
                    if events is not None:
                        events.flush()
                    flush_at = time.monotonic() + FLUSH_SECONDS
            for f in (events, jsonl):
                if f is not None:
                    f.close()
        except Exception as e:  # noqa: BLE001 - any failure: summaries off, training on
            self.failed = _problem(e)
            for f in (events, jsonl):
                with contextlib.suppress(Exception):  # unwritten bytes of a full disk
                    if f is not None:
                        f.close()

    def _write(self, jsonl: Any, events: Any, now: float, step: int, values: dict[str, float]):
        jsonl.write(
            "".join(
                json.dumps(
                    {
                        "time": round(now, 3),
                        "task": self.task,
                        "step": step,
                        "name": k,
                        "value": float(v),
                    }
                )
                + "\n"
                for k, v in values.items()
            )
        )
        jsonl.flush()  # whole lines: `mpips plot` may read them while the run goes on
        if events is not None:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import scalar

            for k, v in values.items():
                events.write_event(Event(summary=scalar(k, float(v)), wall_time=now, step=step))


class Summaries(Hook):
    """The worker's scalars to metrics.jsonl and TensorBoard, every ``every`` global steps
    (as TensorFlow's summary hook): at its first update at or past each multiple of
    ``every``, the means since its last record. Validation results and checkpoint pauses
    are recorded when they happen."""

    def __init__(
        self, directory: str | Path, every: int, all_workers: bool = False, tensorboard: bool = True
    ):
        self.directory, self.every = Path(directory), every
        self.all_workers, self.tensorboard = all_workers, tensorboard
        self.out: MetricsWriter | None = None
        self._reset(time.perf_counter(), 0)
        self.next = every  # the global step of the next record
        self.started = False  # the first step began (the rates count from there)
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
        self.next = self._after(run.start_step)

    def _after(self, step: int) -> int:
        """The first multiple of ``every`` past ``step``."""
        return (step // self.every + 1) * self.every if self.every else 0

    def record(self, step: int, values: dict[str, float]) -> None:
        """Write scalars at a global step (both formats), if this worker writes."""
        if self.out is not None:
            self.out.record(step, values)

    def before_step(self, run: Run) -> None:
        if not self.started:  # the rates count from the first step, not from the start-up
            self.started = True
            self.t0 = time.perf_counter()

    def after_step(self, run: Run, info: StepInfo) -> None:
        if self.out is None:
            return
        self.losses.append(info.loss)
        self.leads.append(info.lead)
        self.delays.append(info.delay)
        self.examples += run.job.train.batch_size
        self._events(run, info.step)
        if not self.every or info.step < self.next:
            return
        self.next = self._after(info.step)
        now = time.perf_counter()
        seconds = max(now - self.t0, 1e-9)
        values = {
            LOSS: sum(self.losses) / len(self.losses),
            LEARNING_RATE: learning_rate(run.job.optimizer, info.step),
            EXAMPLES_PER_SEC: self.examples / seconds,
        }
        if run.mode is not None and run.mode.has_staleness:
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

    def record(self, step: int, values: dict[str, float]) -> None:
        """Other values of this PS task at global ``step`` (its dynamic tables' counts)."""
        self.out.record(step, values)

    def close(self) -> None:
        self.out.close()

"""What every training mode shares around its step: the loop and its hooks (Session), the
run's result, the manifest's metadata, and the chief's words (restore, evaluation,
preemption, divergence)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .. import checkpoint
from ..device.backend import Device
from ..job import Job
from ..placement.layout import Role
from ..process import preemption
from ..process.log import counted, detail, log
from ..store import Cluster, allgather_json
from .hooks import (
    CheckpointSaver,
    Hook,
    PendingSave,
    ProgressBar,
    Run,
    StepInfo,
    StepLogger,
    Validation,
)
from .summaries import Summaries, summary_root
from .timeline import Timeline


@dataclass
class TrainResult:
    """What one rank saw. Evaluation fields are set on the chief only."""

    role: Role
    start_step: int
    global_step: int
    updates: int = 0  # updates this worker pushed
    examples: int = 0  # examples this worker trained on
    seconds: float = 0.0
    total_examples: int = 0  # over all workers (chief only)
    test_accuracy: float | None = None
    test_loss: float | None = None
    test_auc: float | None = None  # sparse CTR models
    test_metrics: dict[str, float] | None = None  # everything evaluate() returned (chief)
    staleness: list[dict[str, Any]] | None = None  # per worker task (chief: all workers)
    validation: list[dict[str, Any]] | None = None  # chief, train.eval_every: each evaluation
    stopped_by: int = 0  # signal that stopped the run early (preemption), else 0

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values (``train --result FILE``)."""
        out = {k: v for k, v in vars(self).items() if k != "role"}
        for k, v in out.items():  # strict JSON: a NaN metric (one-class split) is null
            if isinstance(v, float) and v != v:
                out[k] = None
        if self.test_metrics:
            out["test_metrics"] = {k: (None if v != v else v) for k, v in self.test_metrics.items()}
        out["task"] = f"/job:{self.role.job}/task:{self.role.task}"
        out["stopped_by"] = preemption.name(self.stopped_by) if self.stopped_by else None
        return out


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
        self, comm: Any, start_step: int, what: str, *summary: Any, **result: Any
    ) -> tuple[TrainResult, list[Any]]:
        """Gather every worker's ``[examples, seconds, *summary]`` over ``comm`` (collective),
        end the hooks, and make this worker's result (``result``: the mode's own fields).
        Returns (result, the gathered summaries, in worker task order)."""
        gathered = allgather_json(comm, [self.examples, self.seconds, *summary], what)
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


def _data_source(job: Job) -> str:
    """Where the run's data came from, for the manifest (a file, the built-in set, .npy
    files, or arrays handed to mpips.train)."""
    d = job.data
    if d.builtin:
        return f"builtin:{d.builtin}"
    return d.path or (f"npy:{d.train_x}" if d.train_x else "arrays (Python API)")


def manifest_meta(job: Job, cluster: Cluster, clocks: list[int]) -> dict[str, Any]:
    """What a checkpoint manifest records besides the variables: the job, the layout and
    the data position (updates, i.e. batches, each worker task has used)."""
    layout = cluster.layout
    return {
        "job": job.source,
        "job_sha256": checkpoint.job_digest(job),
        "model": job.model.kind,
        "layout": {
            "world_size": cluster.comm.size,
            "ps": layout.num_ps,
            "workers": layout.num_workers,
            "mode": job.train.mode,
        },
        "clocks": clocks,
        "data": {
            "path": _data_source(job),
            "batch_size": job.train.batch_size,
            "seed": job.train.seed,
        },
    }


def save_whole(
    job: Job,
    cluster: Cluster,
    step: int,
    variables: dict[str, Any],
    slots: dict[str, Any],
    clocks: list[int],
) -> PendingSave:
    """Chief, holding every variable: write one shard and commit it (done at once)."""
    c = job.checkpoint
    checkpoint.write_shard(c.dir, step, 0, 1, variables, slots)
    path = checkpoint.commit(
        c.dir,
        step,
        1,
        checkpoint.whole_index(variables),
        checkpoint.whole_index(slots),
        manifest_meta(job, cluster, clocks),
        c.max_to_keep,
    )
    return PendingSave(step, lambda block: path)


def say_restored(role: Role, step: int, path: Any, model_changed: str = "") -> None:
    """Chief: the run resumes from a checkpoint (one that model ``model_changed`` wrote, if
    another model than this job's: restored by variable names and shapes, said)."""
    log(role, f"restored global_step {step} from {path}")
    if model_changed:
        log(
            role,
            f"warning: model {model_changed!r} wrote this checkpoint; its variables were "
            "restored into this job's model by name and shape (mpips eval refuses such a "
            "pair; --ckpt-dir DIR starts afresh)",
        )


def say_position_lost(role: Role, why: str) -> None:
    """Chief: the run resumes its variables, but not its data position (``why``)."""
    log(role, f"data position not restored: {why}; the parts start afresh at batch 0")


def say_nothing_to_train(role: Role, step: int, target: int) -> None:
    """Chief: the restored global_step already reached the target."""
    log(
        role,
        f"global_step {step} already reached train.steps = {target}: nothing to "
        f"train (raise train.steps or use another checkpoint dir)",
    )


def say_preempted(role: Role, signum: int, job: Job) -> None:
    """The chief's last word on a run stopped by a signal: the checkpoint a rerun resumes
    from (the one just written at the end of the run, if there was anything to save)."""
    found = checkpoint.list_checkpoints(job.checkpoint.dir) if job.checkpoint.dir else []
    if not job.checkpoint.dir:
        saved = "no checkpoint.dir: not saved"
    elif found:
        saved = (
            f"checkpoint at global_step {found[-1][0]} in {job.checkpoint.dir}; rerun the "
            f"same command to resume"
        )
    else:
        saved = "no update was made, so there is no checkpoint; rerun the same command to start"
    log(
        role,
        f"stopped early by {preemption.name(signum)}: {saved} "
        f"(exit code {preemption.EXIT_PREEMPTED})",
    )


def loss_not_finite(task: int, loss: float | str, step: int, takes_clip_norm: bool) -> str:
    """The message for a loss that is NaN or infinite (training stops there, said once);
    clipping is suggested only where the mode takes optimizer.clip_norm."""
    clip = ", or set optimizer.clip_norm" if takes_clip_norm else ""
    return (
        f"the loss of /job:worker/task:{task} is {loss} at global_step {step}: training "
        f"stopped, and no checkpoint holds non-finite values (the inputs were checked finite "
        f"when read: the learning rate too high? lower optimizer.learning_rate{clip}; a "
        f"model of your own can also make it, e.g. log(0))"
    )


def evaluate_on(
    model: Any, device: Device, params: dict[str, Any], split: tuple[Any, Any]
) -> dict[str, float]:
    """The model's metrics on a split (already prepared), on this worker's device."""
    params = device.stage_in(params)
    x, y = device.to_device(split[0]), device.to_device(split[1])
    return {k: float(v) for k, v in model.evaluate(params, x, y).items()}


def show(metrics: dict[str, float], prefix: str) -> str:
    """``accuracy``, ``loss``, ``auc`` first, then the rest, as ``<prefix><name> <value>``."""
    first = [k for k in ("accuracy", "loss", "auc") if k in metrics]
    return " ".join(
        f"{prefix}{k} {metrics[k]:.4f}" for k in first + sorted(set(metrics) - set(first))
    )


def report(
    cluster: Cluster,
    model: Any,
    device: Device,
    params: dict[str, Any],
    test: tuple[Any, Any],
    result: TrainResult,
    gathered: list[Any],
) -> None:
    """Chief: evaluate on the test split and print the final line."""
    role = cluster.role
    metrics = evaluate_on(model, device, params, test)
    result.test_metrics = metrics
    result.test_loss, result.test_accuracy = metrics.get("loss"), metrics.get("accuracy")
    result.test_auc = metrics.get("auc")
    result.total_examples = sum(g[0] for g in gathered)
    wall = max(g[1] for g in gathered)
    rate = result.total_examples / wall if wall else 0.0
    log(
        role,
        f"final: global_step {result.global_step} {show(metrics, 'test_')} "
        f"({result.total_examples} examples on {counted(cluster.layout.num_workers, 'worker')} "
        f"in {wall:.1f} s, {rate:.0f} examples/s)",
    )

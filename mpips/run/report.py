"""The chief's words on a run: restored, position lost, nothing to train, preempted, a loss
that is not finite, and the final report (the test split's metrics, evaluated on this
worker's device)."""

from __future__ import annotations

from typing import Any

from .. import checkpoint
from ..device.backend import Device
from ..job import Job
from ..placement.layout import Role
from ..process import preemption
from ..process.log import counted, log
from ..store import Cluster
from .result import TrainResult


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
        f"({result.total_examples} examples on {counted(cluster.layout.num_workers, 'worker')}"
        f"{f', {len(result.lost)} lost' if result.lost else ''} "
        f"in {wall:.1f} s, {rate:.0f} examples/s)",
    )


def describe_lost(lost: dict[str, Any]) -> str:
    """A lost worker as the chief's report names it: ``rank 3 (/job:worker/task:2, pid 4242
    on node7, last step pushed 1187, killed by signal 9)``."""
    signum = lost.get("signal")
    how = f"killed by signal {signum}" if signum else "killed or crashed"
    last = lost.get("last_step") or 0
    pushed = f"last step pushed {last}" if last else "no step pushed"
    return (
        f"rank {lost['rank']} ({lost['task']}, pid {lost.get('pid')} on {lost.get('host')}, "
        f"{pushed}, {how})"
    )

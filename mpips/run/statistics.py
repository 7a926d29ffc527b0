"""BatchNorm's running statistics made anew with the final variables
(``train.recompute_batch_norm = N``): on the chief at the end of a run, before the final
checkpoint and evaluation, and in ``ckpt export --recompute-batch-norm N``.

Each worker's BatchNorm layers average the batches it trained on, computed with the
variables of their step: in an async run those lag the final variables, and the chief's
statistics, which serve its evaluation and go into the checkpoint, no longer match the
weights (a ResNet: 0.752 before, 0.800 after). N training batches run forward through the
final model, in train mode and without gradients, give the statistics of those weights (as
``torch.optim.swa_utils.update_bn`` does). The model does it (``Model.recompute_batch_statistics``);
this module feeds it the batches and the variables.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from ..data.batches import Part, train_part
from ..device.backend import Device
from ..errors import ConfigError
from ..job import Job
from ..models.contract import Model
from ..placement.layout import Role
from ..process import preemption
from ..process.log import log

Evaluated = Callable[[Any], tuple[Any, dict[str, Any]]]  # inputs -> (prepared, variables)


class Started(Protocol):
    """What start-up prepared (run/startup.py's Prepared), as far as it is used here."""

    train: Part | None  # this worker's part of the train rows


class EndOfRun(Protocol):
    """What the end of a run hands over (mpips.modes.RunContext)."""

    @property
    def job(self) -> Job: ...

    @property
    def role(self) -> Role: ...

    @property
    def model(self) -> Any: ...

    @property
    def device(self) -> Device: ...

    @property
    def prep(self) -> Started: ...


def check_batch_statistics(n: int, model: Model, what: str) -> None:
    """Recomputing (``what`` = N) needs a model that keeps batch statistics: refused, not
    ignored, where it would do nothing (at start-up, and before an export)."""
    if n and not model.batch_statistics():
        raise ConfigError(
            f"{what} = {n}: the model ({type(model).__name__}) keeps no BatchNorm running "
            f"statistics to recompute; drop it"
        )


def recompute_at_end(ctx: EndOfRun, evaluated: Evaluated, chief: bool | None = None) -> bool:
    """Chief, train.recompute_batch_norm = N: the model's batch statistics made anew from
    the first N batches of its part of the train rows, with the final variables
    (``evaluated(x)``: the batch prepared and the variables it reads). Not after a signal
    (the run must end within its grace period: the next run does it). Returns whether it
    recomputed them (the final checkpoint is then written again, if it was already).
    ``chief``: whether this worker acts as the chief (by default its role says)."""
    n, tc = ctx.job.train.recompute_batch_norm, ctx.job.train
    part = ctx.prep.train
    chief = ctx.role.is_chief if chief is None else chief
    if not n or not chief or part is None or preemption.requested():
        return False
    t0 = time.perf_counter()
    device = ctx.device
    used = _recompute(
        ctx.model,
        part.batches(tc.batch_size, tc.seed, ctx.role.task),
        n,
        lambda x: _staged(device, *evaluated(x)),
    )
    log(
        ctx.role,
        f"recomputed the BatchNorm statistics ({len(ctx.model.batch_statistics())} values) "
        f"from {used} training batches with the final variables "
        f"({time.perf_counter() - t0:.1f} s; train.recompute_batch_norm)",
    )
    return used > 0


def _staged(device: Device, x: Any, params: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(variables, batch) on the worker's device, as the model takes them."""
    return device.stage_in(params), device.to_device(x)


def _recompute(
    model: Model,
    batches: Iterator[tuple[int, Any, Any]],
    n: int,
    feed: Callable[[Any], tuple[dict[str, Any], Any]],
) -> int:
    """``model.recompute_batch_statistics`` over the first ``n`` of ``batches``, each
    ``feed(x)``; the batches' iterator is closed after (a streamed part's reader stops)."""

    def fed() -> Iterable[tuple[dict[str, Any], Any]]:
        for _, x, _ in itertools.islice(batches, n):
            yield feed(x)

    try:
        return model.recompute_batch_statistics(fed())
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def recompute_for_export(
    job: Job, ckpt_path: str, n: int
) -> tuple[dict[str, np.ndarray], int, int]:
    """``ckpt export --recompute-batch-norm N``: the model's state (its buffers, the
    BatchNorm statistics made anew from N batches of train.batch_size rows of the job's
    train split, drawn as one worker's) with the checkpoint's variables. Returns (the
    state by name, the batches used, the statistics recomputed)."""
    from .evaluation import _params_for, restore_model

    model, params, _, info = restore_model(job, ckpt_path)
    check_batch_statistics(n, model, "--recompute-batch-norm")
    b, rows = job.train.batch_size, info.rows["train"]
    part: Part = train_part(info, (0, rows), job.data.chunk_rows or min(rows, n * b), 1)

    def feed(x: Any) -> tuple[dict[str, Any], Any]:
        x, variables = _params_for(model, params, x)
        return variables, x

    used = _recompute(model, part.batches(b, job.train.seed, 0), n, feed)
    return model.state(), used, len(model.batch_statistics())

"""What is checked before anything is written: every value finite, the directory writable."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np

from ..errors import CheckpointError, NonFinite
from ..process.files import temporary_name


def count_non_finite(a: np.ndarray) -> int:
    """How many values of ``a`` are NaN or infinite (0 for integers), a chunk at a time. A
    NaN or infinity makes the sum (in the array's own dtype: one pass, no temporary)
    non-finite, so only an array whose sum is not finite is counted element by element
    (finite values whose sum overflows then count 0): cheap enough for every restore."""
    a = np.asarray(a)
    if a.dtype.kind not in "fc":
        return 0
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(a.sum()):
            return 0
    flat = a.reshape(-1)
    return sum(int((~np.isfinite(c)).sum()) for c in np.array_split(flat, max(1, flat.size >> 20)))


def check_finite(arrays: dict[str, np.ndarray], step: int) -> None:
    """NonFinite naming the first array holding NaN or infinity: such values are never
    checkpointed (one pass over memory, no temporary the size of an array)."""
    for name, value in arrays.items():
        a = np.asarray(value)
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(a.sum()) if a.dtype.kind == "f" else 0.0
        # a NaN or inf makes the sum (in the array's own dtype: the fastest pass) non-finite;
        # a sum that overflows on finite values is told apart by the exact check, chunked
        if not math.isfinite(total) and not all(
            np.isfinite(c).all() for c in np.array_split(a.reshape(-1), max(1, a.size >> 20))
        ):
            raise NonFinite(
                f"'{name}' holds NaN or infinite values at global_step {step}: not "
                f"checkpointed, training stopped (the inputs were checked finite when read: "
                f"the learning rate too high? lower optimizer.learning_rate or set "
                f"optimizer.clip_norm)"
            )


def check_writable(
    directory: str | Path,
    what: str = "checkpoint.dir",
    hint: str = "choose another with --ckpt-dir",
    files: str = "checkpoints",
) -> None:
    """Create ``directory`` if needed and prove a file can be written, fsynced and removed
    there: at start-up, by every rank that will write checkpoints (or summaries, ``what``),
    before any training."""
    d = Path(directory)
    probe = temporary_name(d / ".write-probe")
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"mpips")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"{what} {d}: cannot write {files} there ({e.strerror or e}); {hint}"
        ) from None

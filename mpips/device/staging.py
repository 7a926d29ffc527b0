"""A step's gradients copied from the device into host buffers as backward says each is
ready (StagedGradients)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class StagedGradients:
    """A step's gradients on their way from the device to host buffers (the reduction's;
    gradients without one stay on the device):
    ``ready(name, rows)`` copies what backward has finished of gradient ``name`` (its first
    ``rows`` rows, or all of it) that is not copied yet, then calls ``then(name, rows)``,
    so a bucket is reduced from host memory only once its part is there; ``finish()`` copies
    whatever was never said ready, all queued, then one wait. Each byte crosses once. On
    the CPU both are no-ops but for ``then``: the model writes the host buffers
    themselves."""

    def __init__(
        self,
        device: dict[str, Any],
        host: dict[str, np.ndarray],
        on_host: bool,
        synchronize: Callable[[], None],
    ):
        self.device, self.host, self.on_host = device, host, on_host
        self.synchronize = synchronize  # (waits for the device's queue)
        self.copied: dict[str, int] = {}  # rows of each gradient in host memory so far

    def ready(self, then: Any) -> Any:
        """``then`` (a ready callback, or None) behind the copies; None when nothing need
        be in host memory before backward ends: one replica on a GPU (its gradients stay
        there) or no ``then`` (buckets in node shared memory: nothing is reduced during
        backward), so ``finish`` copies every gradient with one wait, not one each (the
        copies run on the model's stream, after its kernels, either way)."""
        if self.on_host:
            return then
        if not self.host or then is None:
            return None

        def ready(name: str, rows: int | None = None) -> None:
            if name not in self.host:
                return  # (a gradient that stays on the device)
            self._copy(name, rows)
            then(name, rows)

        return ready

    def _copy(self, name: str, rows: int | None, blocking: bool = True) -> bool:
        """Copy what is not copied yet of gradient ``name``'s first ``rows`` rows (None: all
        of it); whether there was any."""
        src, dst = self.device[name], self.host[name]
        total = len(dst) if dst.ndim else 1
        stop = total if rows is None or not dst.ndim else min(rows, total)
        done = self.copied.get(name, 0)
        if stop <= done:
            return False
        if done == 0 and stop == total:
            src.get(out=dst, blocking=blocking)
        else:
            src[done:stop].get(out=dst[done:stop], blocking=blocking)
        self.copied[name] = stop
        return True

    def finish(self) -> None:
        """Copy every gradient (or the rows of it) not copied yet: queued, then one wait."""
        if self.on_host:
            return
        queued = [self._copy(name, None, blocking=False) for name in self.host]
        if any(queued):
            self.synchronize()

"""Where a worker computes: the array module (numpy on the CPU, cupy on a GPU, one device per
worker on a node; get_xp) and the moves between host memory and the device (Device)."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..process import settings
from . import standin
from .arrays import SparseBatch, issparse
from .pages import grown, owns_pages, page_runs
from .staging import StagedGradients


def get_xp(device: str, local_worker: int = 0) -> ModuleType:
    """numpy for "cpu"; for "gpu", cupy on GPU ``local_worker % visible GPUs``.

    ``local_worker`` is the worker's index among the workers on its node (PS ranks do not
    count, so no GPU idles while two workers share one). GPUs are those CUDA_VISIBLE_DEVICES
    leaves visible (Slurm's --gpus-per-task sets it per rank: each rank then sees its own).
    """
    if device == "cpu":
        return np
    if settings.current().gpu_standin:
        return standin  # the strict stand-in: GPU code paths without a GPU (tests, CI)
    try:
        import cupy
    except ImportError:
        raise ConfigError('train.device = "gpu" needs cupy (pip install "mpips[gpu]")') from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, a driver too old for this cupy, no device nodes
        raise ConfigError(
            f'train.device = "gpu" but CUDA cannot be used here: {type(e).__name__}: {e}'
        ) from None
    if count == 0:
        raise ConfigError('train.device = "gpu" but no CUDA device is visible')
    cupy.cuda.Device(local_worker % count).use()
    return cupy


class Device:
    """Where a worker computes: the array module (numpy, or cupy on a GPU) and the moves
    between host memory (where the store's pull and push buffers live) and the device.

    On the CPU every move is a no-op that hands back the same arrays, so the model reads
    and writes the store's buffers in place. On a GPU, whole variables and gradients go
    through device buffers kept from step to step (allocated once per name and shape), and
    batches are copied as they come. The only place mpips tells numpy from cupy.
    """

    def __init__(self, xp: ModuleType = np):
        self.xp = xp
        self.on_host = xp is np
        self._buffers: dict[str, Any] = {}
        self.allocations = 0  # device buffers made so far (a step after the first makes none)
        # page-locked host ranges (page-aligned start: bytes) and the arrays they hold
        self._pinned: dict[int, int] = {}
        self._held: list[np.ndarray] = []

    @classmethod
    def select(cls, device: str, local_worker: int = 0) -> Device:
        """The device of ``train.device`` for this worker (see get_xp)."""
        return cls(get_xp(device, local_worker))

    def describe(self) -> str:
        """Where this worker computes, in words (its GPU's index and name, or the stand-in)."""
        if self.on_host:
            return "the CPU"
        if self.xp is standin:
            return "the GPU stand-in (mpips.device.standin: GPU code run on the host, slow)"
        try:
            index = self.xp.cuda.Device().id
            name = self.xp.cuda.runtime.getDeviceProperties(index)["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
        except Exception:  # (a name is a nicety: never a reason to fail)
            return "a GPU (cupy)"
        return f"GPU {index} ({name}), cupy {self.xp.__version__}"

    def to_device(self, a: Any, key: str | None = None) -> Any:
        """An array (a batch, a test split) on the device: copied if it is not there, into
        the buffer kept under ``key`` when given (a batch: one buffer from step to step). A
        sparse batch (CSR) becomes a SparseBatch."""
        if not self.on_host and issparse(a):
            return SparseBatch(self.xp, a)
        if self.on_host or not isinstance(a, np.ndarray):
            return a
        if key is None:
            return self.xp.asarray(a)
        buf = self._buffer(f"{key}{a.shape}", a)  # (an epoch's short last batch: its own)
        buf.set(np.ascontiguousarray(a))
        return buf

    def stage_in(self, host: dict[str, np.ndarray]) -> dict[str, Any]:
        """Host arrays (pulled variables) on the device, through the kept buffers (arrays
        on the device already as they are)."""
        if self.on_host:
            return host
        out = {}
        for name, a in host.items():
            if not isinstance(a, np.ndarray):  # on the device already (a GPU replica's)
                out[name] = a
                continue
            out[name] = self._buffer(f"in:{name}", a)
            out[name].set(np.ascontiguousarray(a))  # (after the last step's kernels)
        return out

    def mirrors(self, host: dict[str, np.ndarray]) -> dict[str, Any]:
        """Device arrays shaped like ``host`` (kept buffers) for the model to write into:
        on the CPU, ``host`` itself (gradients land in the push buffers directly)."""
        if self.on_host:
            return host
        return {name: self._buffer(f"out:{name}", a) for name, a in host.items()}

    def stage_out(self, device: dict[str, Any], host: dict[str, np.ndarray]) -> None:
        """Copy ``device`` arrays into the host arrays of the same names (no-op on the CPU,
        where they are the same arrays): every copy queued behind backward on the one
        stream, then one wait for them all (a blocking copy each would be a wait each)."""
        if self.on_host:
            return
        for name, a in device.items():
            a.get(out=host[name], blocking=False)
        self.synchronize()

    def pin(self, arrays: list[np.ndarray]) -> None:
        """Page-lock host buffers the device copies from and to every step (a worker's pull
        and push buffers, a replica's gradient buckets): copies from pinned memory run at
        the bus's rate (54 GB/s host to device on an H100 node, against 7-14 GB/s from
        pageable memory). CUDA locks whole pages, and two buffers (the segments of one MPI
        shared window, two small heap arrays) may share one: the buffers' pages are merged
        into runs and each run is registered once. A no-op on the CPU; a run the driver
        refuses stays pageable (said once)."""
        if self.on_host:
            return
        arrays = [a for a in arrays if a.nbytes]
        owned = [a for a in arrays if owns_pages(a)]
        if len(owned) < len(arrays):  # (an mpips bug, not the user's: say it, leave them)
            warnings.warn(
                f"mpips: {len(arrays) - len(owned)} host buffer(s) share pages with other "
                "memory and stay pageable (locking them would make copies of that memory fail)",
                stacklevel=2,
            )
        runs = page_runs(owned, self._pinned)
        runtime = self.xp.cuda.runtime
        refused = []
        for start, size in runs:
            try:
                runtime.hostRegister(start, size, 0)
            except Exception as e:  # (a driver limit on locked memory, say)
                refused.append(str(e))
                continue
            self._pinned[start] = size
        self._held += arrays  # (kept alive while their pages are locked)
        if refused:
            warnings.warn(
                f"mpips: {len(refused)} host buffer run(s) stay pageable ({refused[0]})",
                stacklevel=2,
            )

    def unpin(self) -> None:
        """Release what ``pin`` page-locked (before the buffers go); every run is tried."""
        runtime = self.xp.cuda.runtime if self._pinned else None
        for start in self._pinned:
            try:
                runtime.hostUnregister(start)  # type: ignore[union-attr]
            except Exception as e:  # (the others are still released)
                warnings.warn(f"mpips: unpinning host memory: {e}", stacklevel=2)
        self._pinned.clear()
        self._held.clear()

    def synchronize(self) -> None:
        """Wait for the device's queued work (copies from host buffers the host will
        overwrite next)."""
        if not self.on_host:
            self.xp.cuda.runtime.deviceSynchronize()

    def staged(self, device: dict[str, Any], host: dict[str, np.ndarray]) -> StagedGradients:
        """Gradients the model writes in ``device`` arrays, to be copied into the ``host``
        arrays of the same names as backward says each is ready (see StagedGradients)."""
        return StagedGradients(device, host, self.on_host, self.synchronize)

    def _buffer(self, key: str, like: np.ndarray) -> Any:
        """The device buffer kept under ``key`` for arrays like ``like``. Arrays whose row
        count changes from step to step (a CTR batch's table rows) get a view of its first
        rows: it is made again only for more rows than it has, then with twice as many."""
        buf, shape = self._buffers.get(key), like.shape
        if buf is not None and buf.dtype == like.dtype:
            if buf.shape == shape:
                return buf
            if buf.ndim == like.ndim >= 1 and buf.shape[1:] == shape[1:]:  # other rows
                if len(buf) > len(like):
                    return buf[: len(like)]
                shape = (grown(len(buf), len(like)), *shape[1:])
        buf = self._buffers[key] = self.xp.empty(shape, like.dtype)
        self.allocations += 1
        return buf if shape == like.shape else buf[: len(like)]

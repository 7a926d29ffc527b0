"""Array backend: numpy on the CPU, cupy on a GPU (one device per worker on a node); BLAS
pinning."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..process import settings
from . import standin


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def issparse(a: Any) -> bool:
    """A scipy sparse matrix (CSR rows). scipy.sparse is imported by the code that makes one
    (sparse data, the CTR models), not at start-up (~0.2 s of CPU a process): if it is not
    loaded, nothing is sparse."""
    sp = sys.modules.get("scipy.sparse")
    return sp is not None and sp.issparse(a)


BLAS_THREADS_ENV = "MPIPS_BLAS_THREADS"  # a rank's BLAS threads, set by hand (benchmarks)
# the variables each kind of threaded library reads at load (threadpoolctl's internal_api):
# a count the user set there wins over the share mpips would give the rank
LIBRARY_THREAD_VARIABLES = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
    "flexiblas": ("FLEXIBLAS_NUM_THREADS", "OMP_NUM_THREADS"),
}


def node_blas_threads(cores: int, ranks: int, ps: int = 0) -> list[int]:
    """BLAS threads of each of the ``ranks`` ranks on a node of ``cores`` cores, ``ps`` of
    them PS tasks: the PS tasks' first, then the workers' in their order on the node.

    A PS task computes no matrix products (its updates are serial kernels), so it gets 1;
    the workers split the other cores, the remainder going one each to the first workers, so
    the node's total is its cores: 1 PS + 8 workers on 16 cores is 1 + 7 x 2 + 1 (an even
    split of 16 // 9 left 7 cores idle). With more ranks than cores every rank gets 1.
    """
    if cores < 1 or ranks < 1 or not 0 <= ps <= ranks:
        raise ValueError(f"node_blas_threads({cores}, {ranks}, {ps}): no such node")
    workers = ranks - ps
    base, extra = divmod(max(0, cores - ps), workers) if workers else (0, 0)
    return [1] * ps + [max(1, base + (i < extra)) for i in range(workers)]


def blas_threads_override() -> int | None:
    """The threads MPIPS_BLAS_THREADS asks for (None when unset or empty; ConfigError for a
    bad value)."""
    return settings.current().blas_threads


def user_thread_count(internal_api: str) -> str | None:
    """The variable that sets the threads of a library of kind ``internal_api`` (openblas,
    mkl, blis, openmp, ...) where the user set one (``OMP_NUM_THREADS=1``), else None. The
    library read it when it loaded, so leaving it alone keeps the user's count."""
    set_here = settings.current().thread_variables
    names = LIBRARY_THREAD_VARIABLES.get(internal_api, ("OMP_NUM_THREADS",))
    return next((n for n in names if n in set_here), None)


def pin_blas_threads(
    local_size: int, ps_on_node: int | None = None, local_worker: int | None = None
) -> int:
    """Limit this rank's BLAS threads to its share of the node's cores; returns the share.

    With ``ps_on_node`` (the PS tasks among the ``local_size`` ranks on this node), the share
    is ``node_blas_threads``'s: 1 for a PS task (``local_worker`` None), else worker number
    ``local_worker`` of the node's workers gets its part of the other cores. Without it,
    every rank gets ``cores // local_size`` (the rule before PS tasks were told apart).
    MPIPS_BLAS_THREADS, when set, is the share of every library. Otherwise a library whose
    own thread count the user set (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS,
    ...: user_thread_count) keeps it, and the others get the share. Default BLAS threading
    made the reference MLP ~10x slower with 8 ranks on 2 cores.
    """
    from threadpoolctl import ThreadpoolController

    threads = blas_threads_override()
    by_hand = threads is not None
    if threads is None:
        if ps_on_node is None:
            threads = max(1, cpu_count() // max(1, local_size))
        else:
            shares = node_blas_threads(cpu_count(), max(1, local_size), ps_on_node)
            threads = 1 if local_worker is None else shares[ps_on_node + local_worker]
    for library in ThreadpoolController().lib_controllers:
        if by_hand or user_thread_count(library.internal_api) is None:
            library.set_num_threads(threads)
    return threads


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
        runs = _page_runs(owned, self._pinned)
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


class SparseBatch:
    """A CSR batch on the device as its nonzeros (value, column, row), and the two products
    a sparse model takes with it: gathers and scatter-adds (on the stand-in in the nonzeros'
    order, scipy's; on a GPU atomic adds, in any order). cupy's own sparse matrices have no strict
    stand-in, and these two are all an embedding lookup and its gradient need."""

    def __init__(self, xp: ModuleType, a: Any):
        import scipy.sparse as sp

        a = sp.csr_matrix(a)
        self.xp, self.shape = xp, a.shape
        self.values = xp.asarray(np.asarray(a.data, np.float32))
        self.cols = xp.asarray(a.indices.astype(np.int64))
        self.rows = xp.asarray(np.repeat(np.arange(a.shape[0], dtype=np.int64), np.diff(a.indptr)))

    def times(self, w: Any) -> Any:
        """``batch @ w`` for a (columns, d) device array: each row's weighted sum of rows."""
        out = self.xp.zeros((self.shape[0], w.shape[1]), w.dtype)
        scatter_add(self.xp, out, self.rows, w[self.cols] * self.values[:, None])
        return out

    def transposed_times(self, d: Any) -> Any:
        """``batch.T @ d`` for a (rows, k) device array: the gradient of ``times``' ``w``,
        per column, repeated columns summed."""
        out = self.xp.zeros((self.shape[1], d.shape[1]), d.dtype)
        scatter_add(self.xp, out, self.cols, d[self.rows] * self.values[:, None])
        return out


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


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def grown(have: int, need: int) -> int:
    """Rows of a kept buffer made again to hold ``need`` rows where it holds ``have``: at
    least twice as many, so one that keeps growing is made again only a few times."""
    return max(need, 2 * have)


def page_aligned(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised host array on whole pages of its own: a buffer made while others are
    page-locked (a CTR table's kept rows, grown) shares no page with them, so locking it
    never meets a locked page (which CUDA refuses), and no other array lies on its pages."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(-(-nbytes // PAGE) * PAGE + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def page_zeros(shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
    """A zeroed host array on whole pages of its own (see page_aligned): a buffer a GPU
    worker page-locks (``Device.pin``)."""
    dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
    a = page_aligned(tuple(int(n) for n in dims), dtype)
    a[...] = 0
    return a


def owns_pages(a: np.ndarray) -> bool:
    """Whether every page ``a`` lies on belongs to its own allocation, so that locking them
    locks no one else's memory. CUDA takes a copy that begins in a locked page for a copy
    from pinned memory, and cupy's asarray copies straight from an array that begins there:
    another array on a locked page (made next to a heap buffer) then fails to copy when it
    runs past the locked pages (cudaErrorInvalidValue). True for arrays made by
    page_aligned and for MPI's memory (a shared window: a mapping of its own); false for
    most small numpy arrays, which share heap pages, and for other foreign buffers (a bytes
    object lies on the heap too)."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    # MPI's memory: what mpips pins of it is shared windows' (MPI_Win_allocate_shared, a
    # mapping of its own, where no numpy array of others lies); a window of Win.Allocate
    # may be heap memory, and must not be pinned
    if root.base is not None:
        return type(root.base).__module__ == "mpi4py.MPI"
    lo = a.ctypes.data // PAGE * PAGE
    hi = -(-(a.ctypes.data + a.nbytes) // PAGE) * PAGE
    return root.ctypes.data <= lo and hi <= root.ctypes.data + root.nbytes


def _page_runs(arrays: list[np.ndarray], locked: dict[int, int]) -> list[tuple[int, int]]:
    """The pages the arrays lie on, as (start, bytes) runs of whole pages, merged where
    they touch or overlap, less the runs ``locked`` already covers whole."""
    spans = sorted(
        (a.ctypes.data // PAGE * PAGE, -(-(a.ctypes.data + a.nbytes) // PAGE) * PAGE)
        for a in arrays
    )
    runs: list[list[int]] = []
    for lo, hi in spans:
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    covered = [(s, s + n) for s, n in locked.items()]
    return [(lo, hi - lo) for lo, hi in runs if not any(s <= lo and hi <= e for s, e in covered)]


def scatter_add(xp: ModuleType, target: Any, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices summed: ``np.add.at`` on the CPU,
    ``cupyx.scatter_add`` for any other array module (cupy)."""
    if xp is np:
        np.add.at(target, index, values)
    elif xp is standin:
        standin.scatter_add(target, index, values)
    else:
        import cupyx

        cupyx.scatter_add(target, index, values)


def array_module(a: Any) -> ModuleType:
    """numpy for a numpy array, else the array's own module (cupy, or the stand-in)."""
    if isinstance(a, np.ndarray):
        return np
    return standin if isinstance(a, standin.ndarray) else __import__("cupy").get_array_module(a)


def to_host(a: Any) -> np.ndarray:
    """A device array's values in host memory (a numpy array as it is)."""
    return a if isinstance(a, np.ndarray) else a.get()

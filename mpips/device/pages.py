"""Host memory on whole pages of its own (page_aligned, page_zeros), so a GPU worker can
page-lock it: which arrays own their pages, and the page runs to lock; the growth rule of
kept buffers (grown)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

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


def page_runs(arrays: list[np.ndarray], locked: dict[int, int]) -> list[tuple[int, int]]:
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

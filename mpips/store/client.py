"""Worker side of the store: pull (Get), push (Accumulate), and the global_step counter.

All variables of one PS are contiguous in its window, so a pull is one ``Get`` per PS and a
push one ``Accumulate`` per PS and dtype run, whatever the number of variables.
"""
from __future__ import annotations

import time
from itertools import groupby

import numpy as np
from mpi4py import MPI

from ..placement import Placement
from .cluster import POLL_SECONDS
from .window import GLOBAL_STEP, READY, TICKETS, Windows

_ONE = np.ones(1, dtype=np.int64)


class StoreClient:
    """Pull/push the whole model through host buffers laid out exactly like the PS windows.

    ``params`` and ``grads`` map variable names to numpy views into those buffers: the model
    reads parameters and writes gradients in place, so no copy is made on either path.
    """

    def __init__(self, windows: Windows, placement: Placement):
        self.windows = windows
        self.placement = placement
        self.ps_ranks = windows.layout.ps_ranks
        self._param_bufs = [np.zeros(placement.ps_bytes(p), np.uint8)
                            for p in range(placement.num_ps)]
        self._grad_bufs = [np.zeros_like(b) for b in self._param_bufs]
        self.params = self._views(self._param_bufs)
        self.grads = self._views(self._grad_bufs)
        # contiguous same-dtype runs per PS: one typed Accumulate each
        self._runs: list[list[tuple[int, int, np.dtype]]] = []
        for p in range(placement.num_ps):
            runs = []
            for dtype, group in groupby(placement.on_ps(p), key=lambda e: e.spec.dtype):
                group = list(group)
                start = group[0].offset
                end = group[-1].offset + group[-1].spec.nbytes
                runs.append((start, end - start, np.dtype(dtype)))
            self._runs.append(runs)

    def _views(self, bufs: list[np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for e in self.placement:
            raw = bufs[e.ps_task][e.offset:e.offset + e.spec.nbytes]
            out[e.spec.name] = raw.view(e.spec.dtype).reshape(e.spec.shape)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes moved by one pull (and by one push)."""
        return sum(b.size for b in self._param_bufs)

    def pull(self) -> dict[str, np.ndarray]:
        """Read every variable from its PS (one Get per PS), return the views."""
        win = self.windows.params
        for p, buf in enumerate(self._param_bufs):
            if buf.size:
                win.Get([buf, MPI.BYTE], self.ps_ranks[p], [0, buf.size, MPI.BYTE])
        for p, buf in enumerate(self._param_bufs):
            if buf.size:
                win.Flush(self.ps_ranks[p])
        return self.params

    def push(self) -> None:
        """Add ``self.grads`` (already turned into deltas) into the PS windows, atomically per element."""
        win = self.windows.params
        for p, buf in enumerate(self._grad_bufs):
            for start, nbytes, dtype in self._runs[p]:
                data = buf[start:start + nbytes].view(dtype)
                mpi_type = MPI.Datatype.fromcode(dtype.char)  # predefined: fast path
                win.Accumulate([data, mpi_type], self.ps_ranks[p],
                               [start, data.size, mpi_type], MPI.SUM)
        for p in range(len(self._grad_bufs)):
            if self._runs[p]:
                win.Flush(self.ps_ranks[p])

    def write(self, values: dict[str, np.ndarray]) -> None:
        """Overwrite every variable on the PS (chief initialisation / restore)."""
        for name, view in self.params.items():
            view[...] = values[name]
        win = self.windows.params
        for p, buf in enumerate(self._param_bufs):
            if buf.size:
                win.Put([buf, MPI.BYTE], self.ps_ranks[p], [0, buf.size, MPI.BYTE])
                win.Flush(self.ps_ranks[p])

    # -- counters on ps task 0 ------------------------------------------------------------
    def _fetch_and_op(self, index: int, value: np.ndarray | None, op: MPI.Op) -> int:
        win, target = self.windows.control, self.windows.control_rank
        result = np.zeros(1, dtype=np.int64)
        win.Fetch_and_op(_ONE if value is None else value, result, target, index, op)
        win.Flush(target)
        return int(result[0])

    def claim_ticket(self) -> int:
        """Reserve the right to make one update; tickets >= the step target mean stop."""
        return self._fetch_and_op(TICKETS, None, MPI.SUM)

    def advance_step(self) -> int:
        """Count one applied update; returns its global step (unique across all workers)."""
        return self._fetch_and_op(GLOBAL_STEP, None, MPI.SUM) + 1

    def global_step(self) -> int:
        return self._fetch_and_op(GLOBAL_STEP, _ONE, MPI.NO_OP)

    def set_counters(self, step: int) -> None:
        """Chief, before raising ready: start global_step (and tickets) at ``step``."""
        value = np.array([step], dtype=np.int64)
        self._fetch_and_op(GLOBAL_STEP, value, MPI.REPLACE)
        self._fetch_and_op(TICKETS, value, MPI.REPLACE)

    def raise_ready(self) -> None:
        self._fetch_and_op(READY, _ONE, MPI.REPLACE)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait (sleeping) until the chief has initialised or restored the variables."""
        start = time.monotonic()
        while self._fetch_and_op(READY, _ONE, MPI.NO_OP) == 0:
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"chief did not raise the ready flag within {timeout:.0f} s")
            time.sleep(POLL_SECONDS)

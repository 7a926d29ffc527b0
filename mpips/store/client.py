"""Worker side of the store: pull (Get), push (Accumulate, or inbox + mailbox for stateful
optimizers), and the optimizer slots for checkpoints.

All variables of one PS are contiguous in its window, so a pull is one ``Get`` per PS and a
push one ``Accumulate`` (or one ``Put``) per PS and dtype run, whatever the number of variables.
"""
from __future__ import annotations

import time
from itertools import groupby

import numpy as np
from mpi4py import MPI

from ..errors import Stalled
from .cluster import STALL_TIMEOUT
from .counters import Counters
from .window import MAIL_FLAG, MAIL_LR, MAIL_WORDS, Windows, views

ACK_POLL_SECONDS = 5e-5


class StoreClient:
    """Pull/push the whole model through host buffers laid out exactly like the PS windows.

    ``params`` and ``grads`` map variable names to numpy views into those buffers: the model
    reads parameters and writes gradients in place, so no copy is made on either path.
    """

    def __init__(self, windows: Windows, task: int, stateful: bool = False):
        self.windows = windows
        self.placement = placement = windows.placement
        self.task = task
        self.stateful = stateful
        self.counters = Counters(windows)
        self.ps_ranks = windows.layout.ps_ranks
        num_ps = placement.num_ps
        self._param_bufs = [np.zeros(placement.ps_bytes(p), np.uint8) for p in range(num_ps)]
        self._grad_bufs = [np.zeros_like(b) for b in self._param_bufs]
        # (ps task, rank, variable buffer) of every PS holding variables: walked by every
        # pull and push, so computed once
        self._targets = [(p, self.ps_ranks[p], buf) for p, buf in enumerate(self._param_bufs)
                         if buf.size]
        self.params = views(placement, self._param_bufs)
        self.grads = views(placement, self._grad_bufs)
        self._slot_base = [placement.ps_bytes(p) for p in range(num_ps)]
        self._slot_bufs = [np.zeros(windows.state_bytes(p) - self._slot_base[p], np.uint8)
                           for p in range(num_ps)]
        self.slots = views(windows.slots, self._slot_bufs, self._slot_base) \
            if windows.slots else {}
        # contiguous same-dtype runs per PS: one typed Accumulate each
        self._runs: list[list[tuple[int, int, np.dtype]]] = []
        for p in range(num_ps):
            runs = []
            for dtype, group in groupby(placement.on_ps(p), key=lambda e: e.spec.dtype):
                group = list(group)
                start = group[0].offset
                end = group[-1].offset + group[-1].spec.nbytes
                runs.append((start, end - start, np.dtype(dtype)))
            self._runs.append(runs)

    @property
    def nbytes(self) -> int:
        """Bytes moved by one pull (and by one push)."""
        return sum(b.size for b in self._param_bufs)

    def pull(self) -> dict[str, np.ndarray]:
        """Read every variable from its PS (one Get per PS), return the views."""
        win = self.windows.params
        for p, rank, buf in self._targets:
            win.Get([buf, MPI.BYTE], rank, [0, buf.size, MPI.BYTE])
        for p, rank, buf in self._targets:
            win.Flush(rank)
        return self.params

    def push(self, lr: float = 0.0) -> None:
        """Send ``self.grads`` to the PS.

        Plain SGD: the grads already hold deltas (``-lr * grad``); Accumulate adds them,
        atomically per element. Stateful optimizers: Put the gradient into this worker's
        inbox on each PS, raise its mail flag with ``lr``, and wait until every PS has applied
        it (so the next pull sees this update, and the inbox is free again).
        """
        if self.stateful:
            self._post(lr)
            self._wait_applied()
            return
        win = self.windows.params
        for p, rank, _ in self._targets:
            for start, nbytes, dtype in self._runs[p]:
                data = self._grad_bufs[p][start:start + nbytes].view(dtype)
                mpi_type = MPI.Datatype.fromcode(dtype.char)  # predefined: fast path
                win.Accumulate([data, mpi_type], rank, [start, data.size, mpi_type], MPI.SUM)
        for p, rank, _ in self._targets:
            win.Flush(rank)

    def _post(self, lr: float) -> None:
        win, mail = self.windows.params, self.windows.mail
        for p, rank, _ in self._targets:
            buf = self._grad_bufs[p]
            win.Put([buf, MPI.BYTE], rank, [self.windows.inbox_offset(p, self.task), buf.size,
                                            MPI.BYTE])
        for p, rank, _ in self._targets:
            win.Flush(rank)  # the gradient is in place before the flag goes up
        base = MAIL_WORDS * self.task
        lr_word = np.array([lr], dtype=np.float64).view(np.int64)
        one, old = np.ones(1, np.int64), np.zeros(1, np.int64)
        for p, rank, _ in self._targets:
            mail.Fetch_and_op(lr_word, old, rank, base + MAIL_LR, MPI.REPLACE)
            mail.Flush(rank)
            mail.Fetch_and_op(one, old, rank, base + MAIL_FLAG, MPI.REPLACE)
        for p, rank, _ in self._targets:
            mail.Flush(rank)

    def _wait_applied(self) -> None:
        mail, flag = self.windows.mail, MAIL_WORDS * self.task + MAIL_FLAG
        pending = [rank for _, rank, _ in self._targets]
        out, dummy = np.zeros(1, np.int64), np.zeros(1, np.int64)
        deadline = time.monotonic() + STALL_TIMEOUT + 2.0 * min(self.task, 5)  # see watchdog
        while pending:
            if time.monotonic() > deadline:
                names = ", ".join(f"/job:ps/task:{self.ps_ranks.index(r)} (rank {r})"
                                  for r in pending)
                raise Stalled(f"{names} did not apply this worker's update within "
                              f"{STALL_TIMEOUT:.0f} s: hung? (MPIPS_STALL_TIMEOUT sets the "
                              f"limit); aborting the job")
            for rank in list(pending):
                mail.Fetch_and_op(dummy, out, rank, flag, MPI.NO_OP)
                mail.Flush(rank)
                if out[0] == 0:
                    pending.remove(rank)
            if pending:
                time.sleep(ACK_POLL_SECONDS)  # let the PS have the core

    def write(self, values: dict[str, np.ndarray], slots: dict[str, np.ndarray] | None = None
              ) -> None:
        """Overwrite every variable (and slot) on the PS (chief initialisation / restore)."""
        for name, view in self.params.items():
            view[...] = values[name]
        for name, view in self.slots.items():
            view[...] = (slots or {})[name]
        win = self.windows.params
        for p, rank, buf in self._targets:
            win.Put([buf, MPI.BYTE], rank, [0, buf.size, MPI.BYTE])
            if self._slot_bufs[p].size:
                sbuf = self._slot_bufs[p]
                win.Put([sbuf, MPI.BYTE], rank, [self._slot_base[p], sbuf.size, MPI.BYTE])
            win.Flush(rank)

    def pull_slots(self) -> dict[str, np.ndarray]:
        """Read every optimizer slot (for checkpoints)."""
        win = self.windows.params
        for p, rank, _ in self._targets:
            sbuf = self._slot_bufs[p]
            if sbuf.size:
                win.Get([sbuf, MPI.BYTE], rank, [self._slot_base[p], sbuf.size, MPI.BYTE])
                win.Flush(rank)
        return self.slots

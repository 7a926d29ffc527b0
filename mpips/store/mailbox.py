"""The mailbox protocol of stateful optimizers, both ends in one place.

A worker Puts its gradient into its own inbox in each PS window (whole variables, then one
row box per table partition), flushes, writes the learning rate into its mail slot and
raises its mail flag. The PS, polling the flags, sees the gradient (``Win.Sync``), applies
it, and clears the flag. The worker waits until every PS has cleared its flag: then the
next pull sees the update and the inbox is free again. One update in flight per worker, so
the inboxes never need more than one slot.
"""
from __future__ import annotations

from typing import NoReturn

import numpy as np
from mpi4py import MPI

from ..errors import Stalled
from ..waits import poll
from .cluster import STALL_TIMEOUT, stall_limit
from .window import MAIL_FLAG, MAIL_LR, MAIL_WORDS, RowBox, Windows

ACK_FAST_SECONDS = 0.02  # how long a worker checks every 50 us that the PS applied its update
# what a worker posts to one PS task for one table: its row box there, the number of rows,
# their local row numbers and their gradient rows
RowPost = tuple[RowBox, tuple[int, np.ndarray, np.ndarray]]


class WorkerMail:
    """The worker end: post an update to every PS task, and wait until all applied it."""

    def __init__(self, windows: Windows, task: int):
        self.windows, self.task = windows, task
        self.ps_ranks = windows.layout.ps_ranks
        num_ps = windows.placement.num_ps
        self.inboxes = [windows.inbox_offset(p, task) for p in range(num_ps)]

    def post(self, dense: list[np.ndarray], rows: dict[int, list[RowPost]], lr: float) -> None:
        """Put ``dense[p]`` (the whole variables' gradients of PS task ``p``, as bytes) and
        ``rows[p]`` into this worker's inboxes, then raise the flags with ``lr``."""
        win, mail = self.windows.params, self.windows.mail
        for p, buf in enumerate(dense):
            if buf.size:
                win.Put([buf, MPI.BYTE], self.ps_ranks[p], [self.inboxes[p], buf.size, MPI.BYTE])
        staged = []  # alive until the Flush
        for p, posts in rows.items():
            inbox, rank = self.inboxes[p], self.ps_ranks[p]
            for box, (n, local, grads) in posts:
                count = np.array([n], np.int64)
                staged += [count, local, grads]
                win.Put([count, MPI.BYTE], rank, [inbox + box.count, 8, MPI.BYTE])
                if n:
                    win.Put([local, MPI.BYTE], rank, [inbox + box.rows, local.nbytes, MPI.BYTE])
                    win.Put([grads, MPI.BYTE], rank, [inbox + box.grads, grads.nbytes, MPI.BYTE])
        for rank in self.ps_ranks:
            win.Flush(rank)  # the gradient is in place before the flag goes up
        base = MAIL_WORDS * self.task
        lr_word = np.array([lr], dtype=np.float64).view(np.int64)
        one, old = np.ones(1, np.int64), np.zeros(1, np.int64)
        for rank in self.ps_ranks:
            mail.Fetch_and_op(lr_word, old, rank, base + MAIL_LR, MPI.REPLACE)
            mail.Flush(rank)
            mail.Fetch_and_op(one, old, rank, base + MAIL_FLAG, MPI.REPLACE)
        for rank in self.ps_ranks:
            mail.Flush(rank)

    def wait_applied(self) -> None:
        """Until every PS has applied this worker's update (its mail flag is clear again);
        Stalled naming the PS tasks that did not within the stall limit."""
        mail, flag = self.windows.mail, MAIL_WORDS * self.task + MAIL_FLAG
        pending = list(self.ps_ranks)
        out, dummy = np.zeros(1, np.int64), np.zeros(1, np.int64)

        def applied() -> bool:
            for rank in list(pending):
                mail.Fetch_and_op(dummy, out, rank, flag, MPI.NO_OP)
                mail.Flush(rank)
                if out[0] == 0:
                    pending.remove(rank)
            return not pending

        def late(waited: float) -> NoReturn:
            names = ", ".join(f"/job:ps/task:{self.ps_ranks.index(r)} (rank {r})" for r in pending)
            raise Stalled(f"{names} did not apply this worker's update within "
                          f"{STALL_TIMEOUT:.0f} s: hung? (MPIPS_STALL_TIMEOUT sets the "
                          f"limit); aborting the job")
        # 50 us sleeps while an apply usually completes (the PS needs the core), then longer
        poll(applied, stall_limit(self.task), late, fast=ACK_FAST_SECONDS)


class PsMail:
    """The PS end (this rank): which workers posted an update, and the acknowledgement."""

    def __init__(self, windows: Windows, rank: int):
        self.windows, self.rank = windows, rank
        self._flag = np.zeros(1, np.int64)
        self._lr = np.zeros(1, np.int64)
        self._zero = np.zeros(1, np.int64)

    def take(self, worker: int) -> float | None:
        """The learning rate of ``worker``'s posted update, with its gradient visible in the
        inbox; None if it has posted none."""
        mail, base = self.windows.mail, MAIL_WORDS * worker
        mail.Fetch_and_op(self._zero, self._flag, self.rank, base + MAIL_FLAG, MPI.NO_OP)
        mail.Flush(self.rank)
        if self._flag[0] == 0:
            return None
        mail.Fetch_and_op(self._zero, self._lr, self.rank, base + MAIL_LR, MPI.NO_OP)
        mail.Flush(self.rank)
        self.windows.params.Sync()  # see the worker's Put of the gradient
        return float(self._lr.view(np.float64)[0])

    def applied(self, worker: int) -> None:
        """``worker``'s update is applied (and visible): clear its flag."""
        self.windows.params.Sync()
        self.windows.mail.Fetch_and_op(self._zero, self._flag, self.rank,
                                       MAIL_WORDS * worker + MAIL_FLAG, MPI.REPLACE)
        self.windows.mail.Flush(self.rank)

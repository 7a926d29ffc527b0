"""The mailbox protocol of stateful optimizers, end to end: the worker's post and the PS's
reading and acknowledgement (the inbox layout: inbox.py).

Every PS window ends with one gradient inbox per worker (window.py puts them after the
variables and slots, ``Inbox.nbytes`` each). An inbox holds a gradient of every whole
variable of that PS, laid out as the variables are, then, per table partition, a row box:
``[row count | local row indices | gradient rows]`` for at most ``row_capacity`` rows (the
most unique ids one batch can touch). Every PS also has a small int64 mail window: per
worker, ``[flag, learning rate (float64 bits)]``.

A worker Puts its gradient into its own inbox in each PS window and the learning rate into
its mail slot, flushes, and raises its mail flag (an atomic). The PS, polling the flags,
sees the gradient (``Win.Sync``), applies it, and clears the flag. The worker waits until
every PS has cleared its flag: then the next pull sees the update and the inbox is free
again. One update in flight per worker, so the inboxes never need more than one slot (a
worker may go on with its next batch meanwhile: StoreClient.push(wait=False)).

Only the raising of a flag is an atomic. The PS reads and clears the flags in its own memory
with plain loads and stores between ``Win.Sync`` calls (MPI's unified memory model), and a
worker polls with a plain ``Get``: MPICH serialises the atomics on a window with a lock, and
on an oversubscribed node a poller descheduled while holding it stalled the PS's own atomics
for milliseconds (measured: p99 2.5 ms with atomic polls, 0.1 ms with Get polls; the PS's
atomic clear cost 230 us a call). Flags are aligned int64 words, written and read whole, and
never written by both sides at once: a worker raises its flag only once it is clear, and the
PS clears only a raised one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from ..errors import Stalled
from ..process.waits import poll
from .cluster import peek, stall_limit, stall_timeout
from .inbox import MAIL_FLAG, MAIL_LR, MAIL_WORDS, mail_words
from .window import Windows

ACK_FAST_SECONDS = 0.02  # how long a worker checks every 50 us that the PS applied its update
_NO_ROWS = np.zeros(0, np.int64)
# one table's rows of a step on one PS task: (table, ps task, positions in the step's ids,
# rows in that task's part)
RoutedRows = tuple[str, int, np.ndarray | slice, np.ndarray]  # slice(None): all positions


DROPPED = -1  # a PS's answer to a gradient that came too late for its step (sync_replicas)


class WorkerMail:
    """The worker end: post an update to every PS task, and wait until all applied it."""

    def __init__(self, windows: Windows, task: int):
        self.windows, self.task = windows, task
        self.ps_ranks = windows.layout.ps_ranks
        num_ps = windows.placement.num_ps
        self.offsets = [windows.inbox_offset(p, task) for p in range(num_ps)]
        # every PS's row box of every table (a PS with none of a table's rows this step
        # still gets its count, 0)
        self.boxes = [(p, boxes) for p in range(num_ps) if (boxes := windows.inbox(p).boxes)]

    def post(
        self,
        dense: Iterable[tuple[int, int, np.ndarray]],
        rows: dict[str, np.ndarray],
        routed: Iterable[RoutedRows],
        lr: float,
        tags: list[int] | None = None,
    ) -> None:
        """Put each ``dense`` (PS task, byte offset, bytes) of the dense gradients and
        the gradient ``rows`` of each table (by position in the step's ids; ``routed`` says
        which go to which PS and row) into this worker's inboxes, then raise the flags with
        ``lr``. ``tags[p]``: the step of PS ``p`` this gradient is for (sync_replicas; the
        flag carries it, plus one)."""
        win, mail = self.windows.params, self.windows.mail
        for p, offset, buf in dense:
            win.Put(
                [buf, MPI.BYTE], self.ps_ranks[p], [self.offsets[p] + offset, buf.size, MPI.BYTE]
            )
        if self.boxes:
            to = {(name, p): (at, local) for name, p, at, local in routed}
            staged = []  # alive until the Flush
            for p, boxes in self.boxes:
                inbox, rank = self.offsets[p], self.ps_ranks[p]
                for name, box in boxes.items():
                    at, local = to.get((name, p), (_NO_ROWS, _NO_ROWS))
                    n = len(local)
                    if n > box.capacity:
                        raise ValueError(
                            f"{n} rows of {name} for one PS exceed the inbox's {box.capacity}"
                        )
                    count = np.array([n], np.int64)
                    staged.append(count)
                    win.Put([count, MPI.BYTE], rank, [inbox + box.count, 8, MPI.BYTE])
                    if n:
                        local = np.ascontiguousarray(local, np.int64)
                        grads = np.ascontiguousarray(rows[name][at])
                        staged += [local, grads]
                        win.Put([local, MPI.BYTE], rank, [inbox + box.rows, local.nbytes, MPI.BYTE])
                        win.Put(
                            [grads, MPI.BYTE], rank, [inbox + box.grads, grads.nbytes, MPI.BYTE]
                        )
        base = MAIL_WORDS * self.task
        lr_word = np.array([lr], dtype=np.float64).view(np.int64)
        for rank in self.ps_ranks:  # the PS reads it only after it sees the flag
            mail.Put([lr_word, MPI.LONG], rank, [base + MAIL_LR, 1, MPI.LONG])
        for rank in self.ps_ranks:
            win.Flush(rank)  # the gradient and the learning rate are in place before the flag
            mail.Flush(rank)
        old = np.zeros(1, np.int64)
        flags = [np.array([t + 1 if tags else 1], np.int64) for t in (tags or self.ps_ranks)]
        for rank, flag in zip(self.ps_ranks, flags, strict=True):
            mail.Fetch_and_op(flag, old, rank, base + MAIL_FLAG, MPI.REPLACE)
        for rank in self.ps_ranks:
            mail.Flush(rank)

    def wait_applied(self) -> bool:
        """Until every PS has taken this worker's update (its mail flag is clear again);
        Stalled naming the PS tasks that did not within the stall limit. Returns whether
        every PS used it (False: one dropped it as too late for its step)."""
        mail, flag = self.windows.mail, MAIL_WORDS * self.task + MAIL_FLAG
        pending = list(self.ps_ranks)
        out = np.zeros(1, np.int64)
        used = True

        def applied() -> bool:
            nonlocal used
            for rank in list(pending):
                if peek(mail, rank, flag, out) <= 0:
                    pending.remove(rank)
                    used = used and out[0] == 0
            return not pending

        def late(waited: float) -> NoReturn:
            names = ", ".join(f"/job:ps/task:{self.ps_ranks.index(r)} (rank {r})" for r in pending)
            raise Stalled(
                f"{names} did not apply this worker's update within "
                f"{stall_timeout():.0f} s: hung? (MPIPS_STALL_TIMEOUT sets the "
                f"limit); aborting the job"
            )

        # 50 us sleeps while an apply usually completes (the PS needs the core), then longer
        poll(applied, stall_limit(self.task), late, fast=ACK_FAST_SECONDS)
        return used

    def ps_steps(self) -> list[int]:
        """Each PS task's aggregated step (sync_replicas), read with plain Gets: a worker
        polls it while it waits, and a rank killed inside one of MPICH's atomics on a
        same-node window leaves its lock held for good (survive mode)."""
        mail, word = self.windows.mail, mail_words(self.windows.layout.num_workers) - 1
        out = np.zeros(1, np.int64)
        return [peek(mail, rank, word, out) for rank in self.ps_ranks]

    def wait_steps(self, tags: list[int], stopping: Callable[[], bool]) -> bool:
        """Until every PS task ``p`` has aggregated past step ``tags[p]`` (sync_replicas),
        or ``stopping()``; returns False if it stopped. Stalled naming the PS tasks still
        at their step after the stall limit (too few workers pushing?)."""
        behind: list[int] = []

        def done() -> bool:
            behind[:] = [p for p, s in enumerate(self.ps_steps()) if s <= tags[p]]
            return not behind or stopping()

        def late(waited: float) -> NoReturn:
            names = ", ".join(f"/job:ps/task:{p} (step {tags[p]})" for p in behind)
            raise Stalled(
                f"{names} did not aggregate a step within {stall_timeout():.0f} s: too few "
                f"workers pushing for train.replicas_to_aggregate? (MPIPS_STALL_TIMEOUT sets "
                f"the limit); aborting the job"
            )

        poll(done, stall_limit(self.task), late, fast=ACK_FAST_SECONDS)
        return not behind


# what the PS reads of one posted update: the learning rate, the whole variables' gradients
# by name, and per table partition (table, local rows, their gradient rows)
Posted = tuple[float, dict[str, np.ndarray], list[tuple[str, np.ndarray, np.ndarray]]]


class PsMail:
    """The PS end (this rank, PS ``task``): the updates workers posted, read from the inboxes
    in its own window memory, and the acknowledgement."""

    def __init__(self, windows: Windows, task: int, rank: int):
        self.windows, self.rank = windows, rank
        self._flag = np.zeros(1, np.int64)
        self._zero = np.zeros(1, np.int64)
        self._words = windows.local(windows.mail).view(np.int64)  # its own mail words
        self.tag = 0
        memory, layout = windows.local(windows.params), windows.inbox(task)
        self.inboxes = []
        for k in range(windows.layout.num_workers):
            start = windows.inbox_offset(task, k)
            self.inboxes.append(layout.views(memory[start : start + layout.nbytes]))

    def take(self, worker: int) -> Posted | None:
        """``worker``'s posted update, its gradient visible in the inbox; None if it has
        posted none."""
        mail, base = self.windows.mail, MAIL_WORDS * worker
        mail.Sync()  # loads of its own memory see what workers wrote
        flag = int(self._words[base + MAIL_FLAG])
        if flag <= 0:  # none posted (0), or the last one was dropped (DROPPED)
            return None
        self.tag = flag - 1  # the step it is for (sync_replicas)
        # a barrier after the flag's load: the gradient and the learning rate (Put and
        # flushed before the flag went up) are read after it
        self.windows.params.Sync()
        lr = float(self._words[base + MAIL_LR : base + MAIL_LR + 1].view(np.float64)[0])
        dense, boxes = self.inboxes[worker]
        rows = []
        for name, _, (count, local, grads) in boxes:
            n = int(count[0])
            rows.append((name, local[:n], grads[:n]))
        return lr, dense, rows

    def applied(self, worker: int, dropped: bool = False) -> None:
        """``worker``'s update is applied (and visible), or ``dropped``: clear its flag."""
        self.windows.params.Sync()  # the update is visible before the flag clears
        self._words[MAIL_WORDS * worker + MAIL_FLAG] = DROPPED if dropped else 0
        self.windows.mail.Sync()

    def published_step(self) -> int:
        """The aggregated step this PS task last published (sync_replicas), or the step it
        starts from (async with a stateful optimizer: its update count continues there)."""
        word = mail_words(self.windows.layout.num_workers) - 1
        self.windows.mail.Fetch_and_op(self._zero, self._flag, self.rank, word, MPI.NO_OP)
        self.windows.mail.Flush(self.rank)
        return int(self._flag[0])

    def publish_step(self, step: int) -> None:
        """This PS task has aggregated up to ``step`` (sync_replicas); its variables are
        visible first."""
        self.windows.params.Sync()
        word = mail_words(self.windows.layout.num_workers) - 1
        value = np.array([step], np.int64)
        self.windows.mail.Fetch_and_op(value, self._flag, self.rank, word, MPI.REPLACE)
        self.windows.mail.Flush(self.rank)


def publish_start_step(windows: Windows, task: int, rank: int, step: int) -> None:
    """PS ``task`` (this rank): the step it starts from (the restored global_step), set
    before the start-of-training barrier, so no worker reads a step word not yet set
    (sync_replicas) and the PS's update count does not depend on when its loop starts
    (async: a worker counts its update in global_step before the PS applied it)."""
    PsMail(windows, task, rank).publish_step(step)

"""The control counters on ps task 0, moved with MPI atomics (``Fetch_and_op``):
global_step, step tickets, the chief's ready flag, the stop signal, checkpoint requests and
one clock per worker."""
from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .cluster import POLL_SECONDS
from .window import CKPT_DONE, CKPT_SEQ, CKPT_STEP, CLOCKS, GLOBAL_STEP, READY, STOP, TICKETS, Windows

_ONE = np.ones(1, dtype=np.int64)
NO_MORE_TICKETS = 1 << 62  # every later claim is past any step target


class Counters:
    """Atomic access to the control window from any rank."""

    def __init__(self, windows: Windows):
        self.win = windows.control
        self.target = windows.control_rank
        self.num_workers = windows.layout.num_workers

    def _op(self, index: int, value: np.ndarray | None, op: MPI.Op) -> int:
        result = np.zeros(1, dtype=np.int64)
        self.win.Fetch_and_op(_ONE if value is None else value, result, self.target, index, op)
        self.win.Flush(self.target)
        return int(result[0])

    def claim_ticket(self) -> int:
        """Reserve the right to make one update; tickets >= the step target mean stop."""
        return self._op(TICKETS, None, MPI.SUM)

    def advance_step(self) -> int:
        """Count one applied update; returns its global step (unique across all workers)."""
        return self._op(GLOBAL_STEP, None, MPI.SUM) + 1

    def global_step(self) -> int:
        return self._op(GLOBAL_STEP, _ONE, MPI.NO_OP)

    def set_counters(self, step: int, clocks: list[int] | None = None) -> None:
        """Chief, before raising ready: start global_step (and tickets, clocks) at ``step``."""
        value = np.array([step], dtype=np.int64)
        self._op(GLOBAL_STEP, value, MPI.REPLACE)
        self._op(TICKETS, value, MPI.REPLACE)
        for task, clock in enumerate(clocks or []):
            self.publish_clock(task, clock)

    def request_stop(self, signum: int) -> None:
        """Stop the whole job at the next step boundary of every worker (preemption)."""
        self._op(STOP, np.array([signum], dtype=np.int64), MPI.REPLACE)
        self._op(TICKETS, np.array([NO_MORE_TICKETS], dtype=np.int64), MPI.REPLACE)

    def stop_signal(self) -> int:
        """The signal that stopped the job early (0: none)."""
        return self._op(STOP, _ONE, MPI.NO_OP)

    def request_checkpoint(self, step: int) -> int:
        """Chief: ask every PS to write its shard of checkpoint ``step``; returns the
        request's number (the PS tasks have all written it when shards_written() reaches
        number x num_ps)."""
        self._op(CKPT_STEP, np.array([step], dtype=np.int64), MPI.REPLACE)
        return self._op(CKPT_SEQ, None, MPI.SUM) + 1

    def checkpoint_request(self) -> tuple[int, int]:
        """PS: (number, global_step) of the latest checkpoint request (0, 0: none yet)."""
        return self._op(CKPT_SEQ, _ONE, MPI.NO_OP), self._op(CKPT_STEP, _ONE, MPI.NO_OP)

    def shard_written(self) -> None:
        self._op(CKPT_DONE, None, MPI.SUM)

    def wait_shards(self, count: int) -> None:
        """Chief: sleep until ``count`` shards have been written in this run."""
        while self._op(CKPT_DONE, _ONE, MPI.NO_OP) < count:
            time.sleep(POLL_SECONDS)

    def raise_ready(self) -> None:
        self._op(READY, _ONE, MPI.REPLACE)

    def is_ready(self) -> bool:
        return self._op(READY, _ONE, MPI.NO_OP) != 0

    def wait_ready(self, timeout: float | None = None) -> None:
        """Wait (sleeping) until the chief has initialised or restored the variables."""
        start = time.monotonic()
        while not self.is_ready():
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"chief did not raise the ready flag within {timeout:.0f} s")
            time.sleep(POLL_SECONDS)

    def publish_clock(self, task: int, clock: int, done: bool = False) -> None:
        """Worker ``task`` has pushed ``clock`` updates; ``done``: it will push no more."""
        self._op(CLOCKS + task, np.array([clock], dtype=np.int64), MPI.REPLACE)
        if done:
            self._op(CLOCKS + self.num_workers + task, _ONE, MPI.REPLACE)

    def clocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(clock, done) of every worker, read atomically (Get_accumulate NO_OP) in one call."""
        n = 2 * self.num_workers
        out = np.zeros(n, dtype=np.int64)
        self.win.Get_accumulate([out, MPI.LONG], [out, MPI.LONG], self.target,
                                [CLOCKS, n, MPI.LONG], MPI.NO_OP)
        self.win.Flush(self.target)
        return out[:self.num_workers], out[self.num_workers:].astype(bool)

    def lead(self, clock: int) -> int:
        """How many updates ``clock`` is ahead of the slowest worker still running."""
        clocks, done = self.clocks()
        running = clocks[~done]
        return clock - int(running.min()) if running.size else 0

"""The run's control counters on ps task 0: global_step, step tickets, the chief's ready
flag, the stop signal, checkpoint requests and the shard each PS task wrote for them, the end
of the run, the first failure, and one clock per worker.

An async worker's step touches them twice (``begin_step``, ``end_step``). With every rank on
one node they are node-shared memory moved with the CPU's atomics (~0.5-0.8 us each); otherwise
MPI atomics, each step's several counters in one ``Get_accumulate`` over an indexed
datatype: every MPI atomic on a window takes MPICH's window lock, and on an oversubscribed
node each costs tens of microseconds (five per step were a fifth of a CTR step's overhead).

Every wait on them has a deadline and names the task that did not arrive (waits.poll).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from ..errors import Stalled, StartTimeout
from ..process.waits import poll
from . import liveness
from .cluster import stall_timeout, start_timeout, unreachable
from .window import (
    CKPT_SEQ,
    CKPT_STEP,
    ENDED,
    FAILED,
    GLOBAL_STEP,
    READY,
    SHARDS,
    STOP,
    TICKETS,
    WORDS_PER_WORKER,
    Windows,
)

_TWO_ONES = np.ones(2, dtype=np.int64)
_END_MARKED = np.array([1, 1, -1], np.int64)  # global_step, a clock, its inflight word
NO_MORE_TICKETS = 1 << 62  # every later claim is past any step target
LOST = 2  # a worker's done flag: declared dead (1: it finished)


class _Words:
    """Where the survive-mode words are: after the clocks and done flags, each worker's
    claimed and not yet counted steps (inflight) and the last step it counted, then the
    count of steps to issue again."""

    clocks_at: int
    num_workers: int

    @property
    def inflight_at(self) -> int:
        return self.clocks_at + 2 * self.num_workers

    @property
    def last_at(self) -> int:
        return self.clocks_at + 3 * self.num_workers

    @property
    def reissue_at(self) -> int:
        return self.clocks_at + WORDS_PER_WORKER * self.num_workers


class _MpiCounters(_Words):
    """The counters through MPI atomics on the control window (ranks on several nodes). In
    survive mode (``marks``) a step's claim and count also move its worker's inflight and
    last-step words: two more atomics a step."""

    def __init__(self, windows: Windows):
        self.win, self.target = windows.control, windows.control_rank
        self.clocks_at, self.num_workers = windows.clocks_at, windows.layout.num_workers
        self._end_types: dict[tuple[int, bool], MPI.Datatype] = {}

    @staticmethod
    def marks() -> bool:
        """Whether claims are marked per worker (survive mode: see liveness)."""
        return liveness.SURVIVAL.survivable

    def compare_and_swap(self, index: int, expected: int, new: int) -> int:
        result = np.zeros(1, dtype=np.int64)
        self.win.Compare_and_swap(
            np.array([new], np.int64), np.array([expected], np.int64), result, self.target, index
        )
        self.win.Flush(self.target)
        return int(result[0])

    def _op(self, index: int, value: int, op: MPI.Op) -> int:
        result = np.zeros(1, dtype=np.int64)
        self.win.Fetch_and_op(np.array([value], np.int64), result, self.target, index, op)
        self.win.Flush(self.target)
        return int(result[0])

    def add(self, index: int, value: int) -> int:
        return self._op(index, value, MPI.SUM)

    def swap(self, index: int, value: int) -> int:
        return self._op(index, value, MPI.REPLACE)

    def read(self, index: int, count: int) -> np.ndarray:
        """``count`` consecutive counters, read atomically (Get_accumulate NO_OP) in one call."""
        out = np.zeros(count, dtype=np.int64)
        self.win.Get_accumulate(
            [out, MPI.LONG], [out, MPI.LONG], self.target, [index, count, MPI.LONG], MPI.NO_OP
        )
        self.win.Flush(self.target)
        return out

    @cached_property
    def _begin_type(self) -> MPI.Datatype:
        """global_step and tickets, then every worker's clock and done flag."""
        w = self.num_workers
        return MPI.LONG.Create_indexed([2, 2 * w], [GLOBAL_STEP, self.clocks_at]).Commit()

    @cached_property
    def _begin_add(self) -> np.ndarray:
        """What begin adds to the counters of _begin_type: one ticket, nothing else."""
        add = np.zeros(2 + 2 * self.num_workers, np.int64)
        add[TICKETS - GLOBAL_STEP] = 1
        return add

    def begin(self, task: int | None = None) -> np.ndarray:
        """Claim a ticket; [global_step, tickets, clocks, done flags] before that, in one
        call: every atomic on the window takes MPICH's window lock, and on an oversubscribed
        node each costs tens of microseconds. (Survive mode: worker ``task``'s claim marked
        first, as _SharedCounters.begin.)"""
        if task is not None and self.marks():
            self.add(self.inflight_at + task, 1)
        old = np.zeros_like(self._begin_add)
        self.win.Get_accumulate(
            [self._begin_add, MPI.LONG],
            [old, MPI.LONG],
            self.target,
            [0, 1, self._begin_type],
            MPI.SUM,
        )
        self.win.Flush(self.target)
        return old

    def _end_type(self, task: int, marked: bool) -> MPI.Datatype:
        """global_step and worker ``task``'s clock (and, ``marked``, its inflight word)."""
        if (task, marked) not in self._end_types:
            blocks = [GLOBAL_STEP, self.clocks_at + task]
            blocks += [self.inflight_at + task] if marked else []
            self._end_types[task, marked] = MPI.LONG.Create_indexed_block(1, blocks).Commit()
        return self._end_types[task, marked]

    def end(self, task: int) -> int:
        """Count one update in global_step and worker ``task``'s clock; the old global_step.
        Survive mode: its claim unmarked in the same call, and the step recorded as its last."""
        marked = self.marks()
        add = _END_MARKED if marked else _TWO_ONES
        old = np.zeros(len(add), np.int64)
        self.win.Get_accumulate(
            [add, MPI.LONG],
            [old, MPI.LONG],
            self.target,
            [0, 1, self._end_type(task, marked)],
            MPI.SUM,
        )
        self.win.Flush(self.target)
        if marked:
            self.swap(self.last_at + task, int(old[0]) + 1)
        return int(old[0])


class _SharedCounters(_Words):
    """The counters in node-shared memory, moved with the CPU's atomics (atomics.py): every
    rank on one node. ~0.5 us an atomic, where MPICH's take tens of us on a busy node."""

    def __init__(self, windows: Windows):
        self.words = windows.control_words()
        self.clocks_at, self.num_workers = windows.clocks_at, windows.layout.num_workers
        clocks = range(self.clocks_at, self.clocks_at + 2 * self.num_workers)
        self._begin_at = np.array([GLOBAL_STEP, TICKETS, *clocks], np.int64)

    @staticmethod
    def marks() -> bool:
        """Claims are always marked per worker (an atomic costs ~0.5 us here)."""
        return True

    def compare_and_swap(self, index: int, expected: int, new: int) -> int:
        return self.words.compare_and_swap(index, expected, new)

    def add(self, index: int, value: int) -> int:
        return self.words.fetch_add(index, value)

    def swap(self, index: int, value: int) -> int:
        return self.words.exchange(index, value)

    def read(self, index: int, count: int) -> np.ndarray:
        return self.words.load(index, count)

    def begin(self, task: int | None = None) -> np.ndarray:
        if task is not None:  # marked first: a death between the two issues a step again
            self.add(self.inflight_at + task, 1)
        old = np.empty(self._begin_at.size, np.int64)
        old[1] = self.words.add_then_load(TICKETS, 1, self._begin_at, old)
        return old

    def end(self, task: int) -> int:
        self.add(self.clocks_at + task, 1)
        words, inflight = self.words, self.inflight_at + task
        old = words.fetch_add(GLOBAL_STEP, 1)
        words.fetch_add(inflight, -1)  # right after GLOBAL_STEP (take_reissued checks both)
        self.swap(self.last_at + task, old + 1)
        return old


class RunControl:
    """Atomic access to the control counters from any rank."""

    def __init__(self, windows: Windows):
        self.layout = windows.layout
        self.num_workers = windows.layout.num_workers
        self.num_ps = windows.layout.num_ps
        self.clocks_at = windows.clocks_at
        shared = windows.control_shared
        self.counters = _SharedCounters(windows) if shared else _MpiCounters(windows)

    def begin_step(self, clock: int, task: int | None = None) -> tuple[int, int, int]:
        """An async worker at ``clock`` claims a ticket and reads global_step and every
        worker's clock, in one call (atomic per counter): (its ticket, global_step, its lead
        over the slowest running worker). Tickets >= the step target mean stop. ``task``
        (shared counters): the claim is marked as worker ``task``'s until its end_step (or
        release_ticket), so that a survivor makes the step should it die meanwhile."""
        w = self.num_workers
        old = self.counters.begin(task).tolist()
        lead = _lead(clock, old[2 : 2 + w], old[2 + w :])
        return old[TICKETS - GLOBAL_STEP], old[0], lead

    def end_step(self, task: int) -> int:
        """Async worker ``task`` has made one update: count it in global_step and in its
        clock (one call, atomic per counter); returns its global step (unique across all
        workers)."""
        return self.counters.end(task) + 1

    # -- survive mode (store/liveness.py): a dead worker's claimed step issued again --------

    def release_ticket(self, task: int) -> None:
        """Worker ``task`` will not make the step it claimed (past the target): unmarked."""
        if self.counters.marks():
            self.counters.add(self.counters.inflight_at + task, -1)

    def take_reissued(self, task: int, target: int) -> bool:
        """Worker ``task`` (its own claim released) takes one step a dead worker claimed
        and never counted, if the run still needs it to reach ``target``: marked as its
        claim, then checked against global_step and the other live workers' claims (read
        in that order, after the mark: two takers see each other's mark, so the target
        is never passed; one that gives back tries again later)."""
        c = self.counters
        if not c.marks() or not c.read(c.reissue_at, 1)[0]:
            return False
        mine = c.inflight_at + task
        c.add(mine, 1)
        if self._take_one(c) and self._needed(c, task, target):
            return True
        c.add(mine, -1)
        return False

    @staticmethod
    def _take_one(c: _SharedCounters | _MpiCounters) -> bool:
        left = int(c.read(c.reissue_at, 1)[0])
        while left > 0:
            seen = c.compare_and_swap(c.reissue_at, left, left - 1)
            if seen == left:
                return True
            left = seen
        return False

    def _needed(self, c: _SharedCounters | _MpiCounters, task: int, target: int) -> bool:
        """After taking one: whether the run needs it (else given back)."""
        w = self.num_workers
        claims = c.read(c.inflight_at, w).tolist()
        done = c.read(self.clocks_at + w, w).tolist()
        others = sum(n for k, n in enumerate(claims) if k != task and done[k] != LOST)
        if c.read(GLOBAL_STEP, 1)[0] + others < target:
            return True
        c.add(c.reissue_at, 1)
        return False

    def reissue_pending(self, target: int) -> bool:
        """Whether a dead worker's step may still be needed to reach ``target``."""
        c = self.counters
        if not c.marks():
            return False
        return bool(c.read(c.reissue_at, 1)[0]) and self.global_step() < target

    def declare_lost(self, task: int) -> bool:
        """Worker ``task`` is dead: the step it claimed and did not count is issued again,
        and its done flag says LOST (so nobody waits for it). True for the one caller that
        declared it (it says so)."""
        c = self.counters
        claimed = c.swap(c.inflight_at + task, 0)  # before LOST: whoever sees LOST sees it
        if claimed > 0:
            c.add(c.reissue_at, claimed)
        done = self.clocks_at + self.num_workers + task
        return c.compare_and_swap(done, 0, LOST) == 0  # (not one that had finished)

    def lost_tasks(self) -> list[int]:
        """The workers declared lost."""
        _, done = self.counters.read(self.clocks_at, 2 * self.num_workers).reshape(2, -1)
        return [t for t, d in enumerate(done.tolist()) if d == LOST]

    def pushed(self, task: int, step: int) -> None:
        """Worker ``task`` posted its gradient for global step ``step`` (sync_replicas; the
        last step a lost worker pushed is named: where claims are marked)."""
        c = self.counters
        if c.marks():
            c.swap(c.last_at + task, step)

    def last_step(self, task: int) -> int:
        """The last global step worker ``task`` counted (0: none, or claims not marked)."""
        c = self.counters
        return int(c.read(c.last_at + task, 1)[0]) if c.marks() else 0

    def _get(self, index: int) -> int:
        return int(self.counters.read(index, 1)[0])

    def _set(self, index: int, value: int) -> int:
        """Set a counter; returns its old value."""
        return self.counters.swap(index, value)

    def advance_step(self) -> int:
        """Count one applied update; returns its global step (unique across all workers)."""
        return self.counters.add(GLOBAL_STEP, 1) + 1

    def global_step(self) -> int:
        return self._get(GLOBAL_STEP)

    def set_counters(self, step: int, clocks: list[int] | None = None) -> None:
        """Chief, before raising ready: start global_step (and tickets, clocks) at ``step``.

        A stop requested before this (a signal on a PS task, which sets STOP, then TICKETS)
        is kept: STOP is read after TICKETS is set, so one of the two writers leaves TICKETS
        past every target."""
        self._set(GLOBAL_STEP, step)
        self._set(TICKETS, step)
        if self.stop_signal():
            self._set(TICKETS, NO_MORE_TICKETS)
        for task, clock in enumerate(clocks or []):
            self.publish_clock(task, clock)

    def request_stop(self, signum: int) -> None:
        """Stop the whole job at the next step boundary of every worker (preemption)."""
        self._set(STOP, signum)
        self._set(TICKETS, NO_MORE_TICKETS)

    def end_tickets(self) -> None:
        """End the run early as a normal end (a hook's request): every later claim is past
        the target, so every worker stops at its next ticket; no signal is recorded."""
        self._set(TICKETS, NO_MORE_TICKETS)

    def tickets_ended(self) -> bool:
        """A stop (a signal, or a hook's request) has ended the tickets: every worker stops."""
        return self._get(TICKETS) >= NO_MORE_TICKETS

    def stop_signal(self) -> int:
        """The signal that stopped the job early (0: none)."""
        return self._get(STOP)

    def claim_failure(self) -> bool:
        """True for the first rank to report a failure (the others stay quiet, so it is
        said once)."""
        return self._set(FAILED, 1) == 0

    # -- checkpoints: the chief asks, every PS task writes its shard and says so -------------

    def request_checkpoint(self, step: int) -> int:
        """Chief: ask every PS to write its shard of checkpoint ``step``; returns the
        request's number (see wait_shards)."""
        self._set(CKPT_STEP, step)
        return self.counters.add(CKPT_SEQ, 1) + 1

    def checkpoint_request(self) -> tuple[int, int]:
        """PS: (number, global_step) of the latest checkpoint request (0, 0: none yet)."""
        return self._get(CKPT_SEQ), self._get(CKPT_STEP)

    def shard_written(self, ps_task: int, number: int) -> None:
        """PS ``ps_task`` has written its shard for request ``number``."""
        self._set(SHARDS + ps_task, number)

    def shards_missing(self, number: int) -> list[int]:
        """The PS tasks that have not yet written their shard for request ``number``."""
        written = self.counters.read(SHARDS, self.num_ps)
        return [p for p in range(self.num_ps) if written[p] < number]

    def wait_shards(self, number: int, step: int, timeout: float | None = None) -> None:
        """Chief: sleep until every PS task has written its shard for request ``number``;
        Stalled naming the ones that did not within ``timeout`` s (None: stall_timeout())."""

        def late(waited: float) -> NoReturn:
            raise Stalled(
                f"{self._names('ps', self.shards_missing(number))} did not write its "
                f"shard of the checkpoint at global_step {step} in time: hung? "
                f"(MPIPS_STALL_TIMEOUT sets the limit); aborting the job"
            )

        limit = stall_timeout() if timeout is None else timeout
        poll(lambda: not self.shards_missing(number), limit, late)

    # -- start and end of the run ------------------------------------------------------------

    def raise_ready(self) -> None:
        self._set(READY, 1)

    def is_ready(self) -> bool:
        return self._get(READY) != 0

    def wait_ready(
        self, timeout: float | None = None, meanwhile: Callable[[], None] | None = None
    ) -> None:
        """Wait (sleeping) until the chief has initialised or restored the variables;
        StartTimeout naming the chief after ``timeout`` s (None: start_timeout(); stagger it
        by the waiter: see start_limit)."""

        def late(waited: float) -> NoReturn:
            raise StartTimeout(
                f"{self._names('worker', [0])} (the chief) did not raise the "
                f"ready flag within {waited:.0f} s: stuck initialising? "
                f"(MPIPS_START_TIMEOUT sets the limit)"
            )

        def looking() -> None:
            if meanwhile is not None:
                meanwhile()
            liveness.chief_alive(self.layout.chief_rank)  # (survive mode: dead, it never will)

        poll(self.is_ready, start_timeout() if timeout is None else timeout, late, looking)

    def end_run(self) -> None:
        """Chief, after its last checkpoint and evaluation: the PS tasks may stop serving."""
        self._set(ENDED, 1)

    def run_ended(self) -> bool:
        return self._get(ENDED) != 0

    # -- clocks: each worker's update count (data position, staleness, watchdog) ------------

    def publish_clock(self, task: int, clock: int, done: bool = False) -> None:
        """Worker ``task`` has pushed ``clock`` updates; ``done``: it will push no more."""
        self._set(self.clocks_at + task, clock)
        if done:
            self._set(self.clocks_at + self.num_workers + task, 1)

    def clocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(clock, done) of every worker, read atomically in one call."""
        out = self.counters.read(self.clocks_at, 2 * self.num_workers)
        return out[: self.num_workers], out[self.num_workers :].astype(bool)

    def lead(self, clock: int) -> int:
        """How many updates ``clock`` is ahead of the slowest worker still running."""
        clocks, done = self.clocks()
        return _lead(clock, clocks.tolist(), done.tolist())

    def wait_for_slowest(self, clock: int, bound: int | None, watchdog: Callable[[], None]) -> int:
        """This worker's lead over the slowest running worker, after waiting (sleeping) until
        it is at most ``bound`` (None: no bound, plain async; 0: lock-step). The wait is
        policed by ``watchdog``, which raises if the slowest worker is hung."""
        lead = [self.lead(clock)]
        if bound is None or lead[0] <= bound:
            return lead[0]

        def caught_up() -> bool:
            lead[0] = self.lead(clock)
            return lead[0] <= bound

        poll(caught_up, math.inf, unreachable, watchdog, fast=0.02)
        return lead[0]

    def _names(self, job: str, tasks: list[int]) -> str:
        return ", ".join(f"/job:{job}/task:{t} (rank {self.layout.rank_of(job, t)})" for t in tasks)


def _lead(clock: int, clocks: list[int], done: list[int]) -> int:
    """How many updates ``clock`` is ahead of the slowest of ``clocks`` not ``done``."""
    running = [c for c, d in zip(clocks, done, strict=True) if not d]
    return clock - min(running) if running else 0

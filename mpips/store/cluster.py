"""Who is who in the world communicator, plus the few collectives mpips needs outside the hot path.

Idle ranks never spin: every wait is a non-blocking request polled with a short sleep
(MPICH ranks blocked in Barrier busy-poll and slow the computing ranks down 4x on 2 cores).
"""

from __future__ import annotations

import json
import math
import traceback
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import numpy as np
from mpi4py import MPI

from ..errors import AgreedError, MpipsError, PlacementMismatch, StartTimeout
from ..placement.layout import Layout, Role
from ..placement.table import Placement
from ..process import failure, settings, supervise
from ..process.waits import MAX_SLEEP, poll

POLL_SECONDS = MAX_SLEEP
T = TypeVar("T")
_ARRIVAL_TAG = 7001  # and 7002 for rank 0's "go"; other point-to-point tags start at 7100
_TOKEN = np.zeros(1, np.uint8)  # what an arrival sends (alive until the send completes)


def start_timeout() -> float:
    """Seconds within which every rank must reach each start-up step, else the job ends
    naming the ranks that never arrived (MPIPS_START_TIMEOUT, default 300)."""
    return settings.current().start_timeout


def stall_timeout() -> float:
    """Seconds a task may make no progress mid-run while others wait for it before it is
    called hung (MPIPS_STALL_TIMEOUT, default 600)."""
    return settings.current().stall_timeout


def stagger(index: int) -> float:
    """Extra seconds waiter ``index`` (a task or rank) gives a late peer before it reports:
    2 s per index up to 8, then 0.25 s per index, so that no two waiters report together
    and the first one's abort ends the job before the next one looks."""
    return 2.0 * min(index, 8) + 0.25 * max(0, index - 8)


def stall_limit(index: int) -> float:
    """Seconds waiter ``index`` gives a hung peer: stall_timeout(), staggered. (Asked at
    every step's wait: the settings as start-up read them.)"""
    return settings.cached().stall_timeout + stagger(index)


def wait(
    request: MPI.Request,
    what: str,
    timeout: float,
    meanwhile: Callable[[], None] | None = None,
    spin: float = 0.0,
) -> None:
    """Complete a request without burning a core; past ``timeout`` s raise StartTimeout
    naming ``what`` (``math.inf`` only with a ``meanwhile`` watchdog that raises)."""

    def late(waited: float) -> NoReturn:
        raise StartTimeout(
            f"waited {waited:.0f} s for {what} (a rank stuck or gone? "
            f"MPIPS_START_TIMEOUT / MPIPS_STALL_TIMEOUT set the limits)"
        )

    poll(request.Test, timeout, late, meanwhile, spin)


def unreachable(waited: float) -> NoReturn:
    """The ``on_timeout`` of a wait with no deadline (``math.inf``), policed by a watchdog
    that raises instead."""
    raise AssertionError("an unbounded wait timed out")


def watched_barrier(comm: MPI.Comm, what: str, watchdog: Callable[[], None]) -> None:
    """A barrier over ``comm`` with no deadline of its own: ``watchdog()``, called while the
    rank sleeps, raises (naming the hung task) if one of the others never arrives."""
    wait(comm.Ibarrier(), what, math.inf, watchdog)


def start_limit(index: int) -> float:
    """start_timeout() for waiter ``index``, staggered like stall_limit (one waiter says it)."""
    return start_timeout() + stagger(index)


def check_arrival(comm: MPI.Comm, what: str, timeout: float | None = None) -> None:
    """A barrier that names the ranks that do not arrive. Every rank reports to rank 0; if
    some never do within ``timeout``, rank 0 names them (StartTimeout, which aborts the job).
    Once all have, rank 0 tells every rank to go on; a rank that hears nothing within
    ``timeout`` + 5 s gives up, naming rank 0 (it may be the one missing).

    Called before every blocking start-up collective (communicator split, window creation),
    which cannot be polled or abandoned: after it, every rank is known to be there.
    ``timeout`` None: start_timeout()."""
    timeout = start_timeout() if timeout is None else timeout
    if comm.rank != 0:
        comm.Isend(_TOKEN, dest=0, tag=_ARRIVAL_TAG).Free()
        go = np.zeros(1, np.uint8)

        def silent(waited: float) -> NoReturn:
            raise StartTimeout(
                f"rank 0 did not confirm within {waited:.0f} s that every rank "
                f"reached {what} (rank 0, or a rank it waits for, is stuck or "
                f"gone; MPIPS_START_TIMEOUT sets the limit)"
            )

        # later ranks wait longer, so that one of them (rank 1) says it
        poll(
            comm.Irecv(go, source=0, tag=_ARRIVAL_TAG + 1).Test,
            timeout + 5 + stagger(comm.rank - 1),
            silent,
        )
        return
    buffers = [np.zeros(1, np.uint8) for _ in range(comm.size)]
    pending = {r: comm.Irecv(buffers[r], source=r, tag=_ARRIVAL_TAG) for r in range(1, comm.size)}

    def arrived() -> bool:
        for r in [r for r, q in pending.items() if q.Test()]:
            del pending[r]
        return not pending

    def late(waited: float) -> NoReturn:
        raise StartTimeout(
            f"rank(s) {', '.join(map(str, sorted(pending)))} did not reach "
            f"{what} within {timeout:.0f} s (stuck or never started; "
            f"MPIPS_START_TIMEOUT sets the limit)"
        )

    poll(arrived, timeout, late)
    for r in range(1, comm.size):
        comm.Isend(_TOKEN, dest=r, tag=_ARRIVAL_TAG + 1).Free()


def barrier(comm: MPI.Comm, what: str, timeout: float | None = None) -> None:
    """A barrier whose waiting ranks sleep, naming the ranks that do not arrive within
    ``timeout`` s (see check_arrival)."""
    check_arrival(comm, what, timeout)


def allgather_json(
    comm: MPI.Comm,
    obj: Any,
    what: str = "an exchange between ranks",
    timeout: float | None = None,
) -> list[Any]:
    """Allgather JSON-able values (no pickle): bytes via Iallgatherv, waited on with sleeps
    (``timeout`` None: start_timeout())."""
    timeout = start_timeout() if timeout is None else timeout
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    counts = np.zeros(comm.size, dtype=np.int64)
    wait(comm.Iallgather(np.array([data.size], dtype=np.int64), counts), what, timeout)
    out = np.empty(int(counts.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    wait(comm.Iallgatherv(data, [out, counts, displs, MPI.BYTE]), what, timeout)
    return [json.loads(out[d : d + c].tobytes()) for d, c in zip(displs, counts, strict=True)]


def agreed(comm: MPI.Comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raises anywhere, raise AgreedError on every rank.

    Used for start-up work (reading the job, layout, data, checkpoint) so a problem is
    said once, not once per rank: an MpipsError by its message (exit 2), anything else by
    its traceback (exit 1). Different messages from different ranks are each said once.
    Its own deadline is MPIPS_START_TIMEOUT's, or the default while a bad value of it is
    still to be said (the start-up step that checks the settings is one of these).
    """
    result, error = None, None
    try:
        result = fn()
    except MpipsError as e:
        error = [str(e), e.exit_code]
    except Exception as e:
        error = [
            "unexpected error during start-up:\n" + "".join(traceback.format_exception(e)).rstrip(),
            1,
        ]
    limit = settings.lenient().start_timeout
    check_arrival(comm, "start-up", limit)
    errors = allgather_json(comm, error, "every rank to reach start-up", limit + 5)
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        code = max(c for _, (_, c) in bad)
        messages = list(dict.fromkeys(m for _, (m, _) in bad))
        if len(messages) == 1:
            raise AgreedError(messages[0], code)
        raise AgreedError("\n".join(f"rank {r}: {m}" for r, (m, _) in bad), code)
    return result  # type: ignore[return-value]


def node_of_each_rank(comm: MPI.Comm) -> list[int]:
    """Each rank's node, named by the lowest rank of the ranks MPI says share its memory
    (COMM_TYPE_SHARED: what the launcher placed on one host, which is also what the
    store's shared-memory paths use). The first start-up step, so a rank that never gets
    here is named, not waited for."""
    check_arrival(comm, "start-up")
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    group, world = node.Get_group(), comm.Get_group()
    lowest = int(MPI.Group.Translate_ranks(group, [0], world)[0])
    group.Free()
    world.Free()
    node.Free()
    return allgather_json(comm, lowest, "every rank to reach start-up", start_timeout() + 5)


class Cluster:
    """The world communicator seen through a layout: this rank's role and the workers' comm."""

    def __init__(self, comm: MPI.Intracomm, layout: Layout):
        self.comm = comm
        self.layout = layout
        self.rank = comm.rank
        self.role: Role = layout.role(comm.rank)
        self.is_ps = self.role.job == "ps"
        self.is_chief = self.role.is_chief
        self.departing = False  # survive mode, after a loss: leave without freeing
        # workers' communicator: worker task order; PS ranks get their own (unused) one
        check_arrival(comm, "the communicator split")
        self.workers = comm.Split(0 if self.is_ps else 1, self.role.task)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.rank, node.size
        # the node's watcher names a rank killed outright (see failure.py); with one rank on
        # the node there is nobody left to tell a death from the launcher's teardown
        # (a supervised rank, survive mode, is named by its supervisor and the watchdogs)
        watched = node.rank == 0 and node.size > 1 and not supervise.supervised()
        watcher = failure.start_watcher() if watched else (0, 0)
        ranks = np.zeros((node.size, 3), np.int64)
        wait(
            node.Iallgather(np.array([self.rank, *watcher], np.int64), ranks),
            "the node's ranks",
            start_timeout(),
        )
        self.node_ranks: tuple[int, ...] = tuple(int(r) for r in ranks[:, 0])  # world ranks here
        failure.join_watcher(int(ranks[0, 1]), int(ranks[0, 2]), self.rank, str(self.role))
        node.Free()

    @property
    def one_node(self) -> bool:
        """Every rank of the job shares this rank's node, and so its memory."""
        return len(self.node_ranks) == self.comm.size

    @property
    def workers_on_one_node(self) -> bool:
        """Every worker rank shares this rank's node, and so its memory."""
        return set(self.layout.worker_ranks) <= set(self.node_ranks)

    @property
    def local_worker_index(self) -> int:
        """This worker's index among the workers on its node (PS ranks not counted): which
        GPU of the node it uses."""
        return self._local_workers.index(self.rank)

    @property
    def local_workers(self) -> int:
        """How many workers share this rank's node."""
        return len(self._local_workers)

    @property
    def _local_workers(self) -> list[int]:
        workers = set(self.layout.worker_ranks)
        return [r for r in self.node_ranks if r in workers]

    def check_placement(self, placement: Placement) -> None:
        """Stop on every rank, naming the first differing variable, if placements disagree."""
        mine = placement.entry_digests()
        everyone = allgather_json(self.comm, mine, "the placement check")
        if all(d == mine for d in everyone):
            return
        n = max(len(d) for d in everyone)
        index = next(i for i in range(n) if len({tuple(d[i : i + 1]) for d in everyone}) > 1)
        described = allgather_json(
            self.comm,
            placement.entries[index].describe()
            if index < len(placement.entries)
            else "<no variable>",
            "the placement check",
        )
        lines = [f"  rank {r} ({self.layout.role(r)}): {d}" for r, d in enumerate(described)]
        raise PlacementMismatch(
            f"placement differs across ranks at variable #{index} (were variables created in "
            f"a different order on some rank?):\n" + "\n".join(lines)
        )

    def free(self) -> None:
        if not self.departing:  # (after a loss it would wait for the dead: liveness.py)
            self.workers.Free()


def peek(win: MPI.Win, rank: int, index: int, out: np.ndarray) -> int:
    """Word ``index`` (at displacement ``index`` in ``win``'s units) of ``rank``'s memory,
    read with a plain Get, not an atomic: a poll of a flag that usually finds nothing new
    (the mailbox's and the dynamic tables' lookups; mailbox.py says why not an atomic)."""
    win.Get([out, MPI.LONG], rank, [index, 1, MPI.LONG])
    win.Flush(rank)
    return int(out[0])

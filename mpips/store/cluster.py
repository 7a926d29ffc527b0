"""Who is who in the world communicator, plus the few collectives mpips needs outside the hot path.

Idle ranks never spin: every wait is a non-blocking request polled with a short sleep
(MPICH ranks blocked in Barrier busy-poll and slow the computing ranks down 4x on 2 cores).
"""
from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from mpi4py import MPI

from ..errors import AgreedError, MpipsError
from ..layout import Layout, Role
from ..placement import Placement

POLL_SECONDS = 1e-3
T = TypeVar("T")
# every start-up step must be reached by every rank within this many seconds, else the job
# ends naming the ranks that never arrived (a stuck rank must not hang the others forever)
START_TIMEOUT = float(os.environ.get("MPIPS_START_TIMEOUT", "300"))
# a task that makes no progress for this many seconds mid-run, while others wait, is hung
STALL_TIMEOUT = float(os.environ.get("MPIPS_STALL_TIMEOUT", "600"))
_ARRIVAL_TAG = 7001
_arrivals = 0


class PlacementMismatch(AgreedError):
    """Ranks computed different placement tables (e.g. variables created in another order)."""


class StartTimeout(MpipsError):
    """Some rank never reached a start-up step."""


def stall_limit(index: int) -> float:
    """Seconds waiter ``index`` (a task or rank) gives a hung peer: STALL_TIMEOUT, plus 2 s
    per index up to 5, so that the first waiter alone reports the hang (its abort ends the
    job before the others look)."""
    return STALL_TIMEOUT + 2.0 * min(index, 5)


def wait(request: MPI.Request, poll: float = POLL_SECONDS, timeout: float | None = None,
         what: str = "", meanwhile: Callable[[], None] | None = None) -> None:
    """Complete a request without burning a core (StartTimeout after ``timeout`` seconds),
    calling ``meanwhile`` between polls (a watchdog may raise from it)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not request.Test():
        if deadline is not None and time.monotonic() > deadline:
            raise StartTimeout(f"waited {timeout:.0f} s for every rank to reach {what}")
        if meanwhile is not None:
            meanwhile()
        time.sleep(poll)


def check_arrival(comm: MPI.Comm, what: str, timeout: float = START_TIMEOUT) -> None:
    """Every rank reports to rank 0; if some never does within ``timeout``, rank 0 names them
    (StartTimeout, which aborts the job). Other ranks give up a little later, in case rank 0
    is the one missing."""
    global _arrivals
    _arrivals += 1
    tag = _ARRIVAL_TAG + _arrivals % 1000
    token = np.zeros(1, np.uint8)
    if comm.rank != 0:
        comm.Isend(token, dest=0, tag=tag).Free()
        return
    buffers = [np.zeros(1, np.uint8) for _ in range(comm.size)]
    pending = {r: comm.Irecv(buffers[r], source=r, tag=tag) for r in range(1, comm.size)}
    deadline = time.monotonic() + timeout
    while pending:
        pending = {r: q for r, q in pending.items() if not q.Test()}
        if pending and time.monotonic() > deadline:
            raise StartTimeout(f"rank(s) {', '.join(map(str, sorted(pending)))} did not reach "
                               f"{what} within {timeout:.0f} s (stuck or never started; "
                               f"MPIPS_START_TIMEOUT sets the limit)")
        time.sleep(POLL_SECONDS)


def sleepy_barrier(comm: MPI.Comm, meanwhile: Callable[[], None] | None = None) -> None:
    """A barrier whose waiting ranks sleep between polls (calling ``meanwhile``)."""
    wait(comm.Ibarrier(), meanwhile=meanwhile)


def allgather_json(comm: MPI.Comm, obj: Any, timeout: float | None = None,
                   what: str = "") -> list[Any]:
    """Allgather JSON-able values (no pickle): bytes via Iallgatherv, waited on with sleeps."""
    data = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    counts = np.zeros(comm.size, dtype=np.int64)
    wait(comm.Iallgather(np.array([data.size], dtype=np.int64), counts), timeout=timeout,
         what=what)
    out = np.empty(int(counts.sum()), dtype=np.uint8)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    wait(comm.Iallgatherv(data, [out, counts, displs, MPI.BYTE]), timeout=timeout, what=what)
    return [json.loads(out[d:d + c].tobytes()) for d, c in zip(displs, counts)]


def agreed(comm: MPI.Comm, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank; if it raises anywhere, raise AgreedError on every rank.

    Used for start-up work (reading the job, layout, data, checkpoint) so a problem is
    said once, not once per rank: an MpipsError by its message (exit 2), anything else by
    its traceback (exit 1). Different messages from different ranks are each said once.
    """
    result, error = None, None
    try:
        result = fn()
    except MpipsError as e:
        error = [str(e), e.exit_code]
    except Exception as e:
        error = ["unexpected error during start-up:\n" +
                 "".join(traceback.format_exception(e)).rstrip(), 1]
    check_arrival(comm, "start-up")
    errors = allgather_json(comm, error, timeout=START_TIMEOUT + 5, what="start-up")
    bad = [(r, e) for r, e in enumerate(errors) if e]
    if bad:
        code = max(c for _, (_, c) in bad)
        messages = list(dict.fromkeys(m for _, (m, _) in bad))
        if len(messages) == 1:
            raise AgreedError(messages[0], code)
        raise AgreedError("\n".join(f"rank {r}: {m}" for r, (m, _) in bad), code)
    return result  # type: ignore[return-value]


def node_of_each_rank(comm: MPI.Comm) -> list[int]:
    """Each rank's node (host), named by the lowest rank on it. The first start-up step, so
    a rank that never gets here is named, not waited for."""
    check_arrival(comm, "start-up")
    hosts = allgather_json(comm, socket.gethostname(), timeout=START_TIMEOUT + 5,
                           what="start-up")
    first: dict[str, int] = {}
    return [first.setdefault(host, rank) for rank, host in enumerate(hosts)]


class Cluster:
    """The world communicator seen through a layout: this rank's role and the workers' comm."""

    def __init__(self, comm: MPI.Comm, layout: Layout):
        self.comm = comm
        self.layout = layout
        self.rank = comm.rank
        self.role: Role = layout.role(comm.rank)
        self.is_ps = self.role.job == "ps"
        self.is_chief = self.role.is_chief
        # workers' communicator: worker task order; PS ranks get their own (unused) one
        self.workers = comm.Split(0 if self.is_ps else 1, self.role.task)
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank, self.local_size = node.rank, node.size
        node.Free()

    def check_placement(self, placement: Placement) -> None:
        """Stop on every rank, naming the first differing variable, if placements disagree."""
        mine = placement.entry_digests()
        everyone = allgather_json(self.comm, mine)
        if all(d == mine for d in everyone):
            return
        n = max(len(d) for d in everyone)
        index = next(i for i in range(n)
                     if len({tuple(d[i:i + 1]) for d in everyone}) > 1)
        described = allgather_json(
            self.comm, placement.entries[index].describe() if index < len(placement.entries)
            else "<no variable>")
        lines = [f"  rank {r} ({self.layout.role(r)}): {d}" for r, d in enumerate(described)]
        raise PlacementMismatch(
            f"placement differs across ranks at variable #{index} (were variables created in "
            f"a different order on some rank?):\n" + "\n".join(lines))

    def free(self) -> None:
        self.workers.Free()

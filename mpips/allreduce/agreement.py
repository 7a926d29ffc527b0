"""The replicas' agreements, and the small collectives around them: waiting for a collective
of every replica (``complete``), the largest of their values (``agree_max``, a step's vote),
a sum (``sum_over``, a norm's squares), the end of the run, a PS rank's stop signal passed
to the chief, the chief's initial broadcast, and the check that the replicas are identical.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from ..errors import AlreadyReported, ReplicasDiverged, Stalled
from ..process.waits import poll
from ..store import allgather_json, stall_limit, stall_timeout, start_timeout, wait

SPIN_SECONDS = 0.02  # yield the core this long before sleeping: a step's collective
# usually completes within it (a sleep right away doubled the step time)
STOP_TAG = 7100  # a PS rank's preemption signal, sent to the chief


def complete(comm: MPI.Comm, request: MPI.Request, what: str) -> None:
    """Wait for a collective of every replica: yield the core for a short spin, then sleep
    (backing off to 1 ms), so a replica waiting on a hung peer does not burn a core. A replica
    that never joins (hung, yet alive) ends the job after MPIPS_STALL_TIMEOUT s (later ranks
    a little longer, so one rank says it)."""

    def late(waited: float) -> NoReturn:
        raise Stalled(
            f"{what} did not complete within {stall_timeout():.0f} s: a replica "
            f"is hung? (MPIPS_STALL_TIMEOUT sets the limit); aborting the job"
        )

    poll(request.Test, stall_limit(comm.rank), late, spin=SPIN_SECONDS)


def agree_max(comm: MPI.Comm, values: list[int], what: str = "the step's agreement") -> list[int]:
    """The element-wise largest ``values`` over all ranks of ``comm`` (one small allreduce)."""
    buf = np.array(values, dtype=np.int64)
    complete(comm, comm.Iallreduce(MPI.IN_PLACE, buf, MPI.MAX), what)
    return [int(v) for v in buf]


def start_max(comm: MPI.Comm, votes: np.ndarray) -> MPI.Request:
    """Start the element-wise maxima of ``votes`` (in place) over all ranks of ``comm``."""
    return comm.Iallreduce(MPI.IN_PLACE, votes, MPI.MAX)


def sum_over(comm: MPI.Comm, value: float, what: str = "the norm") -> float:
    """The sum of ``value`` over all ranks of ``comm`` (one small allreduce)."""
    total = np.array([value])
    complete(comm, comm.Iallreduce(MPI.IN_PLACE, total, MPI.SUM), what)
    return float(total[0])


def idle_until_end(comm: MPI.Comm, value: int, meanwhile: Callable[[], None]) -> int:
    """A rank with nothing to hold (a PS rank in sync mode): its part in the replicas'
    end-of-run ``agree_max`` of ``value``, waited for asleep (calling ``meanwhile``) and
    without a deadline: the replicas police each other, and this wait ends with them."""
    buf = np.array([value], dtype=np.int64)
    wait(comm.Iallreduce(MPI.IN_PLACE, buf, MPI.MAX), "the end of the run", math.inf, meanwhile)
    return int(buf[0])


def forward_stop(comm: MPI.Comm, chief_rank: int, signum: int) -> None:
    """A PS rank in sync mode (it holds nothing) passes a preemption signal to the chief."""
    comm.Send(np.array([signum], np.int64), dest=chief_rank, tag=STOP_TAG)


def stop_from_ps(comm: MPI.Comm) -> int:
    """Chief: a signal a PS rank forwarded (0: none), without waiting."""
    status = MPI.Status()
    if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=STOP_TAG, status=status):
        return 0
    buf = np.zeros(1, np.int64)
    comm.Recv(buf, source=status.Get_source(), tag=STOP_TAG)
    return int(buf[0])


def broadcast(comm: MPI.Comm, arrays: list[np.ndarray], root: int = 0) -> None:
    """Broadcast arrays in place from ``root`` (waiting ranks sleep)."""
    for a in arrays:
        wait(comm.Ibcast(a, root=root), "the chief's broadcast of the variables", start_timeout())


def replica_hash(arrays: list[np.ndarray]) -> int:
    """CRC32 of the bytes of all arrays: equal only if the replicas are bitwise identical."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data, crc)  # zero-copy
    return crc


def check_replicas(comm: MPI.Comm, arrays: list[np.ndarray], step: int) -> None:
    """Unless all replicas are bitwise identical, raise on every one: ReplicasDiverged on the
    chief (rank 0 of ``comm``), naming the replicas that differ; AlreadyReported elsewhere."""
    hashes = allgather_json(comm, replica_hash(arrays), "the replica check", stall_timeout())
    if len(set(hashes)) > 1:
        first = hashes[0]
        bad = [task for task, h in enumerate(hashes) if h != first]
        message = (
            f"replicas diverged at global_step {step}: the variables of worker task(s) "
            f"{', '.join(map(str, bad))} differ from task 0's (a non-deterministic op, "
            f"or a replica changed outside the update)"
        )
        raise ReplicasDiverged(message) if comm.rank == 0 else AlreadyReported(message)

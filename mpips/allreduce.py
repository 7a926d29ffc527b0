"""Synchronous replicas: gradient buckets averaged with non-blocking allreduce, the initial
broadcast, and the replica-divergence check. With store/, the only code that moves data over MPI.

Gradients live in a few flat float buffers (buckets), filled in the order backward produces
them; when a bucket's last gradient is written its ``Iallreduce`` starts at once, so reducing
it overlaps the rest of backward. Between layers, pending requests are tested: MPICH makes
progress only inside MPI calls.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from .errors import AlreadyReported, ReplicasDiverged, Stalled
from .placement import VariableSpec
from .store import STALL_TIMEOUT, START_TIMEOUT, allgather_json, stall_limit, wait
from .waits import poll


@dataclass
class Bucket:
    names: list[str]
    buffer: np.ndarray
    request: MPI.Request | None = None


class GradientBuckets:
    """Gradient arrays that are views into fused buckets, averaged over ``comm``."""

    def __init__(self, comm: MPI.Comm, specs: list[VariableSpec], bucket_bytes: int):
        self.comm = comm
        self.size = comm.size
        self.buckets: list[Bucket] = []
        self.grads: dict[str, np.ndarray] = {}
        self._bucket_of: dict[str, int] = {}
        self._pending: dict[int, set[str]] = {}
        self.reduce_seconds = 0.0  # time spent waiting for reductions after backward
        current: list[VariableSpec] = []
        for spec in reversed(specs):  # backward produces the last layer's gradients first
            current.append(spec)
            if sum(s.nbytes for s in current) >= bucket_bytes:
                self._add(current)
                current = []
        if current:
            self._add(current)

    def _add(self, specs: list[VariableSpec]) -> None:
        dtypes = {s.dtype for s in specs}
        if len(dtypes) != 1:
            raise ValueError("a bucket holds one dtype")
        total = sum(int(np.prod(s.shape)) for s in specs)
        buf = np.zeros(total, dtype=dtypes.pop())
        offset = 0
        index = len(self.buckets)
        for s in specs:
            n = int(np.prod(s.shape))
            self.grads[s.name] = buf[offset : offset + n].reshape(s.shape)
            self._bucket_of[s.name] = index
            offset += n
        self.buckets.append(Bucket([s.name for s in specs], buf))

    def start_step(self) -> None:
        self._pending = {i: set(b.names) for i, b in enumerate(self.buckets)}

    def ready(self, name: str) -> None:
        """Backward has written gradient ``name``: start its bucket's reduction if complete."""
        index = self._bucket_of[name]
        waiting = self._pending[index]
        waiting.discard(name)
        if not waiting:
            bucket = self.buckets[index]
            bucket.request = self.comm.Iallreduce(MPI.IN_PLACE, bucket.buffer, MPI.SUM)
        for b in self.buckets:  # poke progress on what is in flight
            if b.request is not None and b.request.Test():
                b.request = None

    def finish(self) -> dict[str, np.ndarray]:
        """Wait for every bucket, divide by the number of replicas; returns the mean gradients.

        Once the model's loss_and_grads has returned every gradient is final: buckets it did
        not report ready (a model that does not call ``ready``) start their reduction here,
        without the overlap with backward."""
        t0 = time.perf_counter()
        for index, b in enumerate(self.buckets):
            if self._pending.get(index):
                self._pending[index].clear()
                b.request = self.comm.Iallreduce(MPI.IN_PLACE, b.buffer, MPI.SUM)
            if b.request is not None:
                complete(self.comm, b.request, "the gradient allreduce")
            b.request = None
            b.buffer /= self.size
        self.reduce_seconds += time.perf_counter() - t0
        return self.grads


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
            f"{what} did not complete within {STALL_TIMEOUT:.0f} s: a replica "
            f"is hung? (MPIPS_STALL_TIMEOUT sets the limit); aborting the job"
        )

    poll(request.Test, stall_limit(comm.rank), late, spin=SPIN_SECONDS)


def agree_max(comm: MPI.Comm, values: list[int], what: str = "the step's agreement") -> list[int]:
    """The element-wise largest ``values`` over all ranks of ``comm`` (one small allreduce)."""
    buf = np.array(values, dtype=np.int64)
    complete(comm, comm.Iallreduce(MPI.IN_PLACE, buf, MPI.MAX), what)
    return [int(v) for v in buf]


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
        wait(comm.Ibcast(a, root=root), "the chief's broadcast of the variables", START_TIMEOUT)


def replica_hash(arrays: list[np.ndarray]) -> int:
    """CRC32 of the bytes of all arrays: equal only if the replicas are bitwise identical."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).data, crc)  # zero-copy
    return crc


def check_replicas(comm: MPI.Comm, arrays: list[np.ndarray], step: int) -> None:
    """Unless all replicas are bitwise identical, raise on every one: ReplicasDiverged on the
    chief (rank 0 of ``comm``), naming the replicas that differ; AlreadyReported elsewhere."""
    hashes = allgather_json(comm, replica_hash(arrays), "the replica check", STALL_TIMEOUT)
    if len(set(hashes)) > 1:
        first = hashes[0]
        bad = [task for task, h in enumerate(hashes) if h != first]
        message = (
            f"replicas diverged at global_step {step}: the variables of worker task(s) "
            f"{', '.join(map(str, bad))} differ from task 0's (a non-deterministic op, "
            f"or a replica changed outside the update)"
        )
        raise ReplicasDiverged(message) if comm.rank == 0 else AlreadyReported(message)

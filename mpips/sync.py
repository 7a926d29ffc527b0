"""Synchronous replicas: gradient buckets averaged with non-blocking allreduce, the initial
broadcast, and the replica-divergence check. With store/, the only code that moves data over MPI.

Gradients live in a few flat float buffers (buckets), filled in the order backward produces
them; when a bucket's last gradient is written its ``Iallreduce`` starts at once, so reducing
it overlaps the rest of backward. Between layers, pending requests are tested: MPICH makes
progress only inside MPI calls.
"""
from __future__ import annotations

import os
import time
import zlib
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .errors import AgreedError, Stalled
from .placement import VariableSpec
from .store.cluster import STALL_TIMEOUT, allgather_json, stall_limit, wait


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
        self.reduce_seconds = 0.0   # time spent waiting for reductions after backward
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
            self.grads[s.name] = buf[offset:offset + n].reshape(s.shape)
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
        """Wait for every bucket, divide by the number of replicas; returns the mean gradients."""
        t0 = time.perf_counter()
        for index, b in enumerate(self.buckets):
            if self._pending.get(index):
                raise RuntimeError(f"gradients {sorted(self._pending[index])} were never written")
            if b.request is not None:
                complete(self.comm, b.request, "the gradient allreduce")
            b.request = None
            b.buffer /= self.size
        self.reduce_seconds += time.perf_counter() - t0
        return self.grads


def complete(comm: MPI.Comm, request: MPI.Request, what: str) -> None:
    """Wait for a collective of every replica, yielding the core (a 20 us sleep instead
    doubled the step time). A replica that never joins (hung, yet alive) ends the job after
    MPIPS_STALL_TIMEOUT s (later ranks a little longer, so one rank says it)."""
    deadline = time.monotonic() + stall_limit(comm.rank)
    while not request.Test():
        os.sched_yield()
        if time.monotonic() > deadline:
            raise Stalled(f"{what} did not complete within {STALL_TIMEOUT:.0f} s: a replica "
                          f"is hung? (MPIPS_STALL_TIMEOUT sets the limit); aborting the job")


def agree_max(comm: MPI.Comm, value: int) -> int:
    """The largest ``value`` over all replicas (one 8-byte allreduce)."""
    buf = np.array([value], dtype=np.int64)
    complete(comm, comm.Iallreduce(MPI.IN_PLACE, buf, MPI.MAX), "the step's agreement")
    return int(buf[0])


def broadcast(comm: MPI.Comm, arrays: list[np.ndarray], root: int = 0) -> None:
    """Broadcast arrays in place from ``root`` (waiting ranks sleep)."""
    for a in arrays:
        wait(comm.Ibcast(a, root=root))


def replica_hash(arrays: list[np.ndarray]) -> int:
    """CRC32 of the bytes of all arrays: equal only if the replicas are bitwise identical."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).view(np.uint8), crc)
    return crc


def check_replicas(comm: MPI.Comm, arrays: list[np.ndarray], step: int) -> None:
    """Raise on every replica, naming the ones that differ, unless all are bitwise identical."""
    hashes = allgather_json(comm, replica_hash(arrays))
    if len(set(hashes)) > 1:
        first = hashes[0]
        bad = [task for task, h in enumerate(hashes) if h != first]
        raise ReplicasDiverged(
            f"replicas diverged at global_step {step}: the variables of worker task(s) "
            f"{', '.join(map(str, bad))} differ from task 0's (a non-deterministic op, or a "
            f"replica changed outside the update)")


class ReplicasDiverged(AgreedError):
    """Replicas are no longer identical (raised on every replica at once; exit code 1)."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=1)

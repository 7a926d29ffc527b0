"""Raw MPI limits on this machine, the figures mpips' store is measured against: one-sided
Get and Accumulate bandwidth from a PS rank's window, 8-byte atomic latency with one
Lock_all epoch (as mpips runs) and with a Lock/Unlock per operation, and Allreduce times.

Run:  mpiexec -n 3 python benchmarks/rma_limits.py      (rank 0 plays the PS, asleep)

The PS rank makes no MPI call while the workers measure: it waits in Ibarrier + Test + a
1 ms sleep, as an mpips PS does, so what is measured is passive-target RMA with an idle
target. Figures are medians over --reps samples; each sample moves about --bytes per worker.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
PS = 0


def idle_barrier(c: MPI.Comm) -> None:
    """A barrier whose waiting ranks sleep (MPICH's blocking one busy-polls)."""
    request = c.Ibarrier()
    while not request.Test():
        time.sleep(1e-3)


def median_seconds(fn, active: bool, iters: int, reps: int) -> float:
    """Median seconds per call of ``fn`` on the active ranks (all start each sample together)."""
    if active:
        fn()
    samples = []
    for _ in range(reps):
        idle_barrier(comm)
        t0 = time.perf_counter()
        if active:
            for _ in range(iters):
                fn()
        samples.append((time.perf_counter() - t0) / iters)
    return float(np.median(samples))


def worst(value: float, active: bool) -> float:
    """The slowest active rank's figure (0 from the others)."""
    return comm.allreduce(value if active else 0.0, MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--bytes", type=float, default=64e6, help="bytes per sample per worker")
    args = ap.parse_args()
    if comm.size < 2:
        raise SystemExit("run under mpiexec with at least 2 ranks (rank 0 is the PS)")
    sizes = (1 << 20, 16 << 20)
    win = MPI.Win.Allocate(max(sizes) if comm.rank == PS else 0, disp_unit=1, comm=comm)
    counter = MPI.Win.Allocate(8 if comm.rank == PS else 0, disp_unit=8, comm=comm)
    np.frombuffer(win.tomemory(), np.uint8)[:] = 0
    np.frombuffer(counter.tomemory(), np.uint8)[:] = 0
    idle_barrier(comm)
    rows = []
    workers = comm.size - 1
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, np.float32)
        iters = max(1, int(args.bytes / nbytes))
        copy_src = np.ones_like(buf)
        t = worst(
            median_seconds(lambda: np.copyto(buf, copy_src), comm.rank == 1, iters, args.reps),
            comm.rank == 1,
        )
        rows.append((f"memcpy {nbytes >> 20} MiB (numpy copyto)", 1, nbytes / t / 1e9, "GB/s"))
        win.Lock_all(MPI.MODE_NOCHECK)
        for k in sorted({1, workers}):
            active = 1 <= comm.rank <= k

            def get() -> None:
                win.Get([buf, MPI.FLOAT], PS, [0, buf.size, MPI.FLOAT])
                win.Flush(PS)

            def acc() -> None:
                win.Accumulate([buf, MPI.FLOAT], PS, [0, buf.size, MPI.FLOAT], MPI.SUM)
                win.Flush(PS)

            for label, fn in (("Get", get), ("Accumulate(SUM)", acc)):
                t = worst(median_seconds(fn, active, iters, args.reps), active)
                rows.append((f"{label} {nbytes >> 20} MiB", k, k * nbytes / t / 1e9, "GB/s"))
        win.Unlock_all()
    one, out = np.ones(1, np.int64), np.zeros(1, np.int64)

    def fetch_in_epoch() -> None:
        counter.Fetch_and_op(one, out, PS, 0, MPI.SUM)
        counter.Flush(PS)

    def fetch_own_epoch() -> None:
        counter.Lock(PS, MPI.LOCK_SHARED)
        counter.Fetch_and_op(one, out, PS, 0, MPI.SUM)
        counter.Unlock(PS)

    counter.Lock_all(MPI.MODE_NOCHECK)
    t = worst(median_seconds(fetch_in_epoch, comm.rank == 1, 2000, args.reps), comm.rank == 1)
    rows.append(("8-byte Fetch_and_op, Lock_all + Flush", 1, t * 1e6, "us"))
    counter.Unlock_all()
    t = worst(median_seconds(fetch_own_epoch, comm.rank == 1, 50, args.reps), comm.rank == 1)
    rows.append(("8-byte Fetch_and_op, Lock/Unlock per op", 1, t * 1e6, "us"))
    for nbytes in sizes:
        buf = np.ones(nbytes // 4, np.float32)
        for k in sorted({2, comm.size}):
            sub = comm.Split(0 if comm.rank < k else MPI.UNDEFINED, comm.rank)
            t = 0.0
            if sub != MPI.COMM_NULL:
                samples = []
                for _ in range(args.reps):
                    idle_barrier(sub)
                    t0 = time.perf_counter()
                    sub.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
                    samples.append(time.perf_counter() - t0)
                t = float(np.median(samples))
                sub.Free()
            t = comm.allreduce(t, MPI.MAX)
            rows.append((f"Allreduce f32 {nbytes >> 20} MiB", k, t * 1e3, "ms"))
    counter.Free()
    win.Free()
    if comm.rank == 0:
        print(
            f"# rma_limits | {MPI.Get_library_version().splitlines()[0]} | {comm.size} ranks "
            f"(rank 0 the PS, asleep) | median of {args.reps}"
        )
        print(f"{'operation':<42}{'ranks/workers':>14}{'value':>10}  unit")
        for label, k, value, unit in rows:
            print(f"{label:<42}{k:>14}{value:>10.2f}  {unit}")


if __name__ == "__main__":
    main()

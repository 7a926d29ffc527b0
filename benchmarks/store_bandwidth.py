"""Pull/push bandwidth of the mpips store vs raw MPI_Get / MPI_Accumulate of the same bytes.

Run:  mpiexec -n 3 python benchmarks/store_bandwidth.py      (rank 0 = PS, ranks 1-2 = workers)

Both sides use the same window kind (Win.Allocate, lock_all held, completion by Flush), so the
ratio shows what mpips adds on top of MPI: one Get/Accumulate per PS over a whole placement.
Rows: the reference MLP (784-512-512-10, 6 variables, 2.7 MB) and a 16 MiB single variable,
with 1 and 2 workers active at once. Figures: median of --reps samples, aggregate GB/s.

The PS serves as in training (mpips.store.serve): on one node it sleeps, waking every 5 ms
for its chores; across nodes it also enters MPI every 200 us, and both the raw and the mpips
transfers move at the pace that allows over a network without hardware RMA. The workers
publish a clock per sample, as in training, so the PS's watchdog sees them alive.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpips.models.mlp import MLP
from mpips.models.variables import VariableSpec
from mpips.placement.layout import make_layout
from mpips.placement.table import round_robin
from mpips.store import Cluster, StoreClient, Windows, barrier, serve

comm = MPI.COMM_WORLD


def timed(fn, active: bool, iters: int, reps: int, workers: MPI.Comm) -> float:
    """Median seconds per op of fn over reps samples (all workers start together)."""
    if active:
        fn()  # warm-up: first touch of buffers and windows
    samples = []
    for _ in range(reps):
        barrier(workers, "the benchmark")  # idle ranks sleep meanwhile, off the active ones' cores
        t0 = time.perf_counter()
        if active:
            for _ in range(iters):
                fn()
        dt = (time.perf_counter() - t0) / iters
        samples.append(dt)
    return float(np.median(samples))


def measure(cluster: Cluster, windows: Windows, n: int, args: argparse.Namespace) -> list[tuple]:
    """A worker's side: (op, workers, GB/s raw, GB/s mpips) rows, 1 then 2 workers active."""
    client = StoreClient(windows, cluster.role.task)
    control = client.control
    if cluster.is_chief:  # the PS serves from the ready flag on
        control.set_counters(0)
        control.raise_ready()
    else:
        control.wait_ready(30)
    raw = np.zeros(n // 4, np.float32)
    win, ps, workers = windows.params, cluster.layout.ps_ranks[0], cluster.workers

    def raw_get():
        win.Get([raw, MPI.FLOAT], ps, [0, raw.size, MPI.FLOAT])
        win.Flush(ps)

    def raw_acc():
        win.Accumulate([raw, MPI.FLOAT], ps, [0, raw.size, MPI.FLOAT], MPI.SUM)
        win.Flush(ps)

    iters = max(1, int(args.bytes / n))
    rows, samples = [], 0
    for k in (1, 2):
        active = cluster.role.task < k
        for op, fn_raw, fn_mpips in (
            ("pull / Get", raw_get, client.pull),
            ("push / Accumulate", raw_acc, client.push),
        ):
            t_raw = timed(fn_raw, active, iters, args.reps, workers)
            t_mp = timed(fn_mpips, active, iters, args.reps, workers)
            barrier(workers, "the benchmark")  # (an idle rank must not spin in an Allreduce)
            samples += 2 * args.reps
            control.publish_clock(cluster.role.task, samples)  # alive, for the PS's watchdog
            t_raw = workers.allreduce(t_raw if active else 0.0, MPI.MAX)
            t_mp = workers.allreduce(t_mp if active else 0.0, MPI.MAX)
            rows.append((op, k, k * n / t_raw / 1e9, k * n / t_mp / 1e9))
    barrier(workers, "the benchmark")
    if cluster.is_chief:  # the PS stops serving
        control.end_run()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--bytes", type=float, default=64e6, help="bytes moved per sample per worker")
    args = ap.parse_args()
    layout = make_layout(comm.size, 1)
    cluster = Cluster(comm, layout)
    models = {
        "MLP 784-512-512-10": MLP([784, 512, 512, 10]).variables(),
        "one 16 MiB variable": [VariableSpec("w", (4 << 20,))],
    }
    rows = []
    for label, specs in models.items():
        placement = round_robin(specs, 1)
        windows = Windows(comm, layout, placement)
        n = placement.ps_bytes(0)
        if cluster.is_ps:  # as in training: it serves until the chief ends the run
            serve(cluster, windows)
        else:
            for op, k, raw_bw, mp_bw in measure(cluster, windows, n, args):
                rows.append((label, op, k, n, raw_bw, mp_bw))
        windows.free()
    if cluster.is_chief:
        print(
            f"# store_bandwidth | {MPI.Get_library_version().splitlines()[0]} | "
            f"{comm.size} ranks (1 ps, serving as in training) | median of {args.reps}"
        )
        print(
            f"{'payload':<22}{'op':<19}{'workers':>7}{'bytes':>11}{'raw GB/s':>10}"
            f"{'mpips GB/s':>12}{'ratio':>7}"
        )
        for label, op, k, n, raw_bw, mp_bw in rows:
            print(
                f"{label:<22}{op:<19}{k:>7}{n:>11}{raw_bw:>10.2f}{mp_bw:>12.2f}"
                f"{mp_bw / raw_bw:>7.2f}"
            )
    cluster.free()


if __name__ == "__main__":
    main()

"""Row-wise pull + push of a partitioned table: a 10M-row table vs a 10K-row table, the same
batch of ids; bytes moved vs the bytes of the unique rows touched; and the time vs a raw
MPI_Get / MPI_Accumulate of the same bytes in one contiguous block (the limit).

Run:  mpiexec -n 3 python benchmarks/sparse_rows.py     (2 PS tasks, 1 worker)

Each step pulls the rows of a batch's unique ids from every table (an embedding of width 8
plus wide weights of width 1, both float32, split "mod" over the 2 PS tasks) and pushes their
gradient rows with Accumulate (SGD). The ids are the same for both table sizes: 128 rows x
32 Zipf(1.2) draws, deduplicated, all below 10K. Target: 10M / 10K step time <= 1.2x.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpips.layout import make_layout
from mpips.placement import VariableSpec, place_tables, round_robin
from mpips.store import Cluster, StoreClient, Windows, sleepy_barrier

comm = MPI.COMM_WORLD


def batch_ids(seed: int, rows: int = 128, nnz: int = 32, space: int = 10_000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.unique((rng.zipf(1.2, (rows, nnz)) - 1) * 7919 % space)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    layout = make_layout(comm.size, 2)
    cluster = Cluster(comm, layout)
    worker = not cluster.is_ps
    batches = [batch_ids(s) for s in range(16)]
    unique = float(np.mean([len(b) for b in batches]))
    sizes = (10_000, 10_000_000)
    setups, results = {}, {}
    for rows in sizes:  # both tables live at once: their reps interleave (see below)
        tables = [VariableSpec("deep/embedding", (rows, 8)), VariableSpec("wide/weights", (rows, 1))]
        placement = place_tables(round_robin([VariableSpec("wide/bias", (1,))], 2), tables, "mod")
        windows = Windows(comm, layout, placement)
        setups[rows] = (windows, StoreClient(windows, cluster.role.task))
    row_bytes = 4 * (8 + 1)
    raw = np.zeros(int(unique * row_bytes) // 4 // 2, np.float32)  # half per PS

    def rows_step(client: StoreClient, i: int) -> None:
        client.pull(batches[i % len(batches)])
        for g in client.gradients().values():
            g[...] = 0.0  # zero deltas: the tables stay as they are
        client.push()

    def raw_step(win: MPI.Win) -> None:
        for rank in layout.ps_ranks:
            win.Get([raw, MPI.FLOAT], rank, [64, raw.size, MPI.FLOAT])
        for rank in layout.ps_ranks:
            win.Flush(rank)
        for rank in layout.ps_ranks:
            win.Accumulate([raw, MPI.FLOAT], rank, [64, raw.size, MPI.FLOAT], MPI.SUM)
        for rank in layout.ps_ranks:
            win.Flush(rank)

    # reps alternate between the two sizes, so that a change in the machine's load (a
    # shared 2-core VM) hits both alike instead of skewing their ratio
    samples = {(rows, kind): [] for rows in sizes for kind in ("rows", "raw")}
    for _ in range(args.reps):
        for rows in sizes:
            windows, client = setups[rows]
            for kind in ("rows", "raw"):
                sleepy_barrier(comm)
                t0 = time.perf_counter()
                for i in range(args.steps if worker else 0):
                    if kind == "rows":
                        rows_step(client, i)
                    else:
                        raw_step(windows.params)
                samples[rows, kind].append((time.perf_counter() - t0) / args.steps)
    sleepy_barrier(comm)
    for rows in sizes:
        results[rows] = {kind: comm.bcast(float(np.median(samples[rows, kind])),
                                          root=layout.chief_rank) for kind in ("rows", "raw")}
        results[rows]["bytes"] = 2 * unique * row_bytes + 2 * 64  # rows both ways, + bias
        setups[rows][0].free()
    if comm.rank == 0:
        print(f"# sparse_rows | {MPI.Get_library_version().splitlines()[0]} | {comm.size} "
              f"ranks (2 ps, 1 worker) | {unique:.0f} unique ids per batch, embedding 8 + wide 1 "
              f"float32 | median of {args.reps} x {args.steps} steps")
        print(f"{'table rows':>12}{'step us':>10}{'raw us':>9}{'raw/step':>10}"
              f"{'bytes moved':>13}{'unique-row bytes':>18}")
        for rows, r in results.items():
            print(f"{rows:>12}{r['rows'] * 1e6:>10.1f}{r['raw'] * 1e6:>9.1f}"
                  f"{r['raw'] / r['rows']:>10.2f}{r['bytes']:>13.0f}{2 * unique * 36:>18.0f}")
        ratio = results[10_000_000]["rows"] / results[10_000]["rows"]
        print(f"10M-row / 10K-row step time: {ratio:.2f}x (target <= 1.2x)")
    cluster.free()


if __name__ == "__main__":
    main()

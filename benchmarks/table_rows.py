"""Rows pulled and pushed per second by one PS process: a fixed table (rows in the PS
window, moved one-sided: indexed Get and Accumulate, the PS idle) against a dynamic table
(tables.kind = "dynamic": the PS answers each lookup from its id map and applies each
push), and the physical limit of either, measured in the same run on the PS process: a
numpy gather and scatter-add of the same rows of a table in its own memory.

Run:  mpiexec -n 2 python benchmarks/table_rows.py     (1 PS task, 1 worker)

A step: the unique ids of a batch of 256 rows x 26 ids (Zipf(1.2) ranks, scattered over
1M ids by a fixed bijection, as benchmarks/sparse_rows.py draws them), their rows pulled
(16 float32 each) and gradient rows pushed (plain SGD: the deltas added). Rows/s counts
each row once pulled and once pushed. The dynamic table's ids are the same values; its
first pass makes their rows (the timed passes after it make the rare new ones only, as a
running job does). The limit does the same gather and scatter-add on a 1M x 16 array.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpips.models.ctr import uniform_rows
from mpips.models.variables import VariableSpec
from mpips.placement.layout import make_layout
from mpips.placement.table import place_tables, round_robin
from mpips.store import Cluster, StoreClient, Windows
from mpips.store.dynamic_rows import DynamicRows
from mpips.store.lookups import DynamicClient, DynamicServer, DynamicSpec, Lookups

comm = MPI.COMM_WORLD
ROWS, WIDTH, SCATTER = 1_000_000, 16, 2654435761
STOP = 11


def batches(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ranks = rng.zipf(1.2, (256, 26)) - 1
        out.append(np.unique((ranks % ROWS) * SCATTER % ROWS).astype(np.int64))
    return out


def serve(server: DynamicServer) -> None:
    """PS: answer until the worker says stop."""
    while not comm.Iprobe(1, STOP):
        server.sweep()
    comm.recv(source=1, tag=STOP)


def numpy_limit(steps: list[np.ndarray]) -> float:
    """Seconds of the gather + scatter-add of every step's rows, in this process."""
    table = np.zeros((ROWS, WIDTH), np.float32)
    t = time.perf_counter()
    for ids in steps:
        rows = table[ids]
        table[ids] += rows * np.float32(-0.01)  # (unique ids: a scatter-add)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    assert comm.size == 2, "run under mpiexec -n 2"
    layout = make_layout(2, 1)
    cluster = Cluster(comm, layout)
    spec = VariableSpec("t", (ROWS, WIDTH))
    windows = Windows(comm, layout, place_tables(round_robin([], 1), [spec], "mod"))
    table = DynamicSpec("t", WIDTH, np.dtype(np.float32))
    lookups = Lookups(comm, layout.ps_ranks, [table], 256 * 26)
    steps = batches(0, args.steps)
    unique = sum(len(s) for s in steps)
    if cluster.is_ps:
        rows = DynamicRows(
            {"t": WIDTH},
            np.dtype(np.float32),
            (),
            lambda ids: {"t": {"": uniform_rows(0, ids, WIDTH, 0.05)}},
        )
        server = DynamicServer(lookups, rows, None, 0)
        limits = []
        for _ in range(args.reps + 1):  # (the first dynamic pass makes the rows)
            serve(server)  # the dynamic pass
            comm.barrier()
            limits.append(numpy_limit(steps))  # while the worker waits
            comm.barrier()
        comm.send(limits[1:], dest=1)
        comm.send(rows.live, dest=1)
    else:
        client, dynamic = StoreClient(windows, 0), DynamicClient(lookups, 0)
        out = {"t": np.empty((256 * 26, WIDTH), np.float32)}
        fixed, dyn = [], []
        for _ in range(args.reps + 1):
            t = time.perf_counter()
            for ids in steps:
                dynamic.ask(ids, train=True)
                dynamic.receive({"t": out["t"][: len(ids)]})
                dynamic.post(ids, {"t": out["t"][: len(ids)] * np.float32(-0.01)}, 0.0)
                dynamic.wait_applied()
            dyn.append(time.perf_counter() - t)
            comm.send(None, dest=0, tag=STOP)
            t = time.perf_counter()
            for ids in steps:
                pulled = client.pull(ids, step=True)
                client.gradients()["t"][...] = pulled["t"] * np.float32(-0.01)
                client.push()
            fixed.append(time.perf_counter() - t)
            comm.barrier()
            comm.barrier()
        limits, live = comm.recv(source=0), comm.recv(source=0)
        rate = lambda s: 2 * unique / min(s) / 1e6  # noqa: E731 (rows moved, M/s)
        print(
            f"{args.steps} steps of {unique / args.steps:.0f} unique ids, rows of {WIDTH} "
            f"float32; {live} dynamic rows made; best of {args.reps} passes"
        )
        print(f"numpy gather + scatter-add (limit): {rate(limits):6.2f} M rows/s")
        print(
            f"fixed table (one-sided):            {rate(fixed[1:]):6.2f} M rows/s "
            f"({rate(fixed[1:]) / rate(limits):.2f}x the limit)"
        )
        print(
            f"dynamic table (PS answers):         {rate(dyn[1:]):6.2f} M rows/s "
            f"({rate(dyn[1:]) / rate(limits):.2f}x the limit)"
        )
    lookups.free()
    windows.free()


if __name__ == "__main__":
    main()

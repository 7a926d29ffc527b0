"""Sync mode's gradient reduction and sharded update vs a raw mpi4py Allreduce of the same
bytes, and the share of communication hidden behind backward.

Run:  mpiexec -n 2 python benchmarks/sync_allreduce.py [--bucket-bytes N]

Model: the reference MLP (784-512-512-10, 2.68 MB of float32 gradients), batch 128 per replica.
* raw       : one blocking Allreduce(IN_PLACE, SUM) of a flat buffer of all gradient bytes.
* raw+apply : the same, then the mean and an SGD update of every variable on every replica
              (what each replica ran before updates were sharded).
* buckets   : mpips' GradientBuckets on the same bytes (Ireduce_scatter per bucket, the mean
              and SGD update of this replica's part, Iallgatherv of the variables), no compute.
* shared    : the same with node shared memory (every replica on one node, sync mode's
              default there): each replica sums its part from the others' memory and
              updates the one copy of the variables in place; no compute.
* compute   : forward + backward alone (no communication).
* step      : forward + backward with the buckets started during backward, then finish().
hidden share = 1 - (step - compute) / buckets: how much of the reduction backward covered.
Figures: medians over --reps samples of --iters steps each.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpips.allreduce import GradientBuckets
from mpips.job import TrainConfig
from mpips.models.mlp import MLP
from mpips.optim import Optimizer
from mpips.store import barrier

comm = MPI.COMM_WORLD


def median_time(fn, reps: int, iters: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        barrier(comm, "the benchmark")
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters)
    return float(comm.allreduce(np.median(samples), MPI.MAX))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-bytes", type=int, default=TrainConfig().bucket_bytes)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    model = MLP([784, 512, 512, 10])
    specs = model.variables()
    params = model.initial_values(0)
    buckets = GradientBuckets(comm, specs, args.bucket_bytes)
    one_node = comm.Split_type(MPI.COMM_TYPE_SHARED).size == comm.size
    shared = GradientBuckets(comm, specs, args.bucket_bytes, shared=True) if one_node else None
    nbytes = sum(s.nbytes for s in specs)
    flat = np.ones(nbytes // 4, np.float32)
    whole = np.ones(nbytes // 4, np.float32)
    lr = 0.01
    sgd = Optimizer("sgd")

    def update(var: np.ndarray, grad: np.ndarray, slots: dict) -> None:
        sgd.apply(var, grad, {}, lr, 1)

    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((128, 784)).astype(np.float32)
    y = rng.integers(0, 10, 128)
    local = {k: np.zeros_like(v) for k, v in params.items()}

    def raw():
        comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)

    def raw_apply():
        comm.Allreduce(MPI.IN_PLACE, flat, MPI.SUM)
        flat[...] /= comm.size
        sgd.apply(whole, flat, {}, lr, 1)

    def exchange(b, backward=False):
        """One step of ``b``: every gradient ready at once, or as backward writes it."""
        b.start_step(update, votes=[0, 0])  # (as a job: a stop signal, a hook's)
        if backward:
            model.loss_and_grads(params, x, y, b.grads, ready=b.ready)
        else:
            for s in reversed(specs):
                b.ready(s.name)
        b.set_loss(0.0)
        b.finish()

    def reduce_only(b=buckets):
        exchange(b)

    def compute():
        model.loss_and_grads(params, x, y, local)

    def step():
        exchange(buckets, backward=True)

    runs: dict[str, list[float]] = {}
    for _ in range(3):  # interleave, so every kind of sample sees the same machine load
        for name, fn in (
            ("raw", raw),
            ("raw+apply", raw_apply),
            ("buckets", reduce_only),
            ("compute", compute),
            ("step", step),
            *([("shared", lambda: reduce_only(shared))] if shared else []),
        ):
            runs.setdefault(name, []).append(median_time(fn, args.reps, args.iters))
    t = {name: float(np.median(v)) for name, v in runs.items()}
    if comm.rank == 0:
        raw_t = t["raw"]
        hidden = 1 - (t["step"] - t["compute"]) / t["buckets"]
        print(
            f"# sync_allreduce | {MPI.Get_library_version().splitlines()[0]} | {comm.size} "
            f"replicas | {nbytes} bytes in {len(buckets.buckets)} bucket(s) of ~"
            f"{args.bucket_bytes} bytes | medians of {args.reps}"
        )
        print(f"raw Allreduce of the same bytes      : {raw_t * 1e3:7.3f} ms")
        print(f"raw Allreduce, mean, SGD on all      : {t['raw+apply'] * 1e3:7.3f} ms")
        print(
            f"mpips buckets with the SGD update    : {t['buckets'] * 1e3:7.3f} ms  "
            f"({t['buckets'] / raw_t:.2f}x raw; {t['buckets'] / t['raw+apply']:.2f}x raw+apply)"
        )
        if "shared" in t:
            print(
                f"mpips node shared memory, SGD update : {t['shared'] * 1e3:7.3f} ms  "
                f"({t['shared'] / raw_t:.2f}x raw; {t['shared'] / t['raw+apply']:.2f}x raw+apply)"
            )
        print(f"forward+backward alone               : {t['compute'] * 1e3:7.3f} ms")
        print(f"forward+backward with bucket overlap : {t['step'] * 1e3:7.3f} ms")
        print(f"communication hidden behind backward : {max(0.0, hidden) * 100:5.1f} %")


if __name__ == "__main__":
    main()

"""Apply throughput of each optimizer through mpips vs a numpy in-place update in one process,
and the two ways a stateful update can reach PS memory over one-sided MPI.

Run:  mpiexec -n 3 python benchmarks/optimizer_apply.py     (rank 0 = PS, ranks 1-2 = workers)

Model: the reference MLP's variables (784-512-512-10, 0.67 M float32 parameters).
* limit       : Optimizer.apply on the same arrays, in place, in one process (rank 0 alone).
* ps-applies  : mpips' path. Workers Put the gradient into their inbox on the PS and raise a
                mail flag; the PS applies the rule to its own memory and clears the flag.
* worker-lock : the alternative. A worker takes a spin lock on the PS (Compare_and_swap),
                Gets variable + slots, applies the rule locally, Puts them back, unlocks.
Figures: parameters updated per second (aggregate over the active workers), median of --reps.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from mpips.layout import make_layout
from mpips.nn import MLP
from mpips.optim import Optimizer
from mpips.placement import round_robin, slot_placement, views
from mpips.store import TICKETS, Cluster, StoreClient, Windows, barrier, serve

comm = MPI.COMM_WORLD
HYPER = {
    "momentum": 0.9,
    "nesterov": False,
    "epsilon": 1e-7,
    "initial_accumulator_value": 0.1,
    "beta1": 0.9,
    "beta2": 0.999,
    "l1": 0.0,
    "l2": 0.0,
}
KINDS = ("sgd", "momentum", "adagrad", "adam", "ftrl")


def gradient(rng: np.random.Generator, shape) -> np.ndarray:
    """The same kind of gradient on every path (rule speed can depend on the values)."""
    return (rng.standard_normal(shape) * 1e-2).astype(np.float32)


def start_values(opt: Optimizer, specs):
    """Variables and slots every path starts from (FTRL's speed depends on the values)."""
    rng = np.random.default_rng(0)
    params = {s.name: (rng.standard_normal(s.shape) * 0.05).astype(np.float32) for s in specs}
    return params, {k: opt.init_slots(v) for k, v in params.items()}


def write_start(client: StoreClient, opt: Optimizer, specs) -> None:
    params, slots = start_values(opt, specs)
    client.initialise(params, {f"{k}/{s}": v for k, d in slots.items() for s, v in d.items()})


def limit(opt: Optimizer, specs, reps: int, iters: int) -> float:
    params, slots = start_values(opt, specs)
    rng = np.random.default_rng(100)
    grads = {k: gradient(rng, v.shape) for k, v in params.items()}
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for t in range(iters):
            for k in params:
                opt.apply(params[k], grads[k], slots[k], 1e-3, t + 1)
        samples.append((time.perf_counter() - t0) / iters)
    return sum(v.size for v in params.values()) / float(np.median(samples))


def timed_pushes(cluster, push, active: bool, reps: int, iters: int) -> float:
    """Median seconds per push; workers start each sample together (the PS is not involved)."""
    samples = []
    if active:
        push()
    for _ in range(reps):
        barrier(cluster.workers, "the benchmark")
        t0 = time.perf_counter()
        if active:
            for _ in range(iters):
                push()
        samples.append((time.perf_counter() - t0) / iters)
    barrier(cluster.workers, "the benchmark")
    return float(np.median(samples)) if active else 0.0


def ps_applies(cluster, placement, opt, workers: int, reps: int, iters: int) -> float:
    stateful = opt.stateful
    slots = slot_placement(placement, opt.slots) if stateful else None
    windows = Windows(comm, cluster.layout, placement, slots, stateful)
    seconds = 0.0
    if cluster.is_ps:
        serve(cluster, windows, opt.apply if stateful else None, opt.slots)
    else:
        client = StoreClient(windows, cluster.role.task, stateful)
        if cluster.is_chief:
            write_start(client, opt, placement_specs(placement))
            client.control.raise_ready()
        client.control.wait_ready()
        rng = np.random.default_rng(100 + cluster.role.task)  # not the start values' seed
        for g in client.grads.values():
            g[...] = gradient(rng, g.shape)
        active = cluster.role.task < workers
        seconds = timed_pushes(cluster, lambda: client.push(1e-3), active, reps, iters)
        if cluster.is_chief:
            client.control.end_run()  # ends serve() on the PS
    barrier(comm, "the benchmark")
    windows.free()
    return seconds


def worker_lock(cluster, placement, opt, workers: int, reps: int, iters: int) -> float:
    slots = slot_placement(placement, opt.slots)
    windows = Windows(comm, cluster.layout, placement, slots, False)
    seconds = 0.0
    if not cluster.is_ps:
        if cluster.is_chief:
            write_start(StoreClient(windows, 0), opt, placement_specs(placement))
        barrier(cluster.workers, "the benchmark")
        win, ctl, ps = windows.params, windows.control, cluster.layout.ps_ranks[0]
        size = windows.state_bytes(0)
        buf = np.zeros(size, np.uint8)
        var = views(placement, [buf])
        slot = views(slots, [buf])
        rng = np.random.default_rng(100 + cluster.role.task)
        grads = {k: gradient(rng, v.shape) for k, v in var.items()}
        one, zero, old = (np.array([v], np.int64) for v in (1, 0, 0))
        t = [0]

        def push():
            while True:  # spin lock on the PS (a sleep between tries leaves the core to others)
                ctl.Compare_and_swap(one, zero, old, ps, TICKETS)
                ctl.Flush(ps)
                if old[0] == 0:
                    break
                time.sleep(2e-5)
            win.Get([buf, MPI.BYTE], ps, [0, size, MPI.BYTE])
            win.Flush(ps)
            t[0] += 1
            for k in var:
                opt.apply(var[k], grads[k], {s: slot[f"{k}/{s}"] for s in opt.slots}, 1e-3, t[0])
            win.Put([buf, MPI.BYTE], ps, [0, size, MPI.BYTE])
            win.Flush(ps)
            ctl.Fetch_and_op(zero, old, ps, TICKETS, MPI.REPLACE)
            ctl.Flush(ps)

        seconds = timed_pushes(cluster, push, cluster.role.task < workers, reps, iters)
    barrier(comm, "the benchmark")
    windows.free()
    return seconds


def placement_specs(placement):
    return [e.spec for e in placement]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    cluster = Cluster(comm, make_layout(comm.size, 1))
    specs = MLP([784, 512, 512, 10]).variables()
    placement = round_robin(specs, 1)
    nparams = sum(int(np.prod(s.shape)) for s in specs)
    rows = []
    for kind in KINDS:
        opt = Optimizer(kind, HYPER)
        lim = limit(opt, specs, args.reps, args.iters) if comm.rank == 0 else 0.0
        barrier(comm, "the benchmark")  # the others sleep while rank 0 measures the limit alone
        lim = comm.bcast(lim)
        for workers in (1, 2):
            t_ps = ps_applies(cluster, placement, opt, workers, args.reps, args.iters)
            t_lock = (
                worker_lock(cluster, placement, opt, workers, args.reps, args.iters)
                if opt.stateful
                else 0.0
            )
            t_ps = comm.allreduce(t_ps, MPI.MAX)
            t_lock = comm.allreduce(t_lock, MPI.MAX)
            rows.append(
                (
                    kind,
                    workers,
                    lim,
                    workers * nparams / t_ps,
                    workers * nparams / t_lock if t_lock else float("nan"),
                )
            )
    if comm.rank == 0:
        print(
            f"# optimizer_apply | {MPI.Get_library_version().splitlines()[0]} | 1 ps + "
            f"{comm.size - 1} workers | {nparams} float32 params | median of {args.reps}"
        )
        print(
            f"{'optimizer':<10}{'workers':>8}{'limit Mparam/s':>16}{'ps-applies':>12}"
            f"{'ratio':>7}{'worker-lock':>13}{'ratio':>7}"
        )
        for kind, w, lim, ps, lock in rows:
            note = " (Accumulate)" if kind == "sgd" else ""
            print(
                f"{kind:<10}{w:>8}{lim / 1e6:>16.1f}{ps / 1e6:>12.1f}{ps / lim:>7.2f}"
                f"{lock / 1e6:>13.1f}{lock / lim:>7.2f}{note}"
            )
    cluster.free()


if __name__ == "__main__":
    main()

"""Apply throughput of each optimizer through mpips vs the fastest in-place update in one
process, and the two ways a stateful update can reach PS memory over one-sided MPI.

Run:  mpiexec -n 3 python benchmarks/optimizer_apply.py     (rank 0 = PS, ranks 1-2 = workers)

Model: the reference MLP's variables (784-512-512-10, 0.67 M float32 parameters).
* limit       : the rule on the same arrays, in place, in one process (rank 0 alone, the
                others sleep), by each implementation: numpy (mpips' reference rules), fused
                (mpips' numba kernels, what Optimizer.apply runs), and two it does not ship:
                fastmath (the same loops compiled with fastmath=True: other rounding, a
                bound) and numexpr (when installed). The limit is the fastest of them.
* ps-applies  : mpips' path. Workers Put the gradient into their inbox on the PS and raise a
                mail flag; the PS applies the rule to its own memory and clears the flag.
                Measured with the numpy rules (the kernels off) and with the fused kernels.
* worker-lock : the alternative. A worker takes a spin lock on the PS (Compare_and_swap),
                Gets variable + slots, applies the rule locally (fused), Puts them back, unlocks.
* in place    : train.zero_copy's path. The PS memory is MPI shared memory; each worker runs
                the rule (fused) on the variables and slots there itself, a 4 MiB stripe at a
                time under that stripe's lock (mpips/store/stripes.py); the PS sleeps.
Figures: parameters updated per second (aggregate over the active workers), median of --reps.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from mpi4py import MPI

from mpips import optim
from mpips.models.mlp import MLP
from mpips.optim import Optimizer
from mpips.placement.layout import make_layout
from mpips.placement.table import round_robin, slot_placement, views
from mpips.store import Cluster, StoreClient, Windows, barrier, serve

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


def limit(apply, opt: Optimizer, specs, reps: int, iters: int) -> float:
    """Parameters per second of ``apply(var, grad, slots, lr, t)`` over the model, in place."""
    params, slots = start_values(opt, specs)
    rng = np.random.default_rng(100)
    grads = {k: gradient(rng, v.shape) for k, v in params.items()}
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for t in range(iters):
            for k in params:
                apply(params[k], grads[k], slots[k], 1e-3, t + 1)
        samples.append((time.perf_counter() - t0) / iters)
    return sum(v.size for v in params.values()) / float(np.median(samples))


def numpy_rule(opt: Optimizer):
    def apply(var, grad, slots, lr, t):
        with_kernels = optim.set_fused_kernels(False)
        opt.apply(var, grad, slots, lr, t)
        optim.set_fused_kernels(with_kernels)

    return apply


def fastmath(opt: Optimizer):
    """mpips' loops compiled with fastmath=True (reassociation, approximate division and
    square root where LLVM likes): not the same bits, a bound for the shipped kernels."""
    import numba

    kernel = numba.njit(opt.rule.loop, fastmath=True, error_model="numpy")

    def apply(var, grad, slots, lr, t):
        arrays = [a.reshape(-1) for a in (var, grad, *(slots[s] for s in opt.slots))]
        kernel(*arrays, *optim.kernel_scalars(opt.kind, opt.hyper, lr, t))

    return apply


def numexpr_rule(opt: Optimizer):
    """The rule as numexpr expressions (one pass per array written, one thread, the same
    float32 operations), or None without numexpr."""
    try:
        import numexpr
    except ImportError:
        return None
    numexpr.set_num_threads(1)
    f32, h = np.float32, opt.hyper

    def ev(expr, out, **names):
        numexpr.evaluate(expr, local_dict=names, out=out, casting="same_kind")

    def apply(var, grad, s, lr, t):
        if opt.kind == "sgd":
            ev("w - lr * g", var, w=var, lr=f32(lr), g=grad)
        elif opt.kind == "momentum":
            m, mu, lr = s["momentum"], f32(h["momentum"]), f32(lr)
            ev("m * mu + g", m, m=m, mu=mu, g=grad)
            step = "lr * (g + mu * m)" if h["nesterov"] else "lr * m"
            ev(f"w - {step}", var, w=var, lr=lr, g=grad, mu=mu, m=m)
        elif opt.kind == "adagrad":
            acc = s["accumulator"]
            ev("a + g * g", acc, a=acc, g=grad)
            ev(
                "w - lr * g / (sqrt(a) + e)",
                var,
                w=var,
                lr=f32(lr),
                g=grad,
                a=acc,
                e=f32(h["epsilon"]),
            )
        elif opt.kind == "adam":
            m, v, b1, b2 = s["m"], s["v"], h["beta1"], h["beta2"]
            lr_t = f32(lr * math.sqrt(1 - b2**t) / (1 - b1**t))
            ev("m * b1 + g * c1", m, m=m, b1=f32(b1), g=grad, c1=f32(1 - b1))
            ev("v * b2 + g * c2 * g", v, v=v, b2=f32(b2), g=grad, c2=f32(1 - b2))
            ev("w - m * lr_t / (sqrt(v) + e)", var, w=var, m=m, lr_t=lr_t, v=v, e=f32(h["epsilon"]))
        elif opt.kind == "ftrl":
            z, n, lr, l1 = s["z"], s["n"], f32(lr), f32(h["l1"])
            ev("z + (g - (sqrt(n + g * g) - sqrt(n)) / lr * w)", z, z=z, g=grad, n=n, lr=lr, w=var)
            ev("n + g * g", n, n=n, g=grad)
            clip = "where(z < -l1, -l1, where(z > l1, l1, z))"
            ev(
                f"({clip} - z) / (sqrt(n) / lr + l2x2)",
                var,
                z=z,
                l1=l1,
                n=n,
                lr=lr,
                l2x2=f32(2 * h["l2"]),
            )
        else:
            opt.apply(var, grad, s, lr, t)

    return apply


def limits(opt: Optimizer, specs, reps: int, iters: int) -> dict[str, float]:
    """Each single-process implementation's rate (rank 0 alone); NaN where it does not run."""
    name = optim.kernel_name(opt.kind, opt.hyper)
    if name is None:  # no kernel for this rule: one numpy implementation
        rate = limit(opt.apply, opt, specs, reps, iters)
        return {"numpy": rate, "fused": rate, "fastmath": float("nan"), "numexpr": float("nan")}
    impls = {"numpy": numpy_rule(opt), "fused": opt.apply}
    if optim.fused_kernel(name) is not None:
        impls["fastmath"] = fastmath(opt)
    if (ne := numexpr_rule(opt)) is not None:
        impls["numexpr"] = ne
    rates = {k: limit(f, opt, specs, reps, iters) for k, f in impls.items()}
    return {k: rates.get(k, float("nan")) for k in ("numpy", "fused", "fastmath", "numexpr")}


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


def ps_applies(
    cluster, placement, opt, workers: int, reps: int, iters: int, in_place: bool = False
) -> float:
    """Seconds per push through the PS (``in_place``: applied by the worker, zero copy)."""
    stateful = opt.stateful
    slots = slot_placement(placement, opt.slots) if stateful else None
    windows = Windows(
        comm, cluster.layout, placement, slots, stateful and not in_place, shared=in_place
    )
    seconds = 0.0
    if cluster.is_ps:
        serve(cluster, windows, opt.apply if stateful and not in_place else None, opt.slots)
    else:
        client = StoreClient(windows, cluster.role.task, stateful, opt.apply, opt.slots)
        if cluster.is_chief:
            write_start(client, opt, placement_specs(placement))
            client.control.raise_ready()
        client.control.wait_ready()
        rng = np.random.default_rng(100 + cluster.role.task)  # not the start values' seed
        for g in client.grads.values():
            g[...] = gradient(rng, g.shape)
        active = cluster.role.task < workers
        t = [0]

        def push():
            t[0] += 1
            client.push(1e-3, t=t[0])

        seconds = timed_pushes(cluster, push, active, reps, iters)
        if cluster.is_chief:
            client.control.end_run()  # ends serve() on the PS
    barrier(comm, "the benchmark")
    windows.free()
    return seconds


def worker_lock(cluster, placement, opt, workers: int, reps: int, iters: int) -> float:
    slots = slot_placement(placement, opt.slots)
    windows = Windows(comm, cluster.layout, placement, slots, False)
    ps = cluster.layout.ps_ranks[0]
    # the lock: a word of its own on the PS, moved with MPI's atomics (mpips' own control
    # window is node-shared memory moved with the CPU's atomics on one node)
    ctl = MPI.Win.Allocate(8 if comm.rank == ps else 0, disp_unit=8, comm=comm)
    if comm.rank == ps:
        np.frombuffer(ctl.tomemory(), np.int64)[:] = 0
    ctl.Lock_all(MPI.MODE_NOCHECK)
    barrier(comm, "the benchmark")
    seconds = 0.0
    if not cluster.is_ps:
        if cluster.is_chief:
            write_start(StoreClient(windows, 0), opt, placement_specs(placement))
        barrier(cluster.workers, "the benchmark")
        win = windows.params
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
                ctl.Compare_and_swap(one, zero, old, ps, 0)
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
            ctl.Fetch_and_op(zero, old, ps, 0, MPI.REPLACE)
            ctl.Flush(ps)

        seconds = timed_pushes(cluster, push, cluster.role.task < workers, reps, iters)
    barrier(comm, "the benchmark")
    ctl.Unlock_all()
    ctl.Free()
    windows.free()
    return seconds


def placement_specs(placement):
    return [e.spec for e in placement]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma list of optimizers")
    ap.add_argument("--no-worker-lock", action="store_true", help="skip the worker-lock path")
    args = ap.parse_args()
    cluster = Cluster(comm, make_layout(comm.size, 1))
    specs = MLP([784, 512, 512, 10]).variables()
    placement = round_robin(specs, 1)
    nparams = sum(int(np.prod(s.shape)) for s in specs)
    rows = []
    for kind in args.kinds.split(","):
        opt = Optimizer(kind, HYPER)
        if (name := optim.kernel_name(kind, HYPER)) is not None:
            optim.fused_kernel(name)  # compiled (or loaded) on every rank before any timing
        lims = limits(opt, specs, args.reps, args.iters) if comm.rank == 0 else {}
        barrier(comm, "the benchmark")  # the others sleep while rank 0 measures the limit alone
        lims = comm.bcast(lims)
        for workers in (1, 2):
            rates = {}
            for rule in ("numpy", "fused") if opt.stateful else ("numpy",):
                optim.set_fused_kernels(rule == "fused")
                t_ps = ps_applies(cluster, placement, opt, workers, args.reps, args.iters)
                rates[rule] = workers * nparams / comm.allreduce(t_ps, MPI.MAX)
            optim.set_fused_kernels(True)
            t_in = ps_applies(cluster, placement, opt, workers, args.reps, args.iters, True)
            rates["in place"] = workers * nparams / comm.allreduce(t_in, MPI.MAX)
            if opt.stateful and not args.no_worker_lock:
                t_lock = worker_lock(cluster, placement, opt, workers, args.reps, args.iters)
                rates["lock"] = workers * nparams / comm.allreduce(t_lock, MPI.MAX)
            rows.append((kind, workers, lims, rates))
    if comm.rank == 0:
        print(
            f"# optimizer_apply | {MPI.Get_library_version().splitlines()[0]} | 1 ps + "
            f"{comm.size - 1} workers | {nparams} float32 params | median of {args.reps} | "
            "Mparam/s"
        )
        print(
            f"{'optimizer':<10}{'workers':>8}{'numpy':>8}{'fused':>8}{'fastmath':>9}"
            f"{'numexpr':>8}{'limit':>8} |{'ps numpy':>9}{'/limit':>7}{'ps fused':>9}"
            f"{'/limit':>7}{'/numpy':>7} |{'worker-lock':>12}{'/limit':>7} |"
            f"{'in place':>9}{'/limit':>7}"
        )
        nan = float("nan")
        for kind, w, lims, rates in rows:
            lim = max(v for v in lims.values() if v == v)
            ps_np, ps_fused, lock, in_place = (
                rates.get(k, nan) for k in ("numpy", "fused", "lock", "in place")
            )
            note = " (Accumulate, no PS code)" if kind == "sgd" else ""
            print(
                f"{kind:<10}{w:>8}{lims['numpy'] / 1e6:>8.0f}{lims['fused'] / 1e6:>8.0f}"
                f"{lims['fastmath'] / 1e6:>9.0f}{lims['numexpr'] / 1e6:>8.0f}{lim / 1e6:>8.0f} |"
                f"{ps_np / 1e6:>9.0f}{ps_np / lim:>7.2f}{ps_fused / 1e6:>9.0f}"
                f"{ps_fused / lim:>7.2f}{ps_fused / ps_np:>7.2f} |{lock / 1e6:>12.0f}"
                f"{lock / lim:>7.2f} |{in_place / 1e6:>9.0f}{in_place / lim:>7.2f}{note}"
            )
    cluster.free()


if __name__ == "__main__":
    main()

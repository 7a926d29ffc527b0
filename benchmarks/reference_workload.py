"""Examples/s of the reference workload (MLP 784-512-512-10 on synthetic N(0,1) data):
mpips async (1 PS + 2 workers) vs one numpy process.

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
import tempfile
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, mpips_rate, one_numpy_process, reference_data

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000, help="global steps of each mpips run")
    ap.add_argument("--optimizers", default="sgd", help="comma list: sgd, adam, adagrad, ...")
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    data = args.data
    x, y = reference_data(data)
    kinds = args.optimizers.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {}
        for kind in kinds:
            jobs[kind] = Path(tmp) / f"{kind}.toml"
            lr = 0.05 if kind in ("sgd", "momentum", "adagrad") else 0.001
            jobs[kind].write_text(JOB.format(data=data, steps=args.steps, kind=kind, lr=lr))
        single, multi = [], {k: [] for k in kinds}
        for r in range(args.rounds):
            single.append(one_numpy_process(x, y, args.steps // 2))
            line = f"round {r + 1}: single process (sgd) {single[-1]:8.0f} ex/s"
            for kind in kinds:
                multi[kind].append(mpips_rate(3, jobs[kind], Path(tmp)))
                line += f" | mpips {kind} {multi[kind][-1]:8.0f} ex/s"
            print(line, flush=True)
    print(f"\nsingle process (sgd), 1 BLAS thread : {min(single):.0f}-{max(single):.0f} examples/s")
    for kind in kinds:
        m = multi[kind]
        ratio = np.median(m) / np.median(single)
        print(
            f"mpips async {kind:<8} 1 ps + 2 workers : {min(m):.0f}-{max(m):.0f} examples/s, "
            f"{ratio:.2f}x the single process (SGD target >= 1.6x, linear limit 2x)"
        )


if __name__ == "__main__":
    main()

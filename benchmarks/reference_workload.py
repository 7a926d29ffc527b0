"""Examples/s of the reference workload (MLP 784-512-512-10 on synthetic N(0,1) data):
mpips async (1 PS + 2 workers) vs one numpy process.

Run:  python benchmarks/reference_workload.py [--rounds 3] [--steps 1000]

MLP 784-512-512-10, ReLU, softmax cross-entropy, float32, batch 128 per worker, SGD lr 0.05,
on the synthetic set (X ~ N(0,1), labels argmax(X @ W)). The single process runs the same
numpy model code with one BLAS thread, timed after 20 warm-up steps; the mpips rate is what its
chief reports (all workers' examples over the slowest worker's loop time, warm-up included;
the fused optimizer kernels are loaded at start-up, before the loop's clock starts, so the
loop is the steady state however short).
Rounds alternate between the configurations so all see the same machine load. Target: >= 1.6x.
``--optimizers sgd,adam`` adds mpips runs with Adam (lr 0.001, applied on the PS) to each round;
for every stateful optimizer, ``--numpy-rules`` adds a run with the fused kernels off
(MPIPS_FUSED_KERNELS=0: the numpy rules on the PS) and ``--split-ps`` a run on 2 PS tasks with
every variable of >= 256 KiB split over both (layout.partition_min_bytes = 262144), the same
2 workers (4 ranks). ``--zero-copy`` adds, for every optimizer, a run with ``train.zero_copy``
(the workers read the PS's memory in place and apply their own updates there; the other runs
set it false: the copied pulls). ``--workers N``: N workers instead of 2.
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
zero_copy = {zero_copy}
[layout]
ps = {ps}
partition_min_bytes = {split}
"""
SPLIT_BYTES = 262144


def configurations(kinds: list[str], numpy_rules: bool, split_ps: bool, zero_copy: bool):
    """(label, optimizer, PS tasks, partition_min_bytes, environment) of each mpips run
    (a label ending in "zero copy": with train.zero_copy)."""
    runs = [(kind, kind, 1, 0, {}) for kind in kinds]
    if zero_copy:
        runs += [(f"{kind} zero copy", kind, 1, 0, {}) for kind in kinds]
    for kind in kinds:
        if kind == "sgd":
            continue
        if numpy_rules:
            runs.append((f"{kind} (numpy rules)", kind, 1, 0, {"MPIPS_FUSED_KERNELS": "0"}))
        if split_ps:
            runs.append((f"{kind} (2 ps, split)", kind, 2, SPLIT_BYTES, {}))
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000, help="global steps of each mpips run")
    ap.add_argument("--optimizers", default="sgd", help="comma list: sgd, adam, adagrad, ...")
    ap.add_argument("--numpy-rules", action="store_true", help="also run with the kernels off")
    ap.add_argument("--split-ps", action="store_true", help="also run on 2 PS, variables split")
    ap.add_argument("--zero-copy", action="store_true", help="also run with train.zero_copy")
    ap.add_argument("--workers", type=int, default=2, help="workers of each mpips run")
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    data = args.data
    x, y = reference_data(data)
    kinds = args.optimizers.split(",")
    runs = configurations(kinds, args.numpy_rules, args.split_ps, args.zero_copy)
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {}
        for i, (label, kind, ps, split, _) in enumerate(runs):
            jobs[label] = Path(tmp) / f"job{i}.toml"
            lr = 0.05 if kind in ("sgd", "momentum", "adagrad") else 0.001
            zc = str(label.endswith("zero copy")).lower()
            text = JOB.format(
                data=data, steps=args.steps, kind=kind, lr=lr, ps=ps, split=split, zero_copy=zc
            )
            jobs[label].write_text(text)
        single, multi = [], {label: [] for label, *_ in runs}
        for r in range(args.rounds):
            single.append(one_numpy_process(x, y, args.steps // 2))
            line = f"round {r + 1}: single process (sgd) {single[-1]:8.0f} ex/s"
            for label, _, ps, _, env in runs:
                ranks = ps + args.workers
                multi[label].append(mpips_rate(ranks, jobs[label], Path(tmp), env))
                line += f" | {label} {multi[label][-1]:8.0f}"
            print(line, flush=True)
    print(f"\nsingle process (sgd), 1 BLAS thread : {min(single):.0f}-{max(single):.0f} examples/s")
    for label, _, ps, _, _ in runs:
        m = multi[label]
        ratio = np.median(m) / np.median(single)
        vs_sgd = (
            f", {np.median(m) / np.median(multi['sgd']):.2f}x mpips sgd" if "sgd" in multi else ""
        )
        print(
            f"mpips async {label:<20} {ps} ps + {args.workers} workers : "
            f"{min(m):.0f}-{max(m):.0f} "
            f"(median {np.median(m):.0f}) examples/s, {ratio:.2f}x the single process{vs_sgd}"
        )
    print("(SGD target >= 1.6x the single process, linear limit 2x; Adam target >= 0.85x SGD)")


if __name__ == "__main__":
    main()

"""Examples/s of the shipped CNN (jobs/cnn.py: conv 8 -> pool -> conv 16 -> pool -> dense 64,
mpips' layer library) in async mode, 1 PS + 2 workers, vs one process running the same
layers, measured in the same run.

Run:  python benchmarks/cnn_workload.py [--rounds 3] [--steps 600] [--data FILE]

Data: Fashion-MNIST (data/fashion_mnist.h5, made by `python -m mpips data fashion-mnist`) if
present, else the reference workload's synthetic 784-input set (the cost is the same). Batch
64 per worker, SGD lr 0.05. The single process runs the same Sequential code with one BLAS
thread, timed after 20 warm-up steps; the mpips rate is what its chief reports (all workers'
examples over the slowest worker's loop time, warm-up included). Rounds alternate.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, mpips_rate, one_process_rate, reference_data

from mpips.data.batches import load_split, open_dataset

ROOT = Path(__file__).resolve().parent.parent
JOB = """
[model]
kind = "cnn:build"
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
steps = {steps}
batch_size = 64
log_every = 0
progress = false
zero_copy = false  # the copied pulls its recorded figures used
[layout]
ps = 1
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600, help="global steps of each mpips run")
    ap.add_argument("--data", default=None)
    args = ap.parse_args()
    fashion = ROOT / "data/fashion_mnist.h5"
    data = args.data or (str(fashion) if fashion.exists() else DEFAULT_DATA)
    if data == DEFAULT_DATA:
        reference_data(data)
    info = open_dataset(data)
    x, y = load_split(info, "train")
    sys.path.insert(0, str(ROOT / "jobs"))
    import cnn

    single, mpips = [], []
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(ROOT / "jobs/cnn.py", tmp)
        job = Path(tmp) / "job.toml"
        job.write_text(JOB.format(data=Path(data).resolve(), steps=args.steps))
        for r in range(args.rounds):
            single.append(one_process_rate(cnn.build(info), x, y, 200, 64, 0.05))
            mpips.append(mpips_rate(3, job, Path(tmp)))
            print(
                f"round {r + 1}: one process {single[-1]:8.0f} | mpips async 1 ps + 2 workers "
                f"{mpips[-1]:8.0f} examples/s",
                flush=True,
            )
    print(f"\ndata: {data}")
    print(
        f"one process, same layers, 1 BLAS thread : {min(single):.0f}-{max(single):.0f} examples/s"
    )
    print(
        f"mpips async, 1 ps + 2 workers            : "
        f"{min(mpips):.0f}-{max(mpips):.0f} examples/s, "
        f"{np.median(mpips) / np.median(single):.2f}x the single process (linear limit 2x)"
    )


if __name__ == "__main__":
    main()

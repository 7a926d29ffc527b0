"""Examples/s of the reference workload with 2 synchronous replicas: mpips sync vs torch DDP
(gloo), vs the 2-worker linear limit (2 x one numpy process), measured in the same run.

Run:  python benchmarks/sync_vs_ddp.py [--rounds 3] [--steps 600]      (needs torch, run on
      the CPU: `pip install torch`, 2.13.0 and 2.15.0 measured; not a dependency of mpips)

MLP 784-512-512-10, ReLU, softmax cross-entropy, float32, batch 128 per replica, SGD lr 0.05,
synthetic N(0,1) data. Every process uses 1 thread. DDP runs 2 processes on 127.0.0.1 with
the gloo backend, timed after 20 warm-up steps. mpips runs `mpiexec -n 2 python -m mpips train`
in sync mode (no PS) and reports all examples over the slowest replica's loop time, warm-up
included. Target: mpips >= 1.5x DDP.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, mpips_rate, one_numpy_process, reference_data

JOB = """
[model]
hidden = [512, 512]
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
mode = "sync"
steps = {steps}
batch_size = 128
log_every = 0
progress = false
check_every = 0
"""

DDP = r"""
import os, sys, time
import numpy as np, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
rank, steps, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
dist.init_process_group("gloo", rank=rank, world_size=2)
from mpips.data.batches import load_split, open_dataset
x, y = load_split(open_dataset(path), "train")
x, y = torch.from_numpy(x), torch.from_numpy(y)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(rank)
for i in range(20 + steps):
    if i == 20:
        dist.barrier(); t0 = time.perf_counter()
    idx = torch.randint(0, len(y), (128,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
    opt.step()
dt = torch.tensor([time.perf_counter() - t0])
dist.all_reduce(dt, op=dist.ReduceOp.MAX)
if rank == 0:
    print(f"ddp_examples_per_s {2 * 128 * steps / dt.item():.0f}")
dist.destroy_process_group()
"""


def ddp(data: Path, steps: int, port: int, workdir: Path) -> float:
    script = workdir / "ddp.py"
    script.write_text(DDP)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent)
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(steps), str(data), str(port)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    out = [p.communicate(timeout=600)[0] for p in procs]
    return float(re.search(r"ddp_examples_per_s (\d+)", out[0]).group(1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600, help="aggregated steps per run")
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    data = args.data
    x, y = reference_data(data)
    single, torch_ddp, sync = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "sync.toml"
        job.write_text(JOB.format(data=data, steps=args.steps))
        for r in range(args.rounds):
            single.append(one_numpy_process(x, y, args.steps))
            torch_ddp.append(ddp(data, args.steps, 29500 + r, Path(tmp)))
            sync.append(mpips_rate(2, job, Path(tmp)))
            print(
                f"round {r + 1}: 2 x one numpy process {2 * single[-1]:8.0f} | torch DDP "
                f"gloo {torch_ddp[-1]:8.0f} | mpips sync {sync[-1]:8.0f} examples/s",
                flush=True,
            )
    limit, d, s = 2 * np.median(single), np.median(torch_ddp), np.median(sync)
    print(f"\nlinear limit (2 x one numpy process) : {2 * min(single):.0f}-{2 * max(single):.0f}")
    print(f"torch DDP, gloo, 2 processes         : {min(torch_ddp):.0f}-{max(torch_ddp):.0f}")
    print(f"mpips sync, 2 replicas               : {min(sync):.0f}-{max(sync):.0f}")
    print(f"mpips / DDP {s / d:.2f}x (target >= 1.5x); mpips / linear limit {s / limit:.2f}")


if __name__ == "__main__":
    main()

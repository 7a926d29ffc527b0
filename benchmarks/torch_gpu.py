"""Examples/s of one mpips process training a torch.nn.Module on a GPU (``train.device =
"gpu"``: the module's tensors are DLPack views of mpips's cupy arrays) against plain PyTorch
on the same GPU, same model, batch and optimizer, measured in the same run.

Run on a GPU node with torch (a CUDA build) and cupy:
    python benchmarks/torch_gpu.py [--rounds 3] [--steps 2000] [--batch 128]

The reference MLP 784-512-512-10 (ReLU, cross-entropy, float32) on the synthetic reference
set, SGD lr 0.05. PyTorch: the data on the GPU, random batches gathered there,
``torch.optim.SGD``, timed after 50 warm-up steps with a device synchronise at both ends.
mpips: ``mpiexec -n 1 python -m mpips train`` (one process: a single synchronous replica,
its data on the device), the examples/s its chief reports. Target: mpips >= 0.8x PyTorch.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, mpips_rate, reference_data
from torch_frontend import MODULE

JOB = """
[model]
kind = "reference_module:build"
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
device = "gpu"
steps = {steps}
batch_size = {batch}
log_every = 0
progress = false
"""


def plain_pytorch(x: np.ndarray, y: np.ndarray, steps: int, batch: int) -> float:
    """Examples/s of the module with torch.optim.SGD on the GPU, its data there."""
    import torch

    scope: dict = {}
    exec(MODULE, scope)  # (the module mpips trains below)
    module = scope["reference_mlp"]().cuda()
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    for i in range(50 + steps):
        if i == 50:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        idx = torch.randint(0, len(yt), (batch,), generator=g, device="cuda")
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(xt[idx]), yt[idx]).backward()
        opt.step()
    torch.cuda.synchronize()
    return steps * batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    x, y = reference_data(args.data)
    torch_rates, mpips_rates = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "reference_module.py").write_text(MODULE)
        job = work / "gpu.toml"
        job.write_text(JOB.format(data=args.data, steps=args.steps, batch=args.batch))
        for r in range(args.rounds):
            torch_rates.append(plain_pytorch(x, y, args.steps, args.batch))
            mpips_rates.append(mpips_rate(1, job, work))  # (one rank: one process)
            print(
                f"round {r + 1}: PyTorch {torch_rates[-1]:9.0f} | mpips {mpips_rates[-1]:9.0f} "
                f"examples/s",
                flush=True,
            )
    t, m = float(np.median(torch_rates)), float(np.median(mpips_rates))
    print(f"plain PyTorch on the GPU : {min(torch_rates):.0f}-{max(torch_rates):.0f}")
    print(f"mpips, one process       : {min(mpips_rates):.0f}-{max(mpips_rates):.0f}")
    print(f"mpips / PyTorch {m / t:.2f}x (target >= 0.8x)")


if __name__ == "__main__":
    main()

"""Examples/s of the reference MLP written as a torch.nn.Module and trained by mpips
(``mpips.torch``), against one PyTorch process, PyTorch DDP and mpips's own numpy MLP,
measured in the same run.

Run:  python benchmarks/torch_frontend.py [--rounds 3] [--steps 1000]     (needs torch)

MLP 784-512-512-10, ReLU, softmax cross-entropy, float32, batch 128 per worker, SGD lr 0.05,
on the synthetic reference set (60000 x 784, N(0,1)). Every process uses 1 thread.

* one PyTorch process: the module, ``torch.optim.SGD``, random batches, timed after 20
  warm-up steps;
* PyTorch DDP: 2 processes, gloo on 127.0.0.1, the same loop (benchmarks/sync_vs_ddp.py);
* mpips async, 1 PS + 2 workers (``mpiexec -n 3 python -m mpips train``), the module through
  ``mpips.torch.Model``, and the same job with mpips's numpy MLP (``model.hidden``): what the
  chief reports (all workers' examples over the slowest worker's loop time, warm-up
  included).

``--jax`` adds mpips with the same MLP written in JAX (jobs/jax_mlp.py: it copies the
parameters in and the gradients out each step, and XLA keeps its own threads: each rank is
given one through XLA_FLAGS). Rounds alternate the runs so that all see the same machine
load. Targets (on 2 cores): the
module on mpips >= 1.9x one PyTorch process and >= 2x DDP; >= 0.9x mpips's numpy MLP (the
frontend's cost).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, mpips_rate, reference_data
from sync_vs_ddp import ddp

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
name = "torch-frontend-{which}"
[model]
{model}
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
steps = {steps}
batch_size = 128
log_every = 0
progress = false
"""
MODELS = {"torch": 'kind = "reference_module:build"', "numpy": "hidden = [512, 512]"}
JAX = 'kind = "jax_mlp:build"'
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
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
        idx = torch.randint(0, len(yt), (128,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(module(xt[idx]), yt[idx]).backward()
        opt.step()
    return steps * 128 / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000, help="global steps of each mpips run")
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--jax", action="store_true", help="also the MLP in JAX on mpips")
    args = ap.parse_args()
    x, y = reference_data(args.data)
    models = {**MODELS, **({"jax": JAX} if args.jax else {})}
    runs: dict[str, list[float]] = {k: [] for k in ("torch", "ddp", "mpips torch", "mpips numpy")}
    runs.update({"mpips jax": []} if args.jax else {})
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "reference_module.py").write_text(MODULE)
        shutil.copy(Path(__file__).resolve().parent.parent / "jobs/jax_mlp.py", work)
        jobs = {}
        for which, model in models.items():
            jobs[which] = work / f"{which}.toml"
            text = JOB.format(which=which, model=model, data=args.data, steps=args.steps)
            jobs[which].write_text(text)
        for r in range(args.rounds):
            runs["torch"].append(one_torch_process(x, y, args.steps // 2))
            runs["ddp"].append(ddp(Path(args.data), args.steps // 2, 29600 + r, work))
            for which in models:
                env = XLA_ONE_THREAD if which == "jax" else ONE_THREAD
                runs[f"mpips {which}"].append(mpips_rate(3, jobs[which], work, env))
            print(
                f"round {r + 1}: " + " | ".join(f"{k} {v[-1]:8.0f}" for k, v in runs.items()),
                flush=True,
            )
    med = {k: float(np.median(v)) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k:<12} {min(v):8.0f}-{max(v):8.0f} (median {med[k]:.0f}) examples/s")
    m = med["mpips torch"]
    print(
        f"mpips async with the module (1 ps + 2 workers): {m / med['torch']:.2f}x one PyTorch "
        f"process (target >= 1.9x), {m / med['ddp']:.2f}x DDP (target >= 2x), "
        f"{m / med['mpips numpy']:.2f}x mpips's numpy MLP (target >= 0.9x)"
    )


if __name__ == "__main__":
    main()

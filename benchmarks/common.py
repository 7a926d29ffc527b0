"""Pieces the benchmarks share: the reference data, the one-process numpy baseline, and a
timed mpips run (examples/s as the chief reports it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from mpips.data.batches import load_split, open_dataset
from mpips.data.convert import make_synthetic
from mpips.models.mlp import MLP
from mpips.optim import Optimizer, fused_kernel, kernel_name

DEFAULT_DATA = str(Path(tempfile.gettempdir()) / "mpips-bench/synthetic.h5")


def reference_data(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The reference workload's synthetic train split, made once (60000 x 784, N(0,1))."""
    if not Path(path).exists():
        print(f"making {path} ...", flush=True)
        make_synthetic(path)
    return load_split(open_dataset(path), "train")


def one_numpy_process(x: np.ndarray, y: np.ndarray, steps: int) -> float:
    """Examples/s of the reference MLP with SGD in this process (see one_process_rate)."""
    return one_process_rate(MLP([784, 512, 512, 10]), x, y, steps, 128, 0.05)


def one_process_rate(
    model,
    x: np.ndarray,
    y: np.ndarray,
    steps: int,
    batch: int,
    lr: float,
    optimizer: Optimizer | None = None,
) -> float:
    """Examples/s of ``model`` with ``optimizer`` (SGD if None) in this process, 1 BLAS
    thread, after 20 warm-up steps: the same numpy model code and optimizer (its fused
    kernel) mpips runs, without any MPI."""
    sgd = optimizer or Optimizer("sgd")
    name = kernel_name(sgd.kind, sgd.hyper)
    if name:  # compiled (or loaded) before the clock starts, as a long run has it
        fused_kernel(name)
    params = model.initial_values(0)
    slots = {k: sgd.init_slots(v) for k, v in params.items()}
    grads = {k: np.empty_like(v) for k, v in params.items()}
    rng = np.random.default_rng(0)
    with threadpool_limits(limits=1):
        for i in range(20 + steps):
            if i == 20:
                t0 = time.perf_counter()
            idx = rng.integers(0, len(y), batch)
            model.loss_and_grads(params, x[idx], y[idx], grads)
            for k in params:
                sgd.apply(params[k], grads[k], slots[k], lr, i + 1)
    return steps * batch / (time.perf_counter() - t0)


def mpiexec() -> str:
    """The launcher of this Python's MPI (the venv's wheel), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def mpips_rate(ranks: int, job: Path, workdir: Path, env: dict[str, str] | None = None) -> float:
    """Run `mpiexec -n RANKS python -m mpips train JOB`; the examples/s its chief reports.
    ``env``: variables to set for the run (e.g. MPIPS_FUSED_KERNELS=0)."""
    r = subprocess.run(
        [
            mpiexec(),
            "-n",
            str(ranks),
            sys.executable,
            "-m",
            "mpips",
            "train",
            str(job),
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, **(env or {})),
    )
    m = re.search(r"([0-9]+) examples/s\)", r.stdout)
    if r.returncode or not m:
        raise SystemExit(f"mpips run failed:\n{r.stdout}\n{r.stderr}")
    return float(m.group(1))

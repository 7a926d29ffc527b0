"""DLRM from PyTorch (jobs/torch_dlrm.py) trained by mpips in hybrid mode, 1 PS + 2 workers
(or ``--ps``, ``--workers``), against one plain PyTorch process of the same module on the same
data: examples/s, and the test AUC of both at the same number of examples.

Run:  python benchmarks/dlrm.py [--rows 200000] [--max-cardinality 10000] [--steps 200,1000]
          [--rounds 2] [--fused] [--ps 1] [--workers 2]       (needs torch)

Data: ``python -m mpips data criteo-synthetic`` (``--rows`` train rows, cardinalities capped
at ``--max-cardinality``), made once in a temporary folder. Model: the shipped job's
(jobs/torch_dlrm.toml: 16-wide embeddings, bottom 13-64-32-16, top 367-64-32-1), SGD at its
learning rate, batch 128 per worker. Every process uses 1 thread (OMP_NUM_THREADS=1).

* mpips: ``mpiexec -n 3 python -m mpips train --ps 1`` in hybrid mode (a global step is
  every worker's batch: 256 examples with 2 workers), measured from outside as
  benchmarks/torch_frontend.py does: each round runs the job to two global-step targets
  (``--steps``), and the rate is the extra examples over the extra wall seconds (start-up,
  imports, data loading, the final evaluation and checkpoint cancel out). The AUC is the
  longer run's test AUC.
* one PyTorch process: the module with ``torch.optim.SGD`` (it takes the tables' sparse
  gradients) on 128-row batches of the same train rows in a seeded order, the whole tables
  in its memory and the ids as they are; timed after 20 warm-up steps, for as many examples
  as the longer mpips run (workers x 128 x the longer target), then its test AUC.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
from common import mpiexec

ROOT = Path(__file__).resolve().parent.parent
BATCH = 128
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def write_job(work: Path, data: Path, fused: bool) -> Path:
    """The shipped job on ``data``, its module beside it."""
    (work / "torch_dlrm.py").write_text((ROOT / "jobs/torch_dlrm.py").read_text())
    job = (ROOT / "jobs/torch_dlrm.toml").read_text()
    job = job.replace('path = "data/criteo_synthetic.h5"', f'path = "{data}"')
    job = job.replace("epochs = 1\n", "epochs = 1000\n").replace("log_every = 100", "log_every = 0")
    job = job.replace("fused = false", f"fused = {str(fused).lower()}")
    (work / "dlrm.toml").write_text(job)
    return work / "dlrm.toml"


def mpips_run(job: Path, steps: int, ps: int, workers: int) -> tuple[float, dict]:
    """Wall seconds of ``mpiexec -n PS+WORKERS python -m mpips train JOB --ps PS --steps
    STEPS``, its result."""
    result = job.parent / "result.json"
    argv = [mpiexec(), "-n", str(ps + workers), sys.executable, "-m", "mpips", "train", str(job)]
    argv += ["--ps", str(ps), "--steps", str(steps), "--no-restore", "--no-progress"]
    argv += ["--result", str(result)]
    shutil.rmtree(job.parent / "runs", ignore_errors=True)  # (each run starts afresh)
    argv += ["--ckpt-dir", str(job.parent / "runs")]
    t0 = time.perf_counter()
    r = subprocess.run(
        argv, cwd=job.parent, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True
    )
    seconds = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"mpips run failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return seconds, json.loads(result.read_text())


def _module(data_info, job: dict):
    """The job's module, built as the job builds it (its model.args, seeded)."""
    import torch

    spec = importlib.util.spec_from_file_location("torch_dlrm", ROOT / "jobs/torch_dlrm.py")
    dlrm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dlrm)
    torch.manual_seed(0)
    return dlrm, dlrm.build(data_info, **job["model"]["args"]).module


def _batch(dlrm, net, x, rows):
    """CSR rows as the module's SparseInput, each categorical id as its table's row (as the
    reference code feeds it: the whole tables are here)."""
    import torch

    from mpips.torch import SparseInput

    t = lambda a, d: torch.from_numpy(np.ascontiguousarray(a, d))  # noqa: E731
    batch = SparseInput(
        t(x.indices, np.int64), t(x.indptr[:-1], np.int64), t(x.data, np.float32), rows
    )
    return dlrm.plain_batch(batch, net.sizes, net.fused)


def one_torch_process(data: Path, examples: int, job: dict) -> dict:
    """Examples/s and test AUC of the module with torch.optim.SGD in this process."""
    import torch

    from mpips.data.batches import load_split, open_dataset
    from mpips.torch import binary_auc

    torch.set_num_threads(1)
    info = open_dataset(str(data))
    (x, y), (tx, ty) = load_split(info, "train"), load_split(info, "test")
    dlrm, net = _module(info, job)
    opt = torch.optim.SGD(net.parameters(), lr=job["optimizer"]["learning_rate"])
    order = np.random.default_rng(0).permutation(len(y))
    steps = examples // BATCH
    for i in range(steps):
        if i == 20:
            t0 = time.perf_counter()
        k = order[(i * BATCH + np.arange(BATCH)) % len(y)]
        opt.zero_grad()
        dlrm.loss(net(_batch(dlrm, net, x[k], BATCH)), torch.from_numpy(y[k])).backward()
        opt.step()
    rate = (steps - 20) * BATCH / (time.perf_counter() - t0)
    net.eval()
    with torch.no_grad():
        auc = binary_auc(net(_batch(dlrm, net, tx, len(ty))), torch.from_numpy(ty))
    return {"examples/s": rate, "auc": auc, "examples": steps * BATCH}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--max-cardinality", type=int, default=10_000)
    p.add_argument("--steps", default="200,1000", help="two global-step targets, short,long")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fused", action="store_true", help="one table for the 26 (model.args.fused)")
    p.add_argument("--ps", type=int, default=1, help="PS tasks")
    p.add_argument("--workers", type=int, default=2, help="workers (synchronous replicas)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mpips-dlrm-"))
    try:
        measure(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(work: Path, args: argparse.Namespace) -> None:
    """Make the data in ``work``, then each round: mpips at both targets, one process."""
    short, long = (int(s) for s in args.steps.split(","))
    data = work / "criteo_synthetic.h5"
    from mpips.data.criteo_synthetic import make_criteo_synthetic

    make_criteo_synthetic(data, rows=args.rows, max_cardinality=args.max_cardinality)
    job = write_job(work, data, args.fused)
    spec = tomllib.loads(job.read_text())
    print(
        f"data: {args.rows} rows, cardinalities capped at {args.max_cardinality}; "
        f"steps {short},{long}"
    )
    for r in range(args.rounds):
        ps, workers = args.ps, args.workers
        (w0, _), (w1, res) = mpips_run(job, short, ps, workers), mpips_run(job, long, ps, workers)
        rate = (long - short) * workers * BATCH / (w1 - w0)
        plain = one_torch_process(data, long * workers * BATCH, spec)
        print(
            f"round {r}: mpips hybrid {ps} PS + {workers} workers {rate:.0f} examples/s, AUC "
            f"{res['test_auc']:.4f} at {res['total_examples']} examples | one PyTorch process "
            f"{plain['examples/s']:.0f} examples/s, AUC {plain['auc']:.4f} at "
            f"{plain['examples']} examples | ratio {rate / plain['examples/s']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Wide & deep on the clothing reviews (jobs/ctr_wide_deep.toml): train.mode = "hybrid" vs
"async", same job, same ranks, rounds interleaved; examples/s and test AUC of each run.

Run:  python benchmarks/hybrid_workload.py [--ranks 4] [--ps 2] [--rounds 3]
      [--data data/clothing_reviews.h5]   (made with `python -m mpips data clothing-reviews`
      if it is missing)

"sync" (allreduce only) cannot run this model: its tables live on the PS tasks, which
sync mode does not have. examples/s is what the chief reports (all workers' examples over
the slowest worker's loop time).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import mpiexec

ROOT = Path(__file__).resolve().parent.parent


def run(ranks: int, ps: int, job: Path, workdir: Path) -> tuple[float, dict]:
    """One training run: the examples/s its chief reports, and its --result."""
    out = workdir / "result.json"
    out.unlink(missing_ok=True)
    cmd = [mpiexec(), "-n", str(ranks), sys.executable]
    cmd += ["-m", "mpips", "train", str(job), "--ps", str(ps), "--no-progress"]
    r = subprocess.run(
        cmd + ["--result", str(out)], cwd=workdir, capture_output=True, text=True, timeout=900
    )
    if r.returncode or not out.exists():
        raise SystemExit(f"mpips run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    rate = re.search(r"([0-9]+) examples/s\)", r.stdout)
    assert rate, r.stdout[-2000:]
    return float(rate.group(1)), json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "mpips-bench/clothing.h5"))
    args = ap.parse_args()
    if not Path(args.data).exists():
        Path(args.data).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "mpips", "data", "clothing-reviews", args.data], check=True
        )
    text = (ROOT / "jobs/ctr_wide_deep.toml").read_text()
    text = text.replace("data/clothing_reviews.h5", str(Path(args.data).resolve()))
    text = text.replace('dir = "runs/ctr_wide_deep"', 'dir = ""').replace("log_every = 100", "")
    results: dict[str, list[tuple[float, dict]]] = {"async": [], "hybrid": []}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for mode in results:
            extra = "\nzero_copy = false" if mode == "async" else ""  # (as recorded: copied)
            (d / f"{mode}.toml").write_text(
                text.replace("[train]", f'[train]\nmode = "{mode}"{extra}')
            )
        for _ in range(args.rounds):
            for mode in results:
                results[mode].append(run(args.ranks, args.ps, d / f"{mode}.toml", d))
    workers = args.ranks - args.ps
    print(
        f"# hybrid_workload | wide & deep, FTRL, batch 64, 5 epochs, "
        f"{args.ps} ps + {workers} workers"
    )
    for mode, rs in results.items():
        rates = [rate for rate, _ in rs]
        aucs = [r["test_metrics"]["auc"] for _, r in rs]
        print(
            f"{mode:<7} examples/s median {np.median(rates):>8.0f} "
            f"({', '.join(f'{x:.0f}' for x in rates)}); test AUC "
            f"{', '.join(f'{a:.4f}' for a in aucs)}; global_step {rs[0][1]['global_step']}"
        )


if __name__ == "__main__":
    main()

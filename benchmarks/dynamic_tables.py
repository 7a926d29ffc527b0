"""A CTR job with fixed tables, with dynamic tables, and with dynamic tables and each
worker's cache of hot rows: examples/s of the same job (wide & deep, Adagrad, async, 1 PS
+ 2 workers) on Zipf data, the cache's hit rate, and the PS task's rows.

Run:  python benchmarks/dynamic_tables.py [--rows 100000] [--cache 4096]

The data: `python -m mpips data zipf` (Zipf(1.2) ids over 1M features, 32 a row, labels
from a planted logistic model). The fixed tables have a row per feature (1M); the dynamic
ones make a row per id pulled. The same seeds and steps in each run; each run's
examples/s is its chief's (the workers' examples over the run's training time); the
three runs are repeated --rounds times, interleaved (on a shared machine, compare rounds).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from common import mpiexec

JOB = """
[model]
kind = "wide_deep"
hidden = [16]
embedding_dim = 16
[data]
path = "{data}"
[optimizer]
kind = "adagrad"
learning_rate = 0.05
[train]
steps = {steps}
batch_size = 256
log_every = 0
progress = false
zero_copy = false
{tables}
"""


def run(workdir: Path, name: str, tables: str, data: Path, steps: int) -> dict[str, str]:
    job = workdir / f"{name}.toml"
    job.write_text(JOB.format(data=data, steps=steps, tables=tables))
    r = subprocess.run(
        [mpiexec(), "-n", "3", sys.executable, "-m", "mpips", "train", str(job)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rate = re.search(r"([0-9]+) examples/s\)", r.stdout)
    if r.returncode or not rate:
        raise SystemExit(f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    auc = re.search(r"test_auc ([0-9.]+)", r.stdout)
    hits = re.findall(r"row cache: ([0-9.]+)%", r.stdout)
    live = re.findall(r"dynamic tables \(.*\): ([0-9]+) rows live", r.stdout)
    return {
        "examples/s": rate.group(1),
        "test_auc": auc.group(1) if auc else "?",
        "cache hits": "/".join(f"{h}%" for h in hits) or "-",
        "ids with rows": live[0] if live else "1000000 (fixed)",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--cache", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3, help="runs of each, interleaved")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        data = d / "zipf.h5"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "mpips",
                "data",
                "zipf",
                str(data),
                "--rows",
                str(args.rows),
                "--features",
                "1000000",
            ],
            check=True,
            capture_output=True,
        )
        dynamic = '[tables]\nkind = "dynamic"\n'
        runs = {
            "fixed": "",
            "dynamic": dynamic,
            f"dynamic, cache {args.cache}": dynamic
            + f"cache_rows = {args.cache}\ncache_steps = 10\n",
        }
        print(f"wide & deep, Adagrad, async, 1 PS + 2 workers, {args.steps} steps of 256")
        for r in range(args.rounds):
            for name, tables in runs.items():
                got = run(d, name.split(",")[0], tables, data, args.steps)
                print(f"round {r + 1} {name:24s} " + "  ".join(f"{k} {v}" for k, v in got.items()))


if __name__ == "__main__":
    main()

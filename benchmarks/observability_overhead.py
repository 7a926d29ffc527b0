"""What summaries and the timeline cost: the reference workload's steady training rate with
summaries off, on (the default, a record every 20 updates, TensorBoard and metrics.jsonl),
and on with the timeline, measured from outside with the wall clock.

Run:  python benchmarks/observability_overhead.py [--rounds 3] [--short 300] [--long 1500]

MLP 784-512-512-10, batch 128, SGD, 1 PS + 2 async workers (`mpiexec -n 3`). Each
configuration runs twice, for --short and --long global steps (no checkpoints, everything
else equal); the extra examples divided by the extra wall seconds is its steady rate, so
start-up, imports, data loading and the final evaluation cancel out. Rounds interleave the
configurations so they see the same machine load; the table gives medians and ranges.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import DEFAULT_DATA, mpiexec, reference_data

JOB = """
[model]
hidden = [512, 512]
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
steps = {steps}
batch_size = 128
log_every = 0
progress = false
zero_copy = false  # the copied pulls its recorded figures used
[summary]
dir = "{summaries}"
every_steps = {every}
timeline = {timeline}
[layout]
ps = 1
"""
CONFIGS = {"off": (0, "false"), "summaries": (20, "false"), "summaries+timeline": (20, "true")}


def wall_seconds(work: Path, data: str, steps: int, every: int, timeline: str) -> float:
    """Wall time of one whole `mpiexec -n 3 python -m mpips train` run."""
    summaries = work / f"s-{time.monotonic_ns()}"
    job = work / "job.toml"
    job.write_text(
        JOB.format(data=data, steps=steps, summaries=summaries, every=every, timeline=timeline)
    )
    t0 = time.perf_counter()
    r = subprocess.run(
        [
            mpiexec(),
            "-n",
            "3",
            sys.executable,
            "-m",
            "mpips",
            "train",
            str(job),
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"mpips run failed:\n{r.stdout}\n{r.stderr}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--short", type=int, default=300)
    ap.add_argument("--long", type=int, default=1500)
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    reference_data(args.data)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, (every, timeline) in CONFIGS.items():
                short = wall_seconds(Path(tmp), args.data, args.short, every, timeline)
                long = wall_seconds(Path(tmp), args.data, args.long, every, timeline)
                rates[name].append((args.long - args.short) * 128 / (long - short))
                print(f"round {r + 1} {name:<20} {rates[name][-1]:>9.0f} examples/s", flush=True)
    base = statistics.median(rates["off"])
    print(f"\n{'configuration':<20} {'median':>9} {'range':>19} {'vs off':>7}")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:<20} {med:>9.0f} {min(values):>9.0f}-{max(values):<9.0f} {med / base:>6.2f}x")


if __name__ == "__main__":
    main()

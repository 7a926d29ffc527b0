"""One straggler: allreduce sync mode vs sync_replicas through the PS, with and without a
backup worker.

Run:  python benchmarks/sync_replicas_straggler.py [--rounds 3] [--steps 300] [--delay-ms 20]

The reference MLP (784-512-512-10, batch 128, SGD) on 4 ranks, 3 workers each time (sync:
3 allreduce replicas and an idle PS rank; sync_replicas: 1 PS + 3 workers). Worker task 2
is made a straggler: its loss_and_grads sleeps --delay-ms first. Rates are global steps per
second of the chief's training loop; the limit is the same configuration with no straggler,
measured in the same round. Rounds interleave the configurations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import DEFAULT_DATA, mpiexec, reference_data

SCRIPT = """
import json, sys, time
import mpips
from mpips.models.mlp import MLP

DELAY = {delay}

class Straggler(MLP):
    def loss_and_grads(self, *args, **kwargs):
        if self.worker == 2 and DELAY:
            time.sleep(DELAY)
        return super().loss_and_grads(*args, **kwargs)

job = mpips.parse_job('''
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
mode = "{mode}"
{aggregate}
steps = {steps}
batch_size = 128
log_every = 0
progress = false
[layout]
ps = 1
''')
with mpips.abort_on_error():
    result = mpips.train(job, model=lambda d: Straggler([d.num_inputs, 512, 512, d.num_classes]))
    if result.role.is_chief:
        json.dump({{"steps": result.global_step - result.start_step,
                   "seconds": result.seconds}}, open(sys.argv[1], "w"))
"""
CONFIGS = {
    "sync (allreduce, 3 replicas)": ("sync", ""),
    "sync_replicas, aggregate 3 of 3": ("sync_replicas", "replicas_to_aggregate = 3"),
    "sync_replicas, aggregate 2 of 3": ("sync_replicas", "replicas_to_aggregate = 2"),
}


def steps_per_second(
    work: Path, data: str, mode: str, aggregate: str, steps: int, delay: float
) -> float:
    script, out = work / "run.py", work / "result.json"
    script.write_text(
        SCRIPT.format(delay=delay, data=data, mode=mode, aggregate=aggregate, steps=steps)
    )
    r = subprocess.run(
        [
            mpiexec(),
            "-n",
            "4",
            sys.executable,
            str(script),
            str(out),
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if r.returncode:
        raise SystemExit(f"run failed:\n{r.stdout}\n{r.stderr}")
    result = json.loads(out.read_text())
    return result["steps"] / result["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--delay-ms", type=float, default=20.0)
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    reference_data(args.data)
    rates: dict[str, dict[str, list[float]]] = {c: {"none": [], "straggler": []} for c in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, (mode, aggregate) in CONFIGS.items():
                for case, delay in (("none", 0.0), ("straggler", args.delay_ms / 1e3)):
                    rate = steps_per_second(
                        Path(tmp), args.data, mode, aggregate, args.steps, delay
                    )
                    rates[name][case].append(rate)
                    print(f"round {r + 1} {name:<34} {case:<9} {rate:8.1f} steps/s", flush=True)
    print(
        f"\nworker task 2 sleeps {args.delay_ms:.0f} ms a step; medians (ranges) of "
        f"{args.rounds} rounds, global steps/s"
    )
    print(f"{'configuration':<34} {'no straggler':>22} {'one straggler':>22} {'ratio':>6}")
    for name, cases in rates.items():
        a, b = (statistics.median(cases[c]) for c in ("none", "straggler"))
        ra = f"{a:.1f} ({min(cases['none']):.1f}-{max(cases['none']):.1f})"
        rb = f"{b:.1f} ({min(cases['straggler']):.1f}-{max(cases['straggler']):.1f})"
        print(f"{name:<34} {ra:>22} {rb:>22} {b / a:>5.2f}x")


if __name__ == "__main__":
    main()

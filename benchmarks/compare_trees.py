"""The reference workload from two checkouts of mpips, alternated in one run: a refactor's
"no regression beyond noise", measured. The baseline is the other tree, run on the same
machine in the same rounds.

Run:  python benchmarks/compare_trees.py BEFORE_TREE [--after TREE] [--rounds 5] [--steps 1000]

(``git worktree add /tmp/before <commit>`` makes a BEFORE_TREE.) Each round runs, for each
tree in turn, the reference workload's MLP 784-512-512-10 (batch 128 per worker, SGD lr
0.05, synthetic data) in async mode on 1 PS + 2 workers and in sync mode on 2 replicas; the
tree is chosen by PYTHONPATH. Reported per configuration and tree: the median of the
examples/s the chief reports and of the wall time of the whole job from outside (start-up
included), and after / before.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import DEFAULT_DATA, mpips_rate, reference_data

JOB = """
[model]
hidden = [512, 512]
[data]
path = "{data}"
[optimizer]
learning_rate = 0.05
[train]
mode = "{mode}"
steps = {steps}
batch_size = 128
log_every = 0
progress = false
zero_copy = false  # the copied pulls its recorded figures used
[checkpoint]
every_secs = 0
"""
CONFIGURATIONS = (("async 1 PS + 2 workers", "async", 3), ("sync 2 replicas", "sync", 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", help="the baseline tree (a checkout holding mpips/)")
    ap.add_argument("--after", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--data", default=DEFAULT_DATA)
    args = ap.parse_args()
    reference_data(args.data)
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    for name, tree in trees.items():
        if not (tree / "mpips/__init__.py").is_file():
            raise SystemExit(f"{name}: {tree} holds no mpips/")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label, mode, ranks in CONFIGURATIONS:
                job = Path(tmp) / f"{mode}.toml"
                job.write_text(JOB.format(data=args.data, mode=mode, steps=args.steps))
                for name, tree in trees.items():
                    work = Path(tmp) / f"{name}-{mode}-{r}"
                    work.mkdir()
                    start = time.perf_counter()
                    rate = mpips_rate(ranks, job, work, {"PYTHONPATH": str(tree)})
                    results.setdefault((label, name), []).append(
                        (rate, time.perf_counter() - start)
                    )
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\nbefore: {trees['before']}\nafter:  {trees['after']}")
    print(f"{'configuration':<24} {'tree':<7} {'examples/s':>11} {'wall s':>7}  (medians)")
    for label, _, _ in CONFIGURATIONS:
        medians = {}
        for name in trees:
            rates, walls = zip(*results[(label, name)], strict=True)
            medians[name] = statistics.median(rates)
            print(f"{label:<24} {name:<7} {medians[name]:>11.0f} {statistics.median(walls):>7.2f}")
        print(f"{label:<24} after / before: {medians['after'] / medians['before']:.3f}")


if __name__ == "__main__":
    main()

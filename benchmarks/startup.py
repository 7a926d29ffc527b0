"""Start-up: the wall time of a small job launched with mpiexec, against the launch of the
same number of Python processes that only initialise MPI (the limit: launcher, interpreter
and MPI_Init, nothing of mpips), and that import mpips' training code besides.

Run:  python benchmarks/startup.py [--ranks 3] [--rounds 5] [--tree DIR ...]
      (--tree: also time another checkout of mpips, e.g. a git worktree of an older
      commit, by putting it first on PYTHONPATH; the same Python and MPI)

Each round runs every command once, one after the other, so all see the same machine; the
medians of the rounds are printed. The job: the built-in digits data, 20 global steps,
1 PS + 2 workers (async, the default layout) and sync, no checkpoint; its time includes
the final evaluation and the exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import mpiexec

ROOT = Path(__file__).resolve().parent.parent
JOB = """
[data]
builtin = "digits"
[train]
mode = "{mode}"
steps = 20
progress = false
[checkpoint]
dir = ""
"""


def seconds(cmd: list[str], cwd: Path, tree: Path) -> float:
    """Wall seconds of ``cmd`` with ``tree`` first on PYTHONPATH (it must succeed)."""
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tree", action="append", default=[], help="another checkout to time")
    args = ap.parse_args()
    launch = [mpiexec(), "-n", str(args.ranks), sys.executable]
    trees = [ROOT, *(Path(t).resolve() for t in args.tree)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for mode in ("async", "sync"):
            (work / f"{mode}.toml").write_text(JOB.format(mode=mode))
        cases: dict[str, tuple[list[str], Path]] = {
            "MPI_Init only (the limit)": ([*launch, "-c", "from mpi4py import MPI"], ROOT)
        }
        for tree in trees:
            label = "this tree" if tree == ROOT else str(tree)
            cases[f"{label}: import mpips.training"] = (
                [*launch, "-c", "from mpi4py import MPI; import mpips.training"],
                tree,
            )
            for mode in ("async", "sync"):
                cases[f"{label}: {mode} job, 20 steps"] = (
                    [*launch, "-m", "mpips", "train", f"{mode}.toml"],
                    tree,
                )
        times: dict[str, list[float]] = {name: [] for name in cases}
        for r in range(args.rounds):
            for name, (cmd, tree) in cases.items():
                times[name].append(seconds(cmd, work, tree))
            print(f"round {r + 1} done", flush=True)
    limit = statistics.median(times["MPI_Init only (the limit)"])
    print(f"\n{args.ranks} ranks, median of {args.rounds} rounds, wall seconds")
    print(f"{'command':70s} {'seconds':>8s} {'over the limit':>15s}")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:70s} {med:8.2f} {med - limit:15.2f}")


if __name__ == "__main__":
    main()

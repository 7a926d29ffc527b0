"""examples/s of jobs/ctr.toml (FTRL logistic regression on the clothing reviews) with
1 PS + 2 workers vs one process running the same model code and the same sparse FTRL update
on the touched rows of in-memory tables (the limit one core reaches without MPI).

Run:  python benchmarks/ctr_workload.py [--data data/clothing_reviews.h5] [--job jobs/ctr.toml]
          [--epochs N] [--zero-copy] [--rounds 3]
      (--zero-copy: also with train.zero_copy = true)
(makes the data with `python -m mpips data clothing-reviews` if it is missing)

Each round runs the one process and then every mpips configuration, one after the other,
so that all of them see the same load on a shared machine; the figures are medians over the
rounds, and the ratios are those of the medians. The one process is timed after --warmup
untimed steps (the mpips figure is the chief's, over its whole training loop).
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import mpips_rate
from threadpoolctl import threadpool_limits

from mpips.data.batches import batches, load_split, open_dataset
from mpips.job import load_job
from mpips.models.mlp import build_model
from mpips.optim import build_optimizer, learning_rate

ROOT = Path(__file__).resolve().parent.parent


def one_process(job, data: str, epochs: int, warmup: int) -> float:
    """Examples/s of the CTR loop in this process: prepare (unique ids), gather the rows,
    forward/backward, FTRL on the touched rows and their slots, scatter back; timed over
    ``epochs`` epochs after ``warmup`` untimed steps (the first batches of an epoch)."""
    info = open_dataset(data)
    model = build_model(job.model, info)
    opt = build_optimizer(job.optimizer)
    params = model.initial_values(0)
    tables = {t.name: model.initial_rows(t.name, (0, t.shape[0], 1), 0) for t in model.tables()}
    slots = {k: opt.init_slots(v) for k, v in {**params, **tables}.items()}
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    x, y = load_split(info, "train")
    examples, step = 0, 0

    def train_step(bx, by) -> None:
        nonlocal step
        local, ids = model.prepare(bx)
        rows = {k: t[ids] for k, t in tables.items()}
        row_grads = {k: np.empty_like(v) for k, v in rows.items()}
        model.loss_and_grads({**params, **rows}, local, by, {**grads, **row_grads})
        lr = learning_rate(job.optimizer, step)
        step += 1
        for k in params:
            opt.apply(params[k], grads[k], slots[k], lr, step)
        for k, t in tables.items():
            s = {n: a[ids] for n, a in slots[k].items()}
            opt.apply(rows[k], row_grads[k], s, lr, step)
            t[ids] = rows[k]
            for n, a in slots[k].items():
                a[ids] = s[n]

    with threadpool_limits(limits=1):
        warm = batches(x, y, job.train.batch_size, 0, 0, 1)
        for _, bx, by in itertools.islice(warm, warmup):
            train_step(bx, by)
        t0 = time.perf_counter()
        for _, bx, by in batches(x, y, job.train.batch_size, 0, 0, epochs):
            train_step(bx, by)
            examples += len(by)
        return examples / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(tempfile.gettempdir()) / "mpips-bench/clothing.h5"))
    ap.add_argument("--job", default=str(ROOT / "jobs/ctr.toml"))
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=0, help="instead of the job's (both sides)")
    ap.add_argument("--zero-copy", action="store_true", help="also run with train.zero_copy = true")
    ap.add_argument("--rounds", type=int, default=3, help="each runs every configuration once")
    ap.add_argument("--warmup", type=int, default=200, help="untimed one-process steps")
    args = ap.parse_args()
    if not Path(args.data).exists():
        Path(args.data).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "mpips", "data", "clothing-reviews", args.data], check=True
        )
    job = load_job(args.job)
    epochs = args.epochs or job.train.epochs
    copied = {"mpips": "zero_copy = false\n"}  # (the default on one node is zero copy)
    configs = copied | ({"mpips, zero copy": "zero_copy = true\n"} if args.zero_copy else {})
    single: list[float] = []
    rates: dict[str, list[float]] = {label: [] for label in configs}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        text = Path(args.job).read_text().replace(job.data.path, args.data)
        text = text.replace("log_every = 100", "log_every = 0")
        text = text.replace(f"epochs = {job.train.epochs}", f"epochs = {epochs}")
        text = text.replace(f'dir = "{job.checkpoint.dir}"', 'dir = ""')
        for _ in range(args.rounds):  # rounds alternate the configurations: all see the same load
            single.append(one_process(job, args.data, epochs, args.warmup))
            for label, extra in configs.items():
                (d / "job.toml").write_text(text.replace("[train]\n", f"[train]\n{extra}"))
                rates[label].append(mpips_rate(args.ranks, d / "job.toml", d))
    print(
        f"# ctr_workload | {job.name} ({job.model.kind}, {job.optimizer.kind}, batch "
        f"{job.train.batch_size}, {epochs} epochs, {args.data})"
    )
    base = float(np.median(single))
    print(
        f"one process (1 BLAS thread, {args.warmup} warm-up steps): {base:>9.0f} examples/s "
        f"(median of {args.rounds}: {', '.join(f'{x:.0f}' for x in single)})"
    )
    for label, r in rates.items():
        per_round = " / ".join(f"{a / b:.2f}" for a, b in zip(r, single, strict=True))
        print(
            f"{label}, {args.ranks} ranks (1 ps + {args.ranks - 1} workers): "
            f"{np.median(r):>9.0f} examples/s (median of {args.rounds}: "
            f"{', '.join(f'{x:.0f}' for x in r)}) = {np.median(r) / base:.2f}x of the one "
            f"process's median (each round over its own one process: {per_round})"
        )


if __name__ == "__main__":
    main()

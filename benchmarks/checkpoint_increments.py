"""What an incremental table shard saves: one PS's checkpoint write of a large embedding table
(and its Adagrad slot) holding only the rows changed since its last checkpoint, against the
same checkpoint written as a base (the rows changed since the initial values, or whole),
and against the physical limit: a raw write of the increment's bytes (numpy, fsynced).

Run:  python benchmarks/checkpoint_increments.py [--rows 4194304] [--dim 16]
          [--checkpoints 6] [--updates 200000] [--warm 4000000]

The table is the CTR model's embedding (mpips.models.ctr.WideDeep: small random initial
rows, computed again from the seed as a base write compares them), with Adagrad's
accumulator slot: ``rows x dim`` float32 each. Training is emulated between checkpoints:
``--updates`` row updates of Zipf(1.05) ids (the shape of CTR traffic: a few rows are hot,
most are rare), each adding a random step to the row and its accumulator. ``--warm`` such
updates come before the first checkpoint (a run that has trained a while). Each checkpoint
is written twice into separate directories, with checkpoint.increments 8 and 0, through
mpips.checkpoint.write_shard and commit as a PS does (temporary file, fsync, rename,
manifest), and timed; the raw limit writes the increment's index and rows with numpy and
fsyncs. Then the last increment's checkpoint is read back whole (restore reads its base and
every increment) against the base-only one, and the two are compared bit for bit.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from mpips import checkpoint
from mpips.job import OptimizerConfig
from mpips.models import initial
from mpips.models.ctr import EMBEDDING, WideDeep
from mpips.models.variables import VariableSpec
from mpips.optim import build_optimizer

SLOT = f"{EMBEDDING}/accumulator"


def zipf_ids(rng: np.random.Generator, n: int, rows: int) -> np.ndarray:
    """``n`` ids in 0..rows-1, Zipf(1.05)-distributed over a random permutation of rows."""
    ranks = rng.zipf(1.05, n * 2)
    ranks = ranks[ranks <= rows][:n] - 1
    return (ranks * 2654435761) % rows  # hot ids spread over the table


def directory_bytes(d: Path, step: int) -> int:
    return sum(p.stat().st_size for p in d.glob(f"ckpt-{step}.*"))


def raw_write(path: Path, index: np.ndarray, rows: list[np.ndarray]) -> float:
    """Seconds to write ``index`` and ``rows`` with numpy and fsync them: the limit."""
    t = time.perf_counter()
    with open(path, "wb") as f:
        index.tofile(f)
        for r in rows:
            r.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1 << 22)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--updates", type=int, default=200_000, help="row updates per interval")
    ap.add_argument("--warm", type=int, default=4_000_000, help="row updates before the first")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args()

    model = WideDeep(args.rows, hidden=[16], embedding_dim=args.dim)
    optimizer = build_optimizer(OptimizerConfig(kind="adagrad", learning_rate=0.1))
    values = initial.from_model(model, optimizer)
    seed, rows = 7, (0, args.rows, 1)
    start = values.compute(EMBEDDING, rows, seed)
    table, slot = start[""].copy(), start["accumulator"].copy()
    mb = (table.nbytes + slot.nbytes) / 1e6
    print(f"table {EMBEDDING}: {args.rows} x {args.dim} float32 + accumulator = {mb:.0f} MB")
    rng = np.random.default_rng(0)

    def train(n: int) -> int:
        ids = np.unique(zipf_ids(rng, n, args.rows))
        table[ids] += rng.standard_normal((len(ids), args.dim)).astype(np.float32) * 0.01
        slot[ids] += 0.5
        return len(ids)

    root = Path(args.dir or tempfile.mkdtemp(prefix="mpips-increments-"))
    dirs = {n: root / f"increments-{n}" for n in (8, 0)}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    keep = {n: checkpoint.Increments(n) for n in dirs}
    tables = checkpoint.SparseTables({EMBEDDING: rows}, seed, values)
    entry = checkpoint.Entry(table.shape, "float32", (checkpoint.Part(0, rows),))
    warm_rows = train(args.warm)
    print(f"warm-up: {args.warm} updates touched {warm_rows} rows")
    print(
        f"{'step':>5} {'rows changed':>13} {'incremental ms':>15} {'MB':>7} "
        f"{'base ms':>9} {'MB':>8} {'raw ms':>7}  kind"
    )
    for k in range(args.checkpoints):
        step = (k + 1) * 100
        changed = train(args.updates) if k else warm_rows
        timing = {}
        for n, d in dirs.items():
            t = time.perf_counter()
            checkpoint.write_shard(
                d, step, 0, 1, {EMBEDDING: table}, {SLOT: slot}, tables, increments=keep[n]
            )
            checkpoint.commit(d, step, 1, {EMBEDDING: entry}, {SLOT: entry}, {}, max_to_keep=2)
            timing[n] = (time.perf_counter() - t, directory_bytes(d, step))
        last = checkpoint.Checkpoint(dirs[8] / f"ckpt-{step}.json")
        kind = f"on {last.bases[-1]}" if last.bases else "base"
        index = np.flatnonzero(np.ones(changed, bool)).astype(np.uint32)  # the same bytes
        raw = raw_write(root / "raw.bin", index, [table[:changed], slot[:changed]])
        (inc_s, inc_b), (base_s, base_b) = timing[8], timing[0]
        print(
            f"{step:>5} {changed:>13} {inc_s * 1e3:>15.0f} {inc_b / 1e6:>7.1f} "
            f"{base_s * 1e3:>9.0f} {base_b / 1e6:>8.1f} {raw * 1e3:>7.0f}  {kind}",
            flush=True,
        )
    specs = [VariableSpec(EMBEDDING, table.shape)], [VariableSpec(SLOT, slot.shape)]
    read = {}
    for n, d in dirs.items():
        ckpt = checkpoint.Checkpoint(checkpoint.latest_checkpoint(d))
        t = time.perf_counter()
        read[n] = ckpt.read(*specs, initial=values)
        print(
            f"restore (increments {n}): {time.perf_counter() - t:.2f} s, "
            f"{ckpt.stored_bytes / 1e6:.1f} MB read"
        )
    same = all(read[8][k].tobytes() == read[0][k].tobytes() for k in (EMBEDDING, SLOT))
    assert same and read[8][EMBEDDING].tobytes() == table.tobytes()
    print("restored bit for bit: the same as the base-only checkpoint and the table")


if __name__ == "__main__":
    main()

"""A table larger than any one rank should hold: wide & deep with 100M ids (an embedding of
100M x 16 float32, 6.4 GB, plus 0.4 GB of wide weights) split over 2 PS tasks, trained by
2 workers; its checkpoint written and restored with no rank ever holding a whole table,
once with dense checkpoints (every row written, MPIPS_SPARSE_CHECKPOINTS=0) and once with
sparse ones (only the rows that differ from their initial values), against raw h5py
writing and reading one PS task's bytes in the same run.

Run:  python benchmarks/big_table.py [--features 100000000] [--dir /tmp/mpips-big]

What it measures, all in one run, for each layout:
* start-up: each PS task fills its fresh partitions in chunks of rows (never the whole
  table in memory outside its window); the run's wall time;
* checkpoint write: the chief's "saved checkpoint ... (N ms ...)" of the run's final
  checkpoint (both PS tasks write their shards in parallel, fsynced) -> MB/s of table
  checkpointed, and the bytes of the shards written (the rows stored, for sparse);
* restore: each PS task's "read its N MB of ckpt-S.json in T s" when the run resumes (MB
  of table restored per second; sparse: the untouched rows computed again, not read);
* raw h5py: one process writes one PS task's bytes (the same shapes) to a fresh file with
  fsync, then reads them back; MB/s of each.
Needs ~3x a PS task's share of memory free (its window, plus the array read on restore)
and ~1x the table on disk (the dense layout's shards, deleted before the sparse run).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
from common import mpiexec

JOB = """
[model]
kind = "wide_deep"
hidden = [16]
embedding_dim = 16
[data]
path = "{data}"
[optimizer]
kind = "sgd"
learning_rate = 0.1
[train]
steps = {steps}
batch_size = 256
log_every = 0
progress = false
zero_copy = false  # the copied pulls its recorded figures used
[checkpoint]
dir = "{ckpt}"
every_steps = 0
max_to_keep = 1
[summary]
every_steps = 0
[layout]
ps = 2
"""


def run(workdir: Path, ranks: int, steps: int, **env: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(
        [mpiexec(), "-n", str(ranks), sys.executable]
        + ["-m", "mpips", "train", "job.toml", "--steps", str(steps)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, **env},
    )
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return wall, r.stdout


@dataclass
class Layout:
    """One layout's figures: the fresh run, its final checkpoint, and the restore."""

    name: str
    fresh_wall: float = 0.0
    save_ms: int = 0
    shard_bytes: int = 0
    rows_stored: str = ""
    reads: list[tuple[float, float]] = field(default_factory=list)
    resumed_wall: float = 0.0


def measure(d: Path, name: str, steps: int, features: int, **env: str) -> Layout:
    """A fresh run to ``steps`` with its final checkpoint, then a resume by one step."""
    from mpips.checkpoint import Checkpoint

    out = Layout(name)
    ckpt = d / f"ckpt-{name}"
    (d / "job.toml").write_text(JOB.format(data=d / "zipf.h5", steps=steps, ckpt=ckpt))
    out.fresh_wall, log = run(d, 4, steps, **env)
    saved = re.findall(r"saved checkpoint \S+ \(global_step (\d+), (\d+) ms", log)
    step, out.save_ms = map(int, saved[-1])
    manifest = Checkpoint(ckpt / f"ckpt-{step}.json")
    out.shard_bytes = sum(manifest.shard_path(k).stat().st_size for k in range(2))
    stored = [n for _, n in manifest.layouts("deep/embedding")]
    if all(n is not None for n in stored):
        out.rows_stored = f"{sum(n for n in stored if n is not None):,} of {features:,} rows"
    out.resumed_wall, log = run(d, 4, steps + 1, **env)
    out.reads = [
        (float(mb), float(s))
        for mb, s in re.findall(r"read its ([0-9.]+) MB of ckpt-\d+\.json in ([0-9.]+) s", log)
    ]
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def report(r: Layout, steps: int, table_mb: float) -> None:
    """The figures of one layout."""
    print(f"## {r.name}")
    print(f"fresh run ({steps} steps, fill + train + final checkpoint): {r.fresh_wall:.1f} s")
    print(
        f"checkpoint write: {table_mb:,.0f} MB of tables in {r.save_ms / 1e3:.2f} s "
        f"= {table_mb / (r.save_ms / 1e3):,.0f} MB/s (2 PS tasks in parallel); "
        f"{r.shard_bytes / 1e6:,.1f} MB of shards written"
        + (f" (embedding: {r.rows_stored} stored)" if r.rows_stored else "")
    )
    for k, (mb, s) in enumerate(r.reads):
        print(f"restore, PS task {k}: {mb:,.0f} MB in {s:.2f} s = {mb / s:,.0f} MB/s")
    print(f"resumed run (restore + 1 step + checkpoint): {r.resumed_wall:.1f} s")


def raw_h5py(path: Path, shapes: list[tuple[int, ...]]) -> tuple[float, float, int]:
    """Write arrays of ``shapes`` (float32) with h5py and fsync, read them back: MB/s."""
    arrays = [np.random.default_rng(0).random(s, dtype=np.float32) for s in shapes]
    nbytes = sum(a.nbytes for a in arrays)
    t0 = time.perf_counter()
    with h5py.File(path, "w") as f:
        for i, a in enumerate(arrays):
            f.create_dataset(f"a{i}", data=a)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    write = time.perf_counter() - t0
    del arrays
    os.posix_fadvise(os.open(path, os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    t0 = time.perf_counter()
    with h5py.File(path, "r") as f:
        back = [f[f"a{i}"][()] for i in range(len(shapes))]
    read = time.perf_counter() - t0
    del back
    path.unlink()
    return nbytes / 1e6 / write, nbytes / 1e6 / read, nbytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--features", type=int, default=100_000_000)
    ap.add_argument("--rows", type=int, default=20_000, help="train rows of the data file")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dir", default="/tmp/mpips-big")
    args = ap.parse_args()
    d = Path(args.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    from mpips.data.ctr_convert import make_zipf

    make_zipf(d / "zipf.h5", rows=args.rows, num_features=args.features, nnz=16)
    F = args.features
    table_mb = F * 17 * 4 / 1e6
    layouts = [
        measure(d, "dense", args.steps, F, MPIPS_SPARSE_CHECKPOINTS="0"),
        measure(d, "sparse", args.steps, F),
    ]
    half = (F + 1) // 2
    raw_w, raw_r, raw_bytes = raw_h5py(d / "raw.h5", [(half, 16), (half, 1)])
    print(
        f"# big_table | wide & deep, {F:,} ids x (16 + 1) float32 = {table_mb:,.0f} MB of tables,"
    )
    print("#   2 PS tasks (one partition of each table each) + 2 workers, SGD")
    for r in layouts:
        report(r, args.steps, table_mb)
    dense, sparse = layouts
    print(
        f"bytes written, sparse / dense: {sparse.shard_bytes / 1e6:,.1f} MB / "
        f"{dense.shard_bytes / 1e6:,.0f} MB = {sparse.shard_bytes / dense.shard_bytes:.5f}"
    )
    print(
        f"raw h5py, one process, {raw_bytes / 1e6:,.0f} MB (one PS task's share): "
        f"write+fsync {raw_w:,.0f} MB/s, read {raw_r:,.0f} MB/s"
    )
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()

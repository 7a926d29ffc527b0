"""A table larger than any one rank should hold: wide & deep with 100M ids (an embedding of
100M x 16 float32, 6.4 GB, plus 0.4 GB of wide weights) split over 2 PS tasks, trained by
2 workers; its checkpoint written and restored with no rank ever holding a whole table,
against raw h5py writing and reading one PS task's bytes in the same run.

Run:  python benchmarks/big_table.py [--features 100000000] [--dir /tmp/mpips-big]

What it measures, all in one run:
* start-up: each PS task fills its fresh partitions in chunks of rows (never the whole
  table in memory outside its window); the run's wall time;
* checkpoint write: the chief's "saved checkpoint ... (N ms ...)" of the run's final
  checkpoint (both PS tasks write their shards in parallel, fsynced) -> MB/s;
* restore: each PS task's "read its N MB of ckpt-S.json in T s" when the run resumes;
* raw h5py: one process writes one PS task's bytes (the same shapes) to a fresh file with
  fsync, then reads them back; MB/s of each.
Needs ~3x a PS task's share of memory free (its window, plus the array read on restore)
and ~2x the table on disk.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np

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
[checkpoint]
dir = "{ckpt}"
every_steps = 0
max_to_keep = 1
[summary]
every_steps = 0
[layout]
ps = 2
"""


def run(workdir: Path, ranks: int, steps: int) -> tuple[float, str]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    t0 = time.perf_counter()
    r = subprocess.run(
        [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(ranks), sys.executable]
        + ["-m", "mpips", "train", "job.toml", "--steps", str(steps)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"run failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return wall, r.stdout


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
    from mpips.ctr_convert import make_zipf

    make_zipf(d / "zipf.h5", rows=args.rows, num_features=args.features, nnz=16)
    (d / "job.toml").write_text(JOB.format(data=d / "zipf.h5", steps=args.steps, ckpt=d / "ckpt"))
    F = args.features
    table_mb = F * 17 * 4 / 1e6
    fresh_wall, out = run(d, 4, args.steps)
    saved = re.findall(r"saved checkpoint \S+ \(global_step (\d+), (\d+) ms", out)
    step, ms = map(int, saved[-1])
    shards = sorted((d / "ckpt").glob(f"ckpt-{step}.shard-*"))
    shard_mb = sum(p.stat().st_size for p in shards) / 1e6
    resumed_wall, out = run(d, 4, args.steps + 1)
    reads = [
        (float(mb), float(s))
        for mb, s in re.findall(r"read its ([0-9.]+) MB of ckpt-\d+\.json in ([0-9.]+) s", out)
    ]
    half = (F + 1) // 2
    raw_w, raw_r, raw_bytes = raw_h5py(d / "raw.h5", [(half, 16), (half, 1)])
    print(
        f"# big_table | wide & deep, {F:,} ids x (16 + 1) float32 = {table_mb:,.0f} MB of tables,"
    )
    print("#   2 PS tasks (one partition of each table each) + 2 workers, SGD")
    print(f"fresh run ({args.steps} steps, fill + train + final checkpoint): {fresh_wall:.1f} s")
    print(
        f"checkpoint write: {shard_mb:,.0f} MB of shards in {ms / 1e3:.2f} s "
        f"= {shard_mb / (ms / 1e3):,.0f} MB/s (2 PS tasks in parallel)"
    )
    for k, (mb, s) in enumerate(reads):
        print(f"restore, PS task {k}: {mb:,.0f} MB in {s:.2f} s = {mb / s:,.0f} MB/s")
    print(f"resumed run (restore + 1 step + checkpoint): {resumed_wall:.1f} s")
    print(
        f"raw h5py, one process, {raw_bytes / 1e6:,.0f} MB (one PS task's share): "
        f"write+fsync {raw_w:,.0f} MB/s, read {raw_r:,.0f} MB/s"
    )
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()

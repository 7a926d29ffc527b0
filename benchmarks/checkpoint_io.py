"""Checkpoint write and restore MB/s vs a raw h5py write/read of the same arrays (one process),
and how long a checkpoint pauses the chief.

Run:  python benchmarks/checkpoint_io.py [--reps 5] [--no-job]

Payloads: the reference MLP (784-512-512-10) with Adam slots (variables + m + v: 8 MB), and a
~256 MB set of variables. mpips' save is what one writer does: its shard (a temporary file,
fsynced, renamed, directory fsynced) plus the manifest commit; restore reads the manifest and
reassembles every array by name. The raw rows show h5py alone, without and with fsync.
Target: mpips >= 0.7x raw. With several PS tasks the shards are written in parallel.

Table partitions: a PS restoring its rows of a row-partitioned table reads only those rows
(vs raw h5py reading the same rows from the shard, and vs reading the whole table first).

The pause: a real 4-rank job (2 PS + 2 workers, reference model, Adam) checkpoints every 25
steps; the chief's "saved checkpoint ... (N ms; the chief paused M ms)" lines give how long
each checkpoint took from request to commit (both PS writing their shards in parallel, the
manifest) and how much of it the chief spent (the request and the commit: a periodic
checkpoint does not stop it; the last one of the run is waited for). Other workers keep
training throughout.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np

from mpips import checkpoint
from mpips.models.mlp import MLP
from mpips.models.variables import VariableSpec


def payloads() -> dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    mlp = MLP([784, 512, 512, 10]).variables()
    variables = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in mlp}
    slots = {
        f"{k}/{s}": rng.standard_normal(v.shape).astype(np.float32)
        for k, v in variables.items()
        for s in ("m", "v")
    }
    big = [VariableSpec(f"layer_{i}/kernel", (4096, 4096)) for i in range(4)]
    large = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in big}
    return {"MLP + Adam slots": (variables, slots), "4 x 4096x4096 float32": (large, {})}


def raw_write(path: Path, arrays: dict[str, np.ndarray], fsync: bool) -> None:
    with h5py.File(path, "w") as f:
        for name, a in arrays.items():
            f.create_dataset(name, data=a)
        if fsync:
            f.flush()
            os.fsync(f.id.get_vfd_handle())


def raw_read(path: Path, names) -> list[np.ndarray]:
    """Every array, kept (as a restore must: dropping each one at once lets the allocator
    reuse its pages, which made the raw read look 2x faster on the 8 MB payload)."""
    with h5py.File(path, "r") as f:
        return [f[name][()] for name in names]


def median(fn, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-job", action="store_true", help="skip the 4-rank job")
    args = ap.parse_args()
    print(
        f"# checkpoint_io | h5py {h5py.__version__} | HDF5 {h5py.version.hdf5_version} | "
        f"median of {args.reps} | {tempfile.gettempdir()}"
    )
    print(
        f"{'payload':<24}{'MB':>8}{'raw write':>11}{'raw+fsync':>11}{'mpips save':>12}"
        f"{'ratio':>7}{'raw read':>10}{'mpips restore':>15}{'ratio':>7}   (MB/s)"
    )
    for label, (variables, slots) in payloads().items():
        # same arrays and bytes; flat names (h5py cannot put "w/m" under the dataset "w")
        arrays = {k.replace("/", "."): v for k, v in {**variables, **slots}.items()}
        mb = sum(a.nbytes for a in arrays.values()) / 1e6
        specs = [VariableSpec(k, v.shape) for k, v in variables.items()]
        slot_specs = [VariableSpec(k, v.shape) for k, v in slots.items()]
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            t_raw = median(lambda: raw_write(d / "raw.h5", arrays, False), args.reps)
            t_rawf = median(lambda: raw_write(d / "raw.h5", arrays, True), args.reps)

            def save() -> None:
                checkpoint.write_shard(d / "ck", 1, 0, 1, variables, slots)
                checkpoint.commit(
                    d / "ck",
                    1,
                    1,
                    checkpoint.whole_index(variables),
                    checkpoint.whole_index(slots),
                    {},
                    1,
                )

            t_save = median(save, args.reps)
            # reads: the same shard both ways (raw h5py by path vs restore), interleaved
            shard = d / "ck" / checkpoint.shard_name(1, 0, 1)
            paths = [checkpoint.h5_path(k, False) for k in variables] + [
                checkpoint.h5_path(k, True) for k in slots
            ]
            reads, restores = [], []

            def restore() -> None:
                checkpoint.Checkpoint(d / "ck/ckpt-1.json").read(specs, slot_specs)

            for _ in range(args.reps):
                reads.append(median(lambda: raw_read(shard, paths), 1))
                restores.append(median(restore, 1))
            t_read, t_restore = float(np.median(reads)), float(np.median(restores))
        print(
            f"{label:<24}{mb:>8.1f}{mb / t_raw:>11.0f}{mb / t_rawf:>11.0f}{mb / t_save:>12.0f}"
            f"{t_rawf / t_save:>7.2f}{mb / t_read:>10.0f}{mb / t_restore:>15.0f}"
            f"{t_read / t_restore:>7.2f}"
        )
    partition_restore(args.reps)
    if not args.no_job:
        took, paused = job_pauses()
        print(
            f"real job, 2 PS + 2 workers, Adam, 784-512-512-10: {len(took)} periodic "
            f"checkpoints, request to commit median {np.median(took):.0f} ms (min "
            f"{min(took):.0f}, max {max(took):.0f}); the chief paused median "
            f"{np.median(paused):.0f} ms (min {min(paused):.0f}, max {max(paused):.0f})"
        )


def partition_restore(reps: int, rows: int = 4_000_000, dim: int = 16) -> None:
    """A PS restoring its part of a table written by 2 PS ("mod"): only its rows, read from
    the shard that holds them. Limit: raw h5py reading the same rows from that shard."""
    table = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    entry = checkpoint.Entry(
        (rows, dim), "float32", tuple(checkpoint.Part(k, (k, rows, 2)) for k in range(2))
    )
    spec = VariableSpec("emb", (rows, dim))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for k in range(2):
            checkpoint.write_shard(d, 1, k, 2, {"emb": table[k::2]})
        checkpoint.commit(d, 1, 2, {"emb": entry}, {}, {}, 1)
        ckpt = checkpoint.Checkpoint(d / "ckpt-1.json")
        shard = d / checkpoint.shard_name(1, 1, 2)
        del table
        print(
            f"table {rows}x{dim} float32 ({rows * dim * 4 / 1e6:.0f} MB) written by 2 PS, "
            f"restored by task 1 of n:"
        )
        for n, stride in ((2, 1), (4, 2)):  # task 1 of 4 holds rows 1::4 = shard 1's 0::2

            def raw() -> np.ndarray:
                with h5py.File(shard, "r") as f:
                    return f[checkpoint.h5_path("emb", False)][::stride]

            mb = raw().nbytes / 1e6
            t_raw = median(raw, reps)
            t_rows = median(lambda: ckpt.read([spec], rows={"emb": (1, rows, n)}), reps)
            t_whole = median(lambda: ckpt.read([spec])["emb"][1::n].copy(), reps)
            print(
                f"  n = {n}: {mb:.0f} MB partition: raw h5py {mb / t_raw:.0f} MB/s, mpips "
                f"{mb / t_rows:.0f} MB/s ({t_raw / t_rows:.2f}x); reading the whole table "
                f"and slicing {mb / t_whole:.0f} MB/s"
            )


JOB = """
[model]
hidden = [512, 512]
[data]
path = "{data}"
[optimizer]
kind = "adam"
learning_rate = 0.001
[train]
steps = 400
batch_size = 64
log_every = 0
progress = false
zero_copy = false  # the copied pulls its recorded figures used
[checkpoint]
dir = "runs/bench"
every_steps = 25
"""


def job_pauses() -> tuple[list[float], list[float]]:
    """Run the job under mpiexec -n 4 (2 PS); per periodic checkpoint (the last one, at the
    end of the run, is waited for and left out): ms from request to commit, and ms of it the
    chief spent."""
    import re
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "mpips", "data", "synthetic", "s.h5", "--rows", "20000"],
            cwd=d,
            check=True,
            capture_output=True,
        )
        (d / "job.toml").write_text(JOB.format(data=d / "s.h5"))
        out = subprocess.run(
            ["mpiexec", "-n", "4", sys.executable, "-m", "mpips", "train", "job.toml", "--ps", "2"],
            cwd=d,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode:
            raise SystemExit(out.stderr)
        found = re.findall(
            r"saved checkpoint .*?, (\d+) ms; the chief paused (\d+) ms\)", out.stdout
        )[:-1]
        return [float(t) for t, _ in found], [float(p) for _, p in found]


if __name__ == "__main__":
    main()

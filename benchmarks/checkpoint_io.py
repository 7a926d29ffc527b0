"""Checkpoint write and restore MB/s vs a raw h5py write/read of the same arrays (one process),
and how long a checkpoint pauses the chief.

Run:  python benchmarks/checkpoint_io.py [--reps 5]

Payloads: the reference MLP (784-512-512-10) with Adam slots (variables + m + v: 8 MB), and a
~256 MB set of variables. mpips' save writes a temporary file, fsyncs it, renames it and
fsyncs the directory (crash safety); the raw rows show h5py alone, without and with fsync.
Target: mpips >= 0.7x raw. The pause is what the chief's CheckpointSaver spends per save
(save() of arrays already pulled; a pull of 2.7 MB adds ~0.1-0.2 ms, see store_bandwidth).
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
from mpips.nn import MLP
from mpips.placement import VariableSpec


def payloads() -> dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    mlp = MLP([784, 512, 512, 10]).variables()
    variables = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in mlp}
    slots = {f"{k}/{s}": rng.standard_normal(v.shape).astype(np.float32)
             for k, v in variables.items() for s in ("m", "v")}
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


def raw_read(path: Path, names) -> None:
    with h5py.File(path, "r") as f:
        for name in names:
            f[name][()]


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
    args = ap.parse_args()
    print(f"# checkpoint_io | h5py {h5py.__version__} | HDF5 {h5py.version.hdf5_version} | "
          f"median of {args.reps} | {tempfile.gettempdir()}")
    print(f"{'payload':<24}{'MB':>8}{'raw write':>11}{'raw+fsync':>11}{'mpips save':>12}"
          f"{'ratio':>7}{'raw read':>10}{'mpips restore':>15}{'ratio':>7}   (MB/s)")
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
            t_save = median(lambda: checkpoint.save(d / "ck", 1, variables, 1, None, slots),
                            args.reps)
            # reads: the same checkpoint file both ways (raw h5py by path vs restore), interleaved
            ck = d / "ck/ckpt-1.h5"
            paths = [f"variables/{k}" for k in variables] + \
                [f"slots/{k.rsplit('/', 1)[1]}/{k.rsplit('/', 1)[0]}" for k in slots]
            reads, restores = [], []
            for _ in range(args.reps):
                reads.append(median(lambda: raw_read(ck, paths), 1))
                restores.append(median(lambda: checkpoint.restore(ck, specs, slot_specs), 1))
            t_read, t_restore = float(np.median(reads)), float(np.median(restores))
        print(f"{label:<24}{mb:>8.1f}{mb / t_raw:>11.0f}{mb / t_rawf:>11.0f}{mb / t_save:>12.0f}"
              f"{t_rawf / t_save:>7.2f}{mb / t_read:>10.0f}{mb / t_restore:>15.0f}"
              f"{t_read / t_restore:>7.2f}")
        if label.startswith("MLP"):
            print(f"  -> the chief pauses {t_save * 1e3:.1f} ms per checkpoint of this model "
                  f"(other workers keep training in async mode)")


if __name__ == "__main__":
    main()

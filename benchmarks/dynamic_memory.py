"""The memory a dynamic table's row costs beyond the row itself, measured: the resident
memory a PS process gains for N live rows of 16 float32 (64 B), minus the rows.

Run:  python benchmarks/dynamic_memory.py [--rows 2000000]
"""

from __future__ import annotations

import argparse
import gc
import os

import numpy as np

from mpips.models.ctr import uniform_rows
from mpips.store.dynamic_rows import DynamicRows

WIDTH = 16


def resident() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2_000_000)
    n = ap.parse_args().rows
    ids = np.random.default_rng(0).choice(1 << 62, n, replace=False).astype(np.int64)
    table = DynamicRows(
        {"t": WIDTH},
        np.dtype(np.float32),
        (),
        lambda i: {"t": {"": uniform_rows(0, i, WIDTH, 0.05)}},
    )
    out = np.empty((100_000, WIDTH), np.float32)
    gc.collect()
    before = resident()
    for lo in range(0, n, len(out)):
        part = ids[lo : lo + len(out)]
        table.lookup(part, {"t": out[: len(part)]}, 1)
    gc.collect()
    grown = resident() - before
    rows = table.live * WIDTH * 4
    allocated = len(table.ids)
    per_row_words = (table.ids.nbytes + table.last.nbytes + table.uses.nbytes) / n
    id_map = (table.map.keys.nbytes + table.map.rows.nbytes) / n
    print(f"{table.live} live rows of {WIDTH} float32 ({WIDTH * 4} B); {allocated} allocated")
    print(
        f"resident memory gained: {grown / n:.0f} B a live row, {(grown - rows) / n:.0f} B "
        f"beyond the row"
    )
    print(
        f"  of which: id map {id_map:.0f} B, per-row words (id, last step, uses) "
        f"{per_row_words:.0f} B, rows allocated but free {(allocated - n) * WIDTH * 4 / n:.0f} B"
    )


if __name__ == "__main__":
    main()

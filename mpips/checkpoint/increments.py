"""Incremental table shards: a PS writes only the table rows that changed since its previous
checkpoint, on top of that checkpoint, and a whole (base) shard every few checkpoints.

A writer keeps one 64-bit digest per row of each table array (the table partition and its
slots) as of the checkpoint it wrote last: 8 bytes a row, where a copy of the previous
values would cost the row itself. A row whose digest differs has changed; one whose digest
is the same is taken as unchanged (two different rows share a digest with odds of about
2^-64). Digests are computed *before* the rows are gathered for writing, so an update that
lands during the write makes the row differ next time (written twice), never lost.

An increment is stored like a sparse part (see sparse): ``index`` and ``values``, with
``base`` "checkpoint" and the ``step`` of the checkpoint it overlays. Its shard records the
steps it builds on (attribute ``bases``), the commit copies them into the manifest and
refuses one that is not committed, pruning keeps every checkpoint a kept one builds on, and a
reader reads the base's rows (from that checkpoint, on any layout) before the increment's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..models.initial import CHUNK_ELEMENTS, row_chunks
from .format import manifest_name
from .sparse import SPARSE_MAX_FRACTION, Changed, SparseTables, table_arrays

BASES = "bases"  # a shard attribute and a manifest field: the checkpoints it overlays
MAX_CHAIN = 100  # increments on one base, at most (a reader refuses a longer chain)
MIN_ROW_BYTES = 32  # narrower rows: a digest (8 bytes a row) would cost too much beside them

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer constants
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def row_digests(array: np.ndarray) -> np.ndarray:
    """One uint64 per row of ``array``: each word of the row's bits (8 bytes, or 4, 2 or 1
    where the row is not a whole number of longer ones), widened to 64 bits, mixed with its
    position (splitmix64's finalizer) and summed. Equal rows, bit for bit, have equal
    digests; a chunk of rows at a time (bounded temporaries)."""
    n = len(array)
    if n == 0:
        return np.zeros(0, np.uint64)
    rows = np.ascontiguousarray(array).reshape(n, -1).view(np.uint8)
    size = next(k for k in (8, 4, 2, 1) if rows.shape[1] % k == 0)
    words = rows.view(f"u{size}")
    width = words.shape[1]
    keys = (np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    out = np.empty(n, np.uint64)
    for lo, hi in row_chunks(n, width, CHUNK_ELEMENTS):
        h = words[lo:hi] ^ keys  # (widened to uint64)
        h ^= h >> np.uint64(30)
        h *= _MIX1
        h ^= h >> np.uint64(27)
        h *= _MIX2
        h ^= h >> np.uint64(31)
        out[lo:hi] = h.sum(axis=1, dtype=np.uint64) if width > 1 else h[:, 0]
    return out


@dataclass
class Increments:
    """What one writer (a PS task) remembers between its checkpoints to write the next one
    as an increment: each table array's row digests (by its path in a shard) as of ``step``,
    the checkpoint it wrote last, and how many increments lie on the current base.
    ``every``: increments between two bases (0: every checkpoint is a base); ``min_bytes``:
    an array smaller than this is written as a base each time (hashing it costs about what
    writing it does: a 4 MB array hashes in ~20 ms, and is written in ~10)."""

    every: int
    min_bytes: int = 64 << 20
    digests: dict[str, np.ndarray] = field(default_factory=dict)
    step: int | None = None
    on_base: int = 0  # increments written since the last base

    def base_step(self, directory: str | Path, step: int) -> int | None:
        """The checkpoint the shard of ``step`` may overlay: the one this writer wrote last,
        if it is an earlier one (a second save at the same step, as the end of a run may
        make, is a base), it is committed (its manifest is in ``directory``) and the chain
        has room; None: write a base."""
        if self.step is None or self.step >= step or self.on_base >= self.every:
            return None
        return self.step if (Path(directory) / manifest_name(self.step)).is_file() else None

    def takes(self, array: np.ndarray) -> bool:
        """Whether ``array`` (a table partition or slot) is written as increments: large
        enough, with rows of MIN_ROW_BYTES at least (a width-1 float32 table's digests
        would take twice its memory)."""
        return (
            self.every > 0 and array.nbytes >= self.min_bytes and array[:1].nbytes >= MIN_ROW_BYTES
        )

    def wrote(self, step: int, digests: dict[str, np.ndarray], increment: bool) -> None:
        """Shard ``step`` is written (as an increment or a base) with rows of ``digests``."""
        self.digests, self.step = digests, step
        self.on_base = self.on_base + 1 if increment else 0

    def changed(self, path: str, digests: np.ndarray) -> np.ndarray | None:
        """Positions of the rows of array ``path`` whose digests differ from the last
        checkpoint's, ascending; None if it has none to compare with (a new array or shape)."""
        old = self.digests.get(path)
        if old is None or len(old) != len(digests):
            return None
        return np.flatnonzero(old != digests)


@dataclass
class Plan:
    """One shard's increments, planned before it is written: the table arrays written as
    increments (``arrays``), their row digests now (taken before any row is gathered), and
    the checkpoint they overlay (``on``; None: every array a base)."""

    increments: Increments | None
    arrays: dict[str, np.ndarray]
    digests: dict[str, np.ndarray]
    on: int | None
    overlays: list[int] = field(default_factory=list)  # what the shard overlays, as written

    @classmethod
    def of(
        cls,
        variables: dict[str, np.ndarray],
        slots: dict[str, np.ndarray],
        tables: SparseTables | None,
        increments: Increments | None,
        directory: str | Path,
        step: int,
    ) -> Plan:
        arrays = {
            path: a
            for path, a in table_arrays(variables, slots, tables).items()
            if increments is not None and increments.takes(a)
        }
        digests = {path: row_digests(a) for path, a in arrays.items()}
        on = increments.base_step(directory, step) if increments and digests else None
        return cls(increments, arrays, digests, on)

    def changed(self) -> dict[str, Changed]:
        """The arrays written as increments, by path, with their rows changed since ``on``."""
        out: dict[str, Changed] = {}
        if self.increments is not None and self.on is not None:
            for path, d in self.digests.items():
                index = self.increments.changed(path, d)
                rows = len(self.arrays[path])
                if index is not None and len(index) <= SPARSE_MAX_FRACTION * rows:
                    out[path] = Changed.increment(self.arrays[path], index, self.on)
                # (else a base: an increment of most rows is no smaller than one)
        self.overlays[:] = [self.on] if out and self.on is not None else []
        return out

    def wrote(self, step: int) -> None:
        """The shard of ``step`` is written: the writer remembers its digests."""
        if self.increments is not None and self.digests:
            self.increments.wrote(step, self.digests, bool(self.overlays))

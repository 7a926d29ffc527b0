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

BASES = "bases"  # a shard attribute and a manifest field: the checkpoints it overlays
MAX_CHAIN = 100  # increments on one base, at most (a reader refuses a longer chain)

_MIX1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer constants
_MIX2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def row_digests(array: np.ndarray) -> np.ndarray:
    """One uint64 per row of ``array``: each 64-bit word of the row (the row's bits, padded
    to whole words) mixed with its position (splitmix64's finalizer) and summed. Equal rows,
    bit for bit, have equal digests; a chunk of rows at a time (bounded temporaries)."""
    n = len(array)
    rows = np.ascontiguousarray(array).reshape(n, -1).view(np.uint8)
    width = -(-rows.shape[1] // 8)
    keys = (np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN)[None, :]
    out = np.empty(n, np.uint64)
    for lo, hi in row_chunks(n, width, CHUNK_ELEMENTS):
        block = rows[lo:hi]
        if block.shape[1] % 8:
            padded = np.zeros((hi - lo, width * 8), np.uint8)
            padded[:, : block.shape[1]] = block
            block = padded
        h = block.view(np.uint64) ^ keys
        h ^= h >> np.uint64(30)
        h *= _MIX1
        h ^= h >> np.uint64(27)
        h *= _MIX2
        h ^= h >> np.uint64(31)
        out[lo:hi] = h.sum(axis=1, dtype=np.uint64)
    return out


@dataclass
class Increments:
    """What one writer (a PS task) remembers between its checkpoints to write the next one
    as an increment: each table array's row digests (by its path in a shard) as of ``step``,
    the checkpoint it wrote last, and how many increments lie on the current base.
    ``every``: increments between two bases (0: every checkpoint is a base)."""

    every: int
    digests: dict[str, np.ndarray] = field(default_factory=dict)
    step: int | None = None
    on_base: int = 0  # increments written since the last base

    def base_step(self, directory: str | Path) -> int | None:
        """The checkpoint the next shard may overlay: the one this writer wrote last, if it
        is committed (its manifest is in ``directory``) and the chain has room; None: write
        a base."""
        if self.step is None or self.on_base >= self.every:
            return None
        return self.step if (Path(directory) / manifest_name(self.step)).is_file() else None

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

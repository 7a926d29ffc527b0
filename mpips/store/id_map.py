"""A map from int64 ids (>= 0) to rows, in two numpy arrays, every operation on a whole
array of ids at once: open addressing with linear probing on a power-of-two table, kept at
most half full (a dynamic table's id -> row map, dynamic_rows.py).

A Python dict does the same at about 185 bytes and, for a batch's 2000 ids, 1-2 ms a
lookup (one ``dict.get`` a id); this takes 16 bytes a slot (32-64 a live id) and a few
vectorised probes a batch. Removed ids leave tombstones, swept by a rebuild once live ids
and tombstones fill half the table.
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = -1, -2  # a slot never used / a slot whose id was removed
MIN_SLOTS = 1024


def mix64(values: np.ndarray, salt: int = 0) -> np.ndarray:
    """SplitMix64's finaliser of ``values + salt``, as uint64: a hash whose every bit depends
    on every bit of the id."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class IdMap:
    """ids -> rows; ids unique within a call."""

    def __init__(self, slots: int = MIN_SLOTS):
        self._make(max(MIN_SLOTS, 1 << (max(1, slots) - 1).bit_length()))
        self.live = 0

    def _make(self, size: int) -> None:
        self.keys = np.full(size, EMPTY, np.int64)
        self.rows = np.zeros(size, np.int64)
        self.mask = np.uint64(size - 1)
        self.used = 0  # live ids and tombstones

    def __len__(self) -> int:
        return self.live

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids, 7) & self.mask).astype(np.int64)

    def _probe(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each id's slot, and whether it holds the id (else the slot is the EMPTY one its
        probe ended at)."""
        at = self._home(ids)
        found = np.zeros(len(ids), bool)
        todo = np.arange(len(ids))
        mask = int(self.mask)
        while todo.size:
            k = self.keys[at[todo]]
            hit = (k == ids[todo]) & (k >= 0)  # (never an EMPTY or GONE mark)
            found[todo[hit]] = True
            more = ~hit & (k != EMPTY)
            todo = todo[more]
            at[todo] = (at[todo] + 1) & mask
        return at, found

    def find(self, ids: np.ndarray) -> np.ndarray:
        """Each id's row, or -1."""
        at, found = self._probe(ids)
        return np.where(found, self.rows[at], -1)

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add ids not in the map, with their rows."""
        if self.used + len(ids) > len(self.keys) // 2:
            self._rebuild(self.live + len(ids))
        at = self._home(ids)
        todo = np.arange(len(ids))
        mask = int(self.mask)
        while todo.size:
            k = self.keys[at[todo]]
            free = (k == EMPTY) | (k == GONE)
            cand = todo[free]
            # one id a free slot: the first that reached it; the others probe on
            _, first = np.unique(at[cand], return_index=True)
            won = cand[first]
            self.used += int((self.keys[at[won]] == EMPTY).sum())
            self.keys[at[won]] = ids[won]
            self.rows[at[won]] = rows[won]
            lost = np.setdiff1d(todo, won, assume_unique=True)
            at[lost] = (at[lost] + 1) & mask
            todo = lost
        self.live += len(ids)

    def remove(self, ids: np.ndarray) -> None:
        """Drop ids that are in the map."""
        at, found = self._probe(ids)
        self.keys[at[found]] = GONE
        self.live -= int(found.sum())

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of every live id."""
        live = self.keys >= 0
        return self.keys[live], self.rows[live]

    def _rebuild(self, want: int) -> None:
        """A table for ``want`` live ids at most a third full, the live ones moved in."""
        ids, rows = self.items()
        self._make(max(MIN_SLOTS, 1 << (3 * max(1, want) - 1).bit_length()))
        self.live = 0
        if len(ids):
            self.insert(ids, rows)

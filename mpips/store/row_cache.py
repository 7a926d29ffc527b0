"""A worker's cache of the hottest rows of its dynamic tables (``tables.cache_rows``): a
step asks the PS tasks only for the ids the cache does not hold fresh, so the ids every
batch has (a Zipf head) stop costing the PS a lookup each step.

A cached row is at most ``max_age`` of this worker's steps old: older, it is asked for
again. This worker's own push refreshes the rows it cached (the PS answers a push with the
rows it applied it to), so a cached row misses only the other workers' updates of its
last ``max_age`` steps: a bounded staleness, as ``train.max_staleness`` bounds a dense
pull's. Which ids are hot: this worker's count of its pulls of each (a count-min sketch, as
admission's); a new id takes the place of the cached one pulled least often, if it was
pulled more often. Evaluation pulls bypass the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .dynamic_rows import Sketch
from .id_map import IdMap

SKETCH_BITS = 16  # a worker's sketch: 2 x 2^16 counters (512 KB)


class RowCache:
    """Rows of every dynamic table (by name: ``widths``, ``dtypes``) for ``capacity`` ids."""

    def __init__(
        self,
        names: Sequence[str],
        widths: Sequence[int],
        dtype: np.dtype,
        capacity: int,
        max_age: int,
    ):
        self.capacity, self.max_age = capacity, max_age
        self.map = IdMap(2 * capacity)
        self.rows = {n: np.zeros((capacity, w), dtype) for n, w in zip(names, widths, strict=True)}
        self.ids = np.full(capacity, -1, np.int64)
        self.fetched = np.zeros(capacity, np.int64)  # the clock its row was read at
        self.score = np.full(capacity, -1, np.int64)  # its pulls (-1: an empty slot)
        self.sketch = Sketch(SKETCH_BITS)
        self.clock = 0  # this worker's training pulls
        self.hits = self.looked = 0

    def split(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A training pull of unique ``ids``: (positions whose rows are cached fresh, their
        slots); counts the pull of every id."""
        self.clock += 1
        counts = self.sketch.add(ids, exact=False)
        slot = self.map.find(ids)
        held = np.flatnonzero(slot >= 0)
        self.score[slot[held]] = counts[held]
        fresh = held[self.clock - self.fetched[slot[held]] <= self.max_age]
        self.hits += len(fresh)
        self.looked += len(ids)
        self._counts = counts
        return fresh, slot[fresh]

    def read(self, slots: np.ndarray, at: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """The cached rows of ``slots`` into positions ``at`` of ``out``."""
        for name, rows in self.rows.items():
            out[name][at] = rows[slots]

    def store(self, ids: np.ndarray, at: np.ndarray, out: dict[str, np.ndarray]) -> None:
        """Rows just read from the PS tasks (``out`` at positions ``at``, for ``ids[at]``,
        each an id with a row there: one not admitted reads a zero row that is not its):
        a cached id's row is refreshed, a hot new id's row cached."""
        got, counts = ids[at], self._counts[at]
        slot = self.map.find(got)
        have = slot >= 0
        self._write(slot[have], at[have], out)
        new = np.flatnonzero(~have)
        new = new[counts[new] > self.score.min()]  # (only those that would take a place)
        if not new.size:
            return
        new = new[np.argsort(-counts[new], kind="stable")][: self.capacity]
        victims = np.argpartition(self.score, len(new) - 1)[: len(new)]
        victims = victims[np.argsort(self.score[victims], kind="stable")]
        take = counts[new] > self.score[victims]  # (an empty slot's score is -1)
        new, victims = new[take], victims[take]
        if not new.size:
            return
        old = self.ids[victims]
        self.map.remove(old[old >= 0])
        self.ids[victims], self.score[victims] = got[new], counts[new]
        self.map.insert(got[new], victims)
        self._write(victims, at[new], out)

    def _write(self, slots: np.ndarray, at: np.ndarray, out: dict[str, np.ndarray]) -> None:
        for name, rows in self.rows.items():
            rows[slots] = out[name][at]
        self.fetched[slots] = self.clock

    def refresh(self, ids: np.ndarray, rows: dict[str, np.ndarray], found: np.ndarray) -> None:
        """Rows the PS tasks applied this worker's push to: those cached are refreshed; a
        cached id that has no row there any more (``found`` False: evicted) leaves."""
        slot = self.map.find(ids)
        have = np.flatnonzero((slot >= 0) & found)
        self._write(slot[have], have, rows)
        gone = np.flatnonzero((slot >= 0) & ~found)
        if gone.size:
            self.map.remove(ids[gone])
            self.ids[slot[gone]], self.score[slot[gone]] = -1, -1

    def cached(self, ids: np.ndarray) -> np.ndarray:
        """The positions of ``ids`` that are cached."""
        return np.flatnonzero(self.map.find(ids) >= 0)

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.looked)

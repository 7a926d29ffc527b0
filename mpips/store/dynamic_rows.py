"""A dynamic table's rows on one PS task (``tables.kind = "dynamic"``): ids of any value up
to 2^63 map to rows without collisions, a row is made the first time its id is admitted,
and rows are evicted by age or, when the task's ``capacity`` is reached, by use.

Every id has one owner, the PS task ``owner_of(id)`` (a hash of the id, not the id modulo
the task count: ids of one feature often share their low bits). Its row there lives in
this process's memory, not in a window: workers never address it, they ask for ids and get
rows (store/lookups.py). The map (id -> row) is a numpy hash table (id_map.py), the rows,
slots and each row's id, last step and use count numpy arrays that grow by doubling; a freed
row is reused.

Admission (``min_count``): an id's pulls are counted in a count-min sketch (two rows of
2^20 int32 counters: a fixed 8 MB, an estimate that may count an id high, never low); an id
pulled fewer times reads a zero row and its gradients are dropped. A training pull counts;
an evaluation's does not, and makes no row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .id_map import IdMap, mix64
from .rules import Apply

MAX_ID = (1 << 63) - 1  # ids are int64 >= 0
SKETCH_BITS = 20  # counters per row of the admission sketch: 2^20
# (ids) -> by table, {"": the ids' initial rows, <slot>: their initial slot values}
Initial = Callable[[np.ndarray], dict[str, dict[str, np.ndarray]]]


def owner_of(ids: np.ndarray, num_ps: int) -> np.ndarray:
    """The PS task that holds each id's row (the same on every rank, in every run)."""
    return (mix64(ids, 1) % np.uint64(num_ps)).astype(np.int64)


@dataclass(frozen=True)
class Policy:
    """When a row is made and when it goes (the job's [tables] section)."""

    capacity: int = 0  # rows at most on one PS task (0: no limit)
    min_count: int = 1  # training pulls of an id before it gets a row
    ttl_steps: int = 0  # a row not pulled for this many global steps is evicted (0: never)


@dataclass
class Counts:
    """What a table did on one PS task, for the summaries and the end-of-run line."""

    created: int = 0
    evicted_age: int = 0
    evicted_full: int = 0
    not_admitted: int = 0  # training pulls of ids below min_count (read a zero row)
    dropped: int = 0  # gradient rows of ids with no row (not admitted, or evicted since)

    def line(self, live: int) -> str:
        return (
            f"{live} rows live, {self.created} made, {self.evicted_age} evicted by age, "
            f"{self.evicted_full} evicted at capacity, {self.not_admitted} pulls not admitted, "
            f"{self.dropped} gradient rows dropped"
        )


class Sketch:
    """A count-min sketch of how often ids were pulled (admission)."""

    def __init__(self, bits: int = SKETCH_BITS):
        self.mask = np.uint64((1 << bits) - 1)
        self.counts = np.zeros((2, 1 << bits), np.int32)
        # every counter halved after this many ids counted (TinyLFU's reset): the counts
        # stay those of recent pulls, and a full sketch does not admit every id
        self.period, self.added = 8 << bits, 0

    def add(self, ids: np.ndarray, exact: bool = True) -> np.ndarray:
        self.added += len(ids)
        if self.added >= self.period:
            self.counts >>= 1
            self.added = 0
        return self._add(ids, exact)

    def _add(self, ids: np.ndarray, exact: bool) -> np.ndarray:
        """Count one more pull of each (unique) id; the estimated counts after it. Not
        ``exact``: two ids of one call that share a counter add one to it, not two (3x
        faster; a worker's cache, where a count only ranks ids)."""
        out = None
        for k in range(2):
            at = (mix64(ids, 2 + k) & self.mask).astype(np.int64)
            if exact:
                np.add.at(self.counts[k], at, 1)
                got = self.counts[k][at]
            else:
                got = self.counts[k][at] + 1
                self.counts[k][at] = got
            out = got if out is None else np.minimum(out, got)
        assert out is not None
        return out


@dataclass
class DynamicRows:
    """The rows of a PS task's dynamic tables (and their optimizer slots): one id map for
    all of them (every table of a task serves the same ids, so one decision makes, keeps or
    evicts an id's row in each), and a row of each table for each live id."""

    widths: dict[str, int]  # by table name: elements of a row
    dtype: np.dtype  # the model's: what pulls read and pushes bring
    slot_names: Sequence[str]
    initial: Initial  # ids -> {table: {"": rows, <slot>: values}}
    policy: Policy = field(default_factory=Policy)
    # how the rows are stored (None: ``dtype``); float16 halves them, and every update is
    # computed in ``dtype`` and stored rounded
    storage: np.dtype | None = None
    rowwise: bool = False  # one slot value a row (row-wise Adagrad), not one a value

    def __post_init__(self) -> None:
        self.map = IdMap()
        self.counts = Counts()
        self.rows = {
            t: np.zeros((0, w), self.storage or self.dtype) for t, w in self.widths.items()
        }
        self.slots = {
            t: {s: np.zeros((0, 1 if self.rowwise else w), self.dtype) for s in self.slot_names}
            for t, w in self.widths.items()
        }
        self.ids = np.zeros(0, np.int64)  # each row's id (-1: free)
        self.last = np.zeros(0, np.int64)  # the global step it was last pulled or pushed at
        self.uses = np.zeros(0, np.int64)  # its training pulls and pushes
        self._free: list[int] = []
        self._sketch = Sketch() if self.policy.min_count > 1 else None
        self._expired = -(1 << 62)  # the step rows were last expired at
        self._decay = self.policy.capacity  # rows made when use counts are halved next

    @property
    def live(self) -> int:
        return len(self.map)

    def lookup(
        self, ids: np.ndarray, out: dict[str, np.ndarray], step: int, train: bool = True
    ) -> np.ndarray:
        """The rows of unique ``ids`` into ``out`` (by table; zero for ids with none). A
        training pull (``train``) counts them, makes the rows of ids now admitted and marks
        every row it reads as used at ``step``; any other pull only reads. Returns which ids
        have a row."""
        at = self.map.find(ids)
        if train:
            new = np.flatnonzero(at < 0)
            if new.size:
                at[new] = self._admit(ids[new], step, at[at >= 0])
        have = at >= 0
        rows = at[have]
        for t, a in self.rows.items():
            out[t][have] = a[rows]
            out[t][~have] = 0
        if train:
            self.last[rows] = step
            self.uses[rows] += 1
            self.counts.not_admitted += int(len(ids) - len(rows))
        return have

    def _admit(self, ids: np.ndarray, step: int, keep: np.ndarray) -> np.ndarray:
        """Rows for the ``ids`` that have none and are admitted now (-1 for the others),
        made from the initial values; ``keep``: rows this pull reads, never evicted for them."""
        at = np.full(len(ids), -1, np.int64)
        ok = np.ones(len(ids), bool)
        if self._sketch is not None:
            ok = self._sketch.add(ids) >= self.policy.min_count
        take = np.flatnonzero(ok)
        if not take.size:
            return at
        rows = self._allocate(len(take), step, keep)
        self._set(rows, ids[take], self.initial(ids[take]), step)
        self.counts.created += len(take)
        if self._decay and self.counts.created >= self._decay:  # (uses: recent ones count)
            self.uses >>= 1
            self._decay = self.counts.created + self.policy.capacity
        at[take] = rows
        return at

    def _set(self, rows: np.ndarray, ids: np.ndarray, values: dict, step: int) -> None:
        """Rows ``rows`` become those of ``ids``: ``values[table]`` ("" and each slot)."""
        for t, a in self.rows.items():
            a[rows] = values[t][""]
            for s in self.slot_names:
                self.slots[t][s][rows] = values[t][s]
        self.ids[rows], self.last[rows], self.uses[rows] = ids, step, 0
        self.map.insert(ids, rows)

    def _allocate(self, n: int, step: int, keep: np.ndarray) -> np.ndarray:
        """``n`` free rows: free ones, then new ones up to the capacity, then the least used
        rows (oldest first among equals), evicted, but never one of ``keep``."""
        cap = self.policy.capacity
        if len(self._free) < n:
            size = len(self.ids)
            want = max(2 * size, size + n - len(self._free), 1024)
            self._grow(min(want, cap) if cap else want)
        if len(self._free) < n:  # at capacity: evict a 64th of it at once, or what is needed
            never = np.iinfo(np.int64).max
            # least used first, the oldest first among equals: one key, uses then last step
            key = self.uses * (int(self.last.max(initial=0)) + 1) + self.last
            key[self.ids < 0] = never
            key[keep] = never
            need = n - len(self._free)
            evictable = int((key < never).sum())
            if need > evictable:
                raise ValueError(
                    f"dynamic tables: {n} new rows in one pull exceed what tables.capacity "
                    f"= {cap} leaves free (raise it above the rows one batch touches)"
                )
            k = min(evictable, max(need, cap // 64))
            self.counts.evicted_full += self._evict(np.argpartition(key, k - 1)[:k])
        rows = np.array(self._free[-n:][::-1], np.int64)
        del self._free[-n:]
        return rows

    def _grow(self, size: int) -> None:
        """Room for ``size`` rows; the new ones free."""
        old = len(self.ids)
        if size <= old:
            return

        def grown(a: np.ndarray, fill: int = 0) -> np.ndarray:
            b = np.full((size, *a.shape[1:]), fill, a.dtype)
            b[:old] = a
            return b

        self.rows = {t: grown(a) for t, a in self.rows.items()}
        self.slots = {t: {s: grown(a) for s, a in held.items()} for t, held in self.slots.items()}
        self.ids, self.last, self.uses = grown(self.ids, -1), grown(self.last), grown(self.uses)
        self._free[:0] = range(size - 1, old - 1, -1)  # (taken from the end: low rows first)

    def _evict(self, rows: np.ndarray) -> int:
        """Free ``rows``; how many."""
        self.map.remove(self.ids[rows])
        self.ids[rows] = -1
        self._free.extend(rows.tolist())
        return len(rows)

    def expire(self, step: int) -> None:
        """Evict the rows not used for ``policy.ttl_steps`` global steps (0: none), looked
        for each time the step moved on by an eighth of them."""
        ttl = self.policy.ttl_steps
        if not ttl or step - self._expired < max(1, ttl // 8):  # (a scan of every row)
            return
        self._expired = step
        old = np.flatnonzero((self.ids >= 0) & (self.last < step - ttl))
        if old.size:
            self.counts.evicted_age += self._evict(old)

    def update(
        self,
        ids: np.ndarray,
        grads: dict[str, np.ndarray],
        apply: Apply | None,
        lr: float,
        t: int,
        step: int | None = None,
        answer: int = 0,
    ) -> np.ndarray:
        """Apply one pushed gradient (by table, a row an id): ``apply`` with ``lr`` and
        ``t`` to the rows of ``ids`` and their slots (None: plain SGD, the grads are deltas,
        added); the rows count as used at ``step`` (a worker that caches a row pushes it
        without pulling it). Rows of ids with no row (not admitted, or evicted since the
        pull) are dropped. ``answer``: the grads of the first ``answer`` ids then hold
        their rows as stored now (zero where dropped), for the worker's cache. Returns
        which ids have a row."""
        found = self.map.find(ids)
        have = found >= 0
        self.counts.dropped += int(len(ids) - have.sum())
        at = found[have]
        for name, rows in self.rows.items():
            g = grads[name][have] if len(at) < len(ids) else grads[name]
            v = rows[at].astype(g.dtype)  # (float16 rows: computed in float32)
            if apply is None:
                v += g
            else:
                held = self.slots[name]
                s = {k: a[at] for k, a in held.items()}
                apply(v, g, s, lr, t)
                for k, a in held.items():
                    a[at] = s[k]
            rows[at] = v
            if answer:
                first, ok = found[:answer], have[:answer]
                grads[name][:answer][ok] = rows[first[ok]]
                grads[name][:answer][~ok] = 0
        if step is not None:
            self.last[at] = step
            self.uses[at] += 1
        return have

    def live_arrays(self) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, dict]]:
        """(ids, rows by table, slots by table) of every live id, in id order (a shard)."""
        at = np.flatnonzero(self.ids >= 0)
        at = at[np.argsort(self.ids[at], kind="stable")]
        rows = {t: a[at] for t, a in self.rows.items()}
        slots = {t: {s: a[at] for s, a in held.items()} for t, held in self.slots.items()}
        return self.ids[at], rows, slots

    def load(self, ids: np.ndarray, values: dict[str, dict[str, np.ndarray]], step: int) -> None:
        """Take these rows (a restore): by table, "" the rows and each slot's values."""
        if len(ids):
            self._set(self._allocate(len(ids), step, np.zeros(0, np.int64)), ids, values, step)

    def nbytes(self) -> int:
        """Bytes held beyond the id map: the rows, slots and per-row words allocated."""
        held = [*self.rows.values(), self.ids, self.last, self.uses]
        held += [a for slots in self.slots.values() for a in slots.values()]
        return sum(a.nbytes for a in held)

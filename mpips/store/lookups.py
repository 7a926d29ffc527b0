"""Dynamic tables over MPI: a worker asks a PS task for the rows of ids, and posts their
gradients back; the PS keeps the rows in its own memory (dynamic_rows.py).

One more window, allocated on the PS ranks (the workers' part is empty). Per worker it has
three int64 words, ``[lookup flag, push flag, learning rate]``, then two boxes, each
``[count | ids | one block of rows per table]`` for at most ``capacity`` ids (the most
unique ids one batch can touch): the lookup box, whose rows the PS fills, and the push box,
whose rows are the worker's gradients. Every table of a task serves the same ids (an id's
owner is a hash of the id alone), so one list of ids serves them all.

A pull: the worker Puts the ids it needs from each PS task into its lookup box there,
flushes, raises the lookup flag (an atomic; 2 for a training pull, which counts, admits
and makes rows, 1 for an evaluation's read), and goes on with the dense variables; the PS,
polling its flags with its mail, writes the rows into the box and clears the flag; the
worker, polling with plain Gets as the mailbox does, then Gets the rows. A push: ids and
gradient rows into the push box, the learning rate, the push flag; the PS applies them
with the optimizer's rule (plain SGD: adds the deltas) and clears it. A worker's push is
applied before its next lookup is answered (the PS looks at the push flag first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
from mpi4py import MPI

from ..errors import DataError, Stalled
from ..placement.table import align
from ..process.waits import poll
from .cluster import peek, stall_limit, stall_timeout
from .dynamic_rows import MAX_ID, DynamicRows, owner_of
from .row_cache import RowCache
from .rules import Apply

LOOKUP, PUSH, LR, CACHED, WORDS = 0, 1, 2, 3, 4  # a worker's int64 words
TRAIN, READ = 2, 1  # a lookup flag's values
NO_ROW = -1  # what an answer puts in place of an id with no row (not admitted, evicted)
FAST_SECONDS = 0.02  # how long a worker looks every 50 us for an answer (as the mailbox)


@dataclass(frozen=True)
class DynamicSpec:
    """A dynamic table as both ends see it."""

    name: str
    width: int
    dtype: np.dtype


class _Box:
    """``[count | ids | rows of each table]`` for ``capacity`` ids, at byte ``start``."""

    def __init__(self, start: int, capacity: int, tables: Sequence[DynamicSpec]):
        self.count = start
        self.ids = align(start + 8)
        at = align(self.ids + 8 * capacity)
        self.rows: dict[str, int] = {}
        for t in tables:
            self.rows[t.name] = at
            at = align(at + capacity * t.width * t.dtype.itemsize)
        self.end = at


class Lookups:
    """The window of dynamic tables (collective to make and to free) and its layout."""

    def __init__(
        self,
        comm: MPI.Intracomm,
        ps_ranks: Sequence[int],
        tables: Sequence[DynamicSpec],
        capacity: int,
        cache: tuple[int, int] = (0, 0),
    ):
        """``cache``: (rows, steps) of each worker's cache of hot rows (row_cache.py)."""
        self.tables, self.capacity = list(tables), max(1, capacity)
        self.cache = cache
        self.ps_ranks = list(ps_ranks)
        self.num_workers = comm.size - len(self.ps_ranks)
        self.words = align(8 * WORDS * self.num_workers)
        self.boxes: list[tuple[_Box, _Box]] = []
        at = self.words
        for _ in range(self.num_workers):
            lookup = _Box(at, self.capacity, self.tables)
            push = _Box(lookup.end, self.capacity, self.tables)
            self.boxes.append((lookup, push))
            at = push.end
        self.nbytes = at
        mine = self.nbytes if comm.rank in self.ps_ranks else 0
        self.win = MPI.Win.Allocate(mine, 1, comm=comm)
        # (mpi4py's stub gives MPI.buffer its __buffer__ only for Python >= 3.12)
        self.memory = np.frombuffer(self.win.tomemory(), np.uint8)  # type: ignore[call-overload]
        if mine:
            self.memory[:] = 0
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self._open = True

    def word(self, worker: int, which: int) -> int:
        return 8 * (WORDS * worker + which)

    def free(self) -> None:
        """Close the epoch and free the window (collective). Safe to call twice."""
        if self._open:
            self._open = False
            self.win.Unlock_all()
            self.win.Free()


class DynamicClient:
    """A worker's end: rows for ids, gradients for them."""

    def __init__(self, lookups: Lookups, task: int):
        self.lk, self.task = lookups, task
        self.lookup_box, self.push_box = lookups.boxes[task]
        self._asked: list[tuple[int, np.ndarray]] = []  # (ps task, positions) of a pull
        self._pushed: list[int] = []  # the ranks a push is posted to
        self._routes: list[tuple[int, np.ndarray]] = []  # the last training pull's
        rows, steps = lookups.cache
        self.cache = (
            RowCache(
                [t.name for t in lookups.tables],
                [t.width for t in lookups.tables],
                lookups.tables[0].dtype,
                rows,
                steps,
            )
            if rows and lookups.tables
            else None
        )
        self._ids = np.zeros(0, np.int64)  # the last pull's ids
        self._hit: tuple[np.ndarray, np.ndarray] | None = None  # (positions, cache slots)

    def route(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(ps task, positions in ``ids``) of every task that owns some of them."""
        owner = owner_of(ids, len(self.lk.ps_ranks))
        return [
            (p, at) for p in range(len(self.lk.ps_ranks)) if (at := np.flatnonzero(owner == p)).size
        ]

    def ask(self, ids: np.ndarray, train: bool) -> None:
        """Post a lookup of unique ``ids`` (at most ``capacity``) to the tasks that own them
        (a training pull with a cache: of those it does not hold fresh)."""
        if len(ids) and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() > MAX_ID):
            bad = ids[(ids < 0) | (ids > MAX_ID)][:1].tolist() or [ids.dtype]
            raise DataError(
                f"a dynamic table's ids are integers in [0, 2^63); this batch has {bad[0]} "
                f"(padding? drop it from the batch, or map it to an id of its own)"
            )
        ids = ids.astype(np.int64, copy=False)
        self._ids, self._hit = ids, None
        self._asked = self.route(ids)
        if train:
            self._routes = self._asked  # (every gradient row is pushed)
        if train and self.cache is not None:
            self._hit = self.cache.split(ids)
            miss = np.ones(len(ids), bool)
            miss[self._hit[0]] = False
            left = np.flatnonzero(miss)
            self._asked = [(p, left[at]) for p, at in self.route(ids[left])]
        self._send(ids, self._asked, TRAIN if train else READ)

    def _send(self, ids: np.ndarray, asked: list[tuple[int, np.ndarray]], flag: int) -> None:
        """Put ``ids`` at positions ``asked`` into the lookup boxes; raise the flags."""
        win, box, staged = self.lk.win, self.lookup_box, []
        for p, at in asked:
            rank, sent = self.lk.ps_ranks[p], np.ascontiguousarray(ids[at], np.int64)
            staged += [np.array([len(at)], np.int64), sent]
            win.Put([staged[-2], MPI.BYTE], rank, [box.count, 8, MPI.BYTE])
            win.Put([sent, MPI.BYTE], rank, [box.ids, sent.nbytes, MPI.BYTE])
        self._raise([p for p, _ in asked], LOOKUP, flag)

    def _raise(self, tasks: list[int], which: int, value: int) -> None:
        """Flush what was Put to ``tasks``, then raise this worker's flag ``which`` there."""
        win, old = self.lk.win, np.zeros(1, np.int64)
        ranks = [self.lk.ps_ranks[p] for p in tasks]
        for rank in ranks:
            win.Flush(rank)  # the box is in place before the flag
        flag = np.array([value], np.int64)
        for rank in ranks:
            win.Fetch_and_op(flag, old, rank, self.lk.word(self.task, which), MPI.REPLACE)
        for rank in ranks:
            win.Flush(rank)

    def receive(self, out: dict[str, np.ndarray]) -> None:
        """Wait for the lookup posted last, and Get its rows into ``out`` (by table, a row
        per id asked, in the order asked). With a cache, the rest from it: refreshed by the
        last push (settled since the lookup was posted); a cached id the push's answer
        found without a row (evicted) is asked for now."""
        answered = self._fetch(self._asked, out)
        if self._hit is None:
            return
        assert self.cache is not None
        hit, slots = self._hit
        self.cache.read(slots, hit, out)
        asked = np.concatenate([at for _, at in self._asked] or [np.zeros(0, np.int64)])
        self.cache.store(self._ids, asked[answered != NO_ROW], out)
        gone = hit[self.cache.ids[slots] != self._ids[hit]]
        if gone.size:  # (left the cache since: rare)
            again = [(p, gone[at]) for p, at in self.route(self._ids[gone])]
            self._send(self._ids, again, TRAIN)
            self._fetch(again, out)

    def _fetch(self, asked: list[tuple[int, np.ndarray]], out: dict[str, np.ndarray]) -> np.ndarray:
        """Wait for the answer to the lookup of ``asked`` and Get its rows into ``out`` at
        those positions; the ids as answered (NO_ROW where an id has none)."""
        self._wait([p for p, _ in asked], LOOKUP, "answer this worker's lookup")
        win, box, got, answered = self.lk.win, self.lookup_box, [], []
        for p, at in asked:
            rank = self.lk.ps_ranks[p]
            for t in self.lk.tables:
                staged = np.empty((len(at), t.width), t.dtype)
                win.Get([staged, MPI.BYTE], rank, [box.rows[t.name], staged.nbytes, MPI.BYTE])
                got.append((out[t.name], at, staged))
            if self.cache is not None:
                answered.append(np.empty(len(at), np.int64))
                win.Get([answered[-1], MPI.BYTE], rank, [box.ids, 8 * len(at), MPI.BYTE])
        for p, _ in asked:
            win.Flush(self.lk.ps_ranks[p])
        for rows, at, staged in got:
            rows[at] = staged
        return np.concatenate(answered or [np.zeros(0, np.int64)])

    def post(self, ids: np.ndarray, grads: dict[str, np.ndarray], lr: float) -> None:
        """Post the gradient rows (by table, a row per id of the last training pull) to the
        tasks that own their ids; ``wait_applied`` waits for them. With a cache, the ids it
        holds go first, and their count: the PS task answers with those rows."""
        win, box, staged = self.lk.win, self.push_box, []
        tasks = [p for p, _ in self._routes]
        self._pushed_ids, self._pushed_routes = ids, []
        lr_word = np.array([lr], np.float64).view(np.int64)
        for p, at in self._routes:
            rank, cached = self.lk.ps_ranks[p], 0
            if self.cache is not None:
                held = self.cache.cached(ids[at])
                cached = len(held)
                rest = np.ones(len(at), bool)
                rest[held] = False
                at = np.concatenate([at[held], at[rest]])
            self._pushed_routes.append((p, at, cached))
            count, sent = np.array([len(at)], np.int64), np.ascontiguousarray(ids[at], np.int64)
            first = np.array([cached], np.int64)
            staged += [count, sent, first]
            win.Put([count, MPI.BYTE], rank, [box.count, 8, MPI.BYTE])
            win.Put([sent, MPI.BYTE], rank, [box.ids, sent.nbytes, MPI.BYTE])
            for t in self.lk.tables:
                staged.append(np.ascontiguousarray(grads[t.name][at]))
                win.Put(
                    [staged[-1], MPI.BYTE], rank, [box.rows[t.name], staged[-1].nbytes, MPI.BYTE]
                )
            win.Put([lr_word, MPI.BYTE], rank, [self.lk.word(self.task, LR), 8, MPI.BYTE])
            win.Put([first, MPI.BYTE], rank, [self.lk.word(self.task, CACHED), 8, MPI.BYTE])
        self._raise(tasks, PUSH, 1)
        self._pushed = tasks

    def wait_applied(self) -> None:
        """Until every task the last push went to has applied it (with a cache: then the
        rows it applied it to refresh those cached)."""
        tasks, self._pushed = self._pushed, []
        self._wait(tasks, PUSH, "apply this worker's gradient rows")
        if self.cache is None or not tasks:
            return
        win, box, got = self.lk.win, self.push_box, []
        for p, at, cached in self._pushed_routes:
            if not cached:
                continue
            rank = self.lk.ps_ranks[p]
            rows = {t.name: np.empty((cached, t.width), t.dtype) for t in self.lk.tables}
            for t in self.lk.tables:
                win.Get(
                    [rows[t.name], MPI.BYTE],
                    rank,
                    [box.rows[t.name], rows[t.name].nbytes, MPI.BYTE],
                )
            answered = np.empty(cached, np.int64)  # (NO_ROW: the id has no row now)
            win.Get([answered, MPI.BYTE], rank, [box.ids, answered.nbytes, MPI.BYTE])
            got.append((self._pushed_ids[at[:cached]], rows, answered))
        for p, _, cached in self._pushed_routes:
            if cached:
                win.Flush(self.lk.ps_ranks[p])
        for ids, rows, answered in got:
            self.cache.refresh(ids, rows, answered != NO_ROW)

    def _wait(self, tasks: list[int], which: int, what: str) -> None:
        win, at = self.lk.win, self.lk.word(self.task, which)  # (a byte displacement)
        out, pending = np.zeros(1, np.int64), list(tasks)

        def done() -> bool:
            pending[:] = [p for p in pending if peek(win, self.lk.ps_ranks[p], at, out)]
            return not pending

        def late(waited: float) -> NoReturn:
            names = ", ".join(f"/job:ps/task:{p}" for p in pending)
            raise Stalled(
                f"{names} did not {what} within {stall_timeout():.0f} s: hung? "
                f"(MPIPS_STALL_TIMEOUT sets the limit); aborting the job"
            )

        poll(done, stall_limit(self.task), late, fast=FAST_SECONDS)


class DynamicServer:
    """A PS task's end: answers lookups and applies pushes, from its own memory."""

    def __init__(
        self,
        lookups: Lookups,
        rows: DynamicRows,
        apply: Apply | None,
        t: int,
    ):
        self.lk, self.rows, self.apply, self.t = lookups, rows, apply, t
        self.step = t  # the global step, as last read (DynamicRows.last)
        self._report: Callable[[int, dict[str, float]], None] | None = None
        self._every, self._next = 0, 0
        memory = lookups.memory
        self.words = memory[: lookups.words].view(np.int64)
        self.views = []
        for lookup, push in lookups.boxes:
            self.views.append((self._views(memory, lookup), self._views(memory, push)))

    def _views(self, memory: np.ndarray, box: _Box) -> tuple[np.ndarray, np.ndarray, dict]:
        cap = self.lk.capacity
        rows = {
            t.name: memory[box.rows[t.name] : box.rows[t.name] + cap * t.width * t.dtype.itemsize]
            .view(t.dtype)
            .reshape(cap, t.width)
            for t in self.lk.tables
        }
        return (
            memory[box.count : box.count + 8].view(np.int64),
            memory[box.ids : box.ids + 8 * cap].view(np.int64),
            rows,
        )

    def sweep(self) -> bool:
        """Apply every push and answer every lookup posted now; whether there was one."""
        win, busy = self.lk.win, False
        win.Sync()  # loads of its own memory see what the workers wrote
        for k in range(self.lk.num_workers):
            base = WORDS * k
            # the lookup flag first: a push the worker raised before it is then seen too,
            # and applied before the lookup is answered
            flag = int(self.words[base + LOOKUP])
            if flag:
                win.Sync()
            if self.words[base + PUSH]:
                count, ids, grads = self.views[k][1]
                n = int(count[0])
                lr = float(self.words[base + LR : base + LR + 1].view(np.float64)[0])
                self.t += 1
                cached = int(self.words[base + CACHED])  # (its first ids: answered with rows)
                got = {name: g[:n] for name, g in grads.items()}
                have = self.rows.update(ids[:n], got, self.apply, lr, self.t, self.step, cached)
                ids[:cached][~have[:cached]] = NO_ROW  # (the worker's cache drops them)
                self._clear(base + PUSH)
                busy = True
            if flag:
                count, ids, rows = self.views[k][0]
                n = int(count[0])
                out = {name: r[:n] for name, r in rows.items()}
                have = self.rows.lookup(ids[:n], out, self.step, flag == TRAIN)
                ids[:n][~have] = NO_ROW  # (read back by a worker's cache: not cached)
                self._clear(base + LOOKUP)
                busy = True
        return busy

    def _clear(self, word: int) -> None:
        """The answer is in place (visible) before the flag clears."""
        self.lk.win.Sync()
        self.words[word] = 0
        self.lk.win.Sync()

    def reports(self, record: Callable[[int, dict[str, float]], None], every: int) -> None:
        """Hand ``record(step, values)`` each table's counts every ``every`` global steps
        (the PS task's summaries: ``tables/<name>/live``, ``.../made``, ...)."""
        self._report, self._every, self._next = record, every, self.step + every

    def tick(self, step: int) -> None:
        """The global step now: rows pulled from now on are marked with it; old ones expire;
        the counts are reported when due."""
        self.step = step
        self.rows.expire(step)
        if self._report is not None and self._every and step >= self._next:
            self._next = step + self._every
            self._report(step, self.counts())

    def counts(self) -> dict[str, float]:
        """The rows' counts so far, by summary name (``tables/live``, ``tables/created``,
        ...: every dynamic table of a task has a row for each live id)."""
        return {"tables/live": self.rows.live} | {
            f"tables/{key}": value for key, value in vars(self.rows.counts).items()
        }

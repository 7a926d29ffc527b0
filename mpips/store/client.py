"""Worker side of the store: pull (Get) and push (Accumulate, or inbox + mailbox for stateful
optimizers) of the whole variables, and of the rows a batch touches in partitioned tables.
With zero copy the pull reads the PS's memory in place and the push applies the rule there
(stripes.py).

All whole variables of one PS are contiguous in its window, so their pull is one ``Get`` per
PS and their push one ``Accumulate`` (or one ``Put``) per PS and dtype run, whatever the
number of variables. Table rows move with one ``Get`` / ``Accumulate`` per PS and table too:
an indexed datatype names every row the batch needs from that PS's partition.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import groupby
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ..device.pages import grown, page_aligned, page_zeros
from ..placement.table import Placed, Placement, owner_and_row, views
from .control import RunControl
from .lookups import DynamicClient
from .mailbox import WorkerMail
from .rules import Apply
from .window import Windows

if TYPE_CHECKING:
    from .stripes import Stripes


@dataclass
class Table:
    """A partitioned table as a worker sees it: its parts (one per PS task) and how ids map."""

    name: str
    parts: list[Placed]
    num_rows: int
    width: int  # elements per row
    dtype: np.dtype
    rule: str  # "mod" or "div"
    # the data ids its rows serve, [first, first + num_rows) (None: ids are its rows)
    span: tuple[int, int] | None = None

    @cached_property
    def base(self) -> MPI.Datatype:
        """The predefined MPI type of one element."""
        return MPI.Datatype.fromcode(self.dtype.char)

    def route(
        self, ids: np.ndarray, ascending: bool = False, run: slice | None = None
    ) -> list[tuple[int, np.ndarray | slice, np.ndarray]]:
        """(ps task, positions in ``ids``, row in that task's part) for every task touched;
        on one PS task, the positions as a slice where they run on (all of them without a
        ``span``; with one, only the ids in it, as rows ``id - first``: ``run`` where known,
        else found by bisection where the ids are ``ascending``)."""
        every: np.ndarray | slice = slice(None)  # the positions of the ids routed
        if self.span is not None:
            first, stop = self.span
            if run is not None:
                every = run
            elif ascending:  # (a run of them)
                every = slice(*(int(k) for k in np.searchsorted(ids, self.span)))
            else:  # (a slice too, where they run on)
                every = np.flatnonzero((ids >= first) & (ids < stop))
                if every.size and every[-1] - every[0] + 1 == every.size:
                    every = slice(int(every[0]), int(every[-1]) + 1)
            ids = ids[every] - first
            if not ids.size:
                return []
        if len(self.parts) == 1:
            return [(0, every, ids)]
        owner, row = owner_and_row(ids, self.num_rows, len(self.parts), self.rule)
        if isinstance(every, slice) and self.span is not None:
            every = np.arange(every.start, every.stop)
        out: list[tuple[int, np.ndarray | slice, np.ndarray]] = []
        for p in range(len(self.parts)):
            mine = np.flatnonzero(owner == p)
            if mine.size:
                out.append((p, every[mine] if isinstance(every, np.ndarray) else mine, row[mine]))
        return out


@dataclass
class Routed:
    """One table's rows of the current step on one PS task: positions in the step's ids and
    rows in that task's part."""

    table: Table
    ps_task: int
    at: np.ndarray | slice
    local: np.ndarray


INT_MAX = 2**31 - 1  # (an MPI datatype's displacements are C ints)


@dataclass
class Gathered:
    """The step's rows on one PS task of every table of one element type and row width, as
    one indexed datatype (what the pull Gets and the push Accumulates there): a step makes
    one call per PS task, not one per table (DLRM's 26 tables: 26 of each, ~20 us apiece on
    one node). Its displacements count elements from ``disp`` (bytes) in the window."""

    ps_task: int
    routed: list[Routed]
    disp: int
    mpi_type: MPI.Datatype
    # the positions of the step's ids its rows are, where they run on in order in one
    # array (a row group's tables on one PS task): one copy in and out; else None
    run: slice | None = None

    @property
    def table(self) -> Table:
        return self.routed[0].table

    @property
    def rows(self) -> int:
        return sum(len(r.local) for r in self.routed)

    def free(self) -> None:
        self.mpi_type.Free()


def _run(group: list[Routed], groups: Mapping[str, str]) -> slice | None:
    """The positions of ``group``'s rows, where they are one run of one row group's array
    (``groups``: table name to its row group's)."""
    if len({groups.get(r.table.name, r.table.name) for r in group}) > 1:
        return None
    ats = [r.at for r in group if isinstance(r.at, slice) and r.at.start is not None]
    if len(ats) < len(group) or any(x.stop != y.start for x, y in zip(ats, ats[1:], strict=False)):
        return None
    return slice(ats[0].start, ats[-1].stop)


def _gather(routed: list[Routed], row_groups: Mapping[str, str] | None = None) -> list[Gathered]:
    """The routed rows as one datatype per (PS task, element type, row width), or one per
    table where their displacements would not fit one (parts not whole elements apart, or
    2^31 elements or more); ``row_groups``: the tables' row groups (``_row_groups``)."""
    groups: dict[tuple[int, str, int], list[Routed]] = {}
    for r in routed:
        groups.setdefault((r.ps_task, r.table.dtype.str, r.table.width), []).append(r)
    out = []
    for group in groups.values():
        offsets = [r.table.parts[r.ps_task].offset for r in group]
        item, width = group[0].table.dtype.itemsize, group[0].table.width
        first = min(offsets)
        counts = [len(r.local) for r in group]
        apart = np.repeat([(o - first) // item for o in offsets], counts)
        disps = np.concatenate([r.local for r in group]) * width + apart
        whole = all((o - first) % item == 0 for o in offsets)
        if len(group) > 1 and not (whole and int(disps.max(initial=0)) + width <= INT_MAX):
            out += [g for r in group for g in _gather([r], row_groups)]
            continue
        base = MPI.Datatype.fromcode(group[0].table.dtype.char)
        # a list, not an array: mpi4py converts a list of 650 ints in 10 us, an array in 45
        mpi_type = base.Create_indexed_block(width, disps.tolist()).Commit()
        out.append(
            Gathered(group[0].ps_task, group, first, mpi_type, _run(group, row_groups or {}))
        )
    return out


def _row_groups(tables: list[Table]) -> dict[str, str]:
    """Tables that serve disjoint spans of the data's ids, of one element type and row
    width, keep a step's rows in one buffer, named by the first of them: each table's rows
    at the positions of its own ids (DLRM's 26 tables: one pull buffer, one gradient buffer,
    one zeroing, not 26). By table name, the group's name."""
    groups: dict[str, str] = {}
    ends: dict[tuple[str, int], dict[str, int]] = {}  # by (dtype, width): each group's end
    for t in sorted((t for t in tables if t.span is not None), key=lambda t: t.span or (0, 0)):
        assert t.span is not None
        kind = ends.setdefault((t.dtype.str, t.width), {})
        group = next((g for g, end in kind.items() if end <= t.span[0]), t.name)
        kind[group] = t.span[1]
        groups[t.name] = group
    return groups


def _tables(placement: Placement) -> dict[str, Table]:
    """The row-partitioned tables of ``placement``, by name: their parts and routing rule."""
    tables: dict[str, Table] = {}
    for e in placement:
        if e.table and e.name not in tables:
            parts = placement.parts(e.whole.name)
            rows = parts[0].rows
            assert rows is not None  # every part of a table has its rows
            rule = "mod" if len(parts) > 1 and rows[2] > 1 else "div"
            tables[e.whole.name] = Table(
                e.whole.name,
                parts,
                e.whole.shape[0],
                int(np.prod(e.whole.shape[1:])),
                np.dtype(e.whole.dtype),
                rule,
            )
    return tables


class StoreClient:
    """Pull/push the model through host buffers laid out exactly like the PS windows.

    ``params`` and ``grads`` map whole-variable names to numpy views into those buffers: the
    model reads parameters and writes gradients in place, so no copy is made on either path.
    Tables come per step: ``pull(ids)`` adds their rows for ``ids`` and ``gradients()`` the
    matching gradient rows.
    """

    def __init__(
        self,
        windows: Windows,
        task: int,
        stateful: bool = False,
        apply: Apply | None = None,
        slot_names: Sequence[str] = (),
    ):
        """``apply`` and ``slot_names``: the optimizer's rule and slots, which a worker runs
        itself where ``windows.updates_in_place`` (zero copy, whole variables only)."""
        self.windows = windows
        self.placement = placement = windows.placement
        self.task = task
        self.stateful = stateful
        self.control = RunControl(windows)
        self.ps_ranks = windows.layout.ps_ranks
        whole = [e for e in placement.dense if e.whole is None]
        # whole variables of each PS, laid out like the start of its window: this worker's
        # buffers, or (zero copy, shared windows) the PS's own memory, read in place
        self.reads_in_place = windows.shared
        self._dense_buffers(whole)
        self._segments = _segments(self)
        self.tables = _tables(placement)
        self._parts_in_place = self._table_parts()
        self.mail = WorkerMail(windows, task)  # the mailbox protocol (stateful push)
        self.applies_in_place = windows.updates_in_place
        self._stripes: Stripes | None = None
        if self.applies_in_place:  # zero copy: this worker runs the rule on PS memory
            if apply is None:
                raise ValueError("zero copy: a worker applies its updates; give it the rule")
            self._stripes = self._in_place(whole, apply, slot_names)
        self._row_grads: dict[str, np.ndarray] = {}
        # each table's rows and row gradients, kept from pull to pull (a pull takes views of
        # their first rows) and made anew, twice as long, for a batch with more ids than any
        # before; ``on_new_buffers`` hears of each new pair (a GPU worker page-locks them)
        self._rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # tables with a span (serve_from): their names, spans' bounds, and row groups
        self._spanned: list[str] = []
        self._bounds = np.zeros(0, np.int64)
        self._groups: dict[str, str] = {}
        self._served: dict[str, slice] = {}  # each one's run of the step's ids (_route)
        self.on_new_buffers: Callable[[list[np.ndarray]], None] | None = None
        self._routed: list[Routed] = []
        self._gathered: list[Gathered] = []  # (the routed rows' datatypes: _route)
        self._posted = False  # an update is posted whose acknowledgement is not yet seen
        self.pulls = 0  # pulls made so far (whose buffers the last one filled)
        # dynamic tables (tables.kind = "dynamic"): rows asked of the PS tasks by id
        lookups = windows.lookups
        self.dynamic = DynamicClient(lookups, task) if lookups is not None else None
        self.dynamic_tables = {
            t.name: Table(t.name, [], 0, t.width, t.dtype, "hash")
            for t in (lookups.tables if lookups is not None else ())
        }
        self._dynamic_ids: np.ndarray | None = None  # the last training pull's ids
        self._dynamic_posted = False

    def _dense_buffers(self, whole: list[Placed]) -> None:
        """``params`` and ``grads``: the whole variables as views into the buffers laid out
        like each PS's window (``_live``, read in place with zero copy, and ``_grad_bufs``),
        and each split variable (layout.partition) as one full array, whose row blocks move
        straight to and from their PS tasks (``_split``)."""
        placement, windows = self.placement, self.windows
        self._live = [
            windows.shared_memory(r)[: placement.whole_bytes(p)]
            if self.reads_in_place
            else page_zeros(placement.whole_bytes(p), np.uint8)  # (a GPU page-locks them)
            for p, r in enumerate(self.ps_ranks)
        ]
        self._grad_bufs = [
            page_zeros(placement.whole_bytes(p), np.uint8) for p in range(placement.num_ps)
        ]
        self.params = views(whole, self._live)
        self.grads = views(whole, self._grad_bufs)
        self._split: list[np.ndarray] = []
        for e in placement.dense:
            if e.whole is not None and e.name not in self.params:
                self.params[e.name] = page_zeros(e.whole.shape, e.whole.dtype)
                self.grads[e.name] = page_zeros(e.whole.shape, e.whole.dtype)
                self._split += [self.params[e.name], self.grads[e.name]]

    def _table_parts(self) -> dict[tuple[str, int], np.ndarray]:
        """Zero copy: every table partition as (rows, width), in its PS's memory, by (table,
        ps task); none otherwise."""
        if not self.reads_in_place:
            return {}
        return {
            (name, p): self.windows.shared_memory(self.ps_ranks[p])[
                part.offset : part.offset + part.spec.nbytes
            ]
            .view(table.dtype)
            .reshape(-1, table.width)
            for name, table in self.tables.items()
            for p, part in enumerate(table.parts)
        }

    def _in_place(self, whole: list[Placed], apply: Apply, slot_names: Sequence[str]) -> Stripes:
        """Zero copy: the stripes through which this worker applies ``apply`` to the whole
        variables and table partitions (with their slots) in the PS tasks' memory."""
        from .stripes import Stripes  # (zero copy only)

        windows = self.windows
        shared = [windows.shared_memory(r) for r in self.ps_ranks]
        slots = views(windows.slots, shared) if windows.slots else {}
        # each table partition's slots, as (rows, width), by (slot name, ps task)
        slot_parts = {
            (e.name, e.ps_task): slots[e.spec.name].reshape(-1, int(np.prod(e.spec.shape[1:])))
            for e in windows.slots or ()
            if e.table and e.whole is not None
        }
        return Stripes(
            windows,
            self.task,
            [
                (
                    e.ps_task,
                    self.params[e.name].reshape(-1),
                    self.grads[e.name].reshape(-1),
                    {s: slots[f"{e.name}/{s}"].reshape(-1) for s in slot_names},
                )
                for e in whole
            ],
            {
                (name, p): (
                    self._parts_in_place[name, p],
                    {s: slot_parts[f"{name}/{s}", p] for s in slot_names},
                )
                for name, table in self.tables.items()
                for p in range(len(table.parts))
            },
            apply,
        )

    @property
    def nbytes(self) -> int:
        """Bytes of dense variables one pull copies (zero copy: only split variables)."""
        return sum(s.params.size for s in self._segments if not s.in_place)

    @property
    def in_place_bytes(self) -> int:
        """Bytes of dense variables read in place, in PS memory (zero copy)."""
        return sum(s.params.size for s in self._segments if s.in_place)

    def host_buffers(self) -> list[np.ndarray]:
        """The host memory a GPU worker copies from and to step after step, which it
        page-locks: the buffers a pull fills and a push reads, or with zero copy the PS
        tasks' memory of the whole variables, which its copies in read straight."""
        return [*self._live, *self._grad_bufs, *self._split]

    @property
    def pulled_bytes(self) -> int:
        """Bytes the last pull moved: the whole variables, plus the table rows (a push of SGD
        deltas moves as many)."""
        if self.reads_in_place:  # zero copy: rows are read in place too
            return self.nbytes
        return self.nbytes + sum(
            len(r.local) * r.table.width * r.table.dtype.itemsize for r in self._routed
        )

    def pull(self, ids: np.ndarray | None = None, step: bool = False) -> dict[str, np.ndarray]:
        """Read every dense variable (one Get per PS and dtype, and per row block of a split
        variable) and, given unique row ``ids``, those rows of every table (one Get per PS
        and table); returns them by name. An update this worker posted without waiting
        (``push(wait=False)``) is applied first: the pull sees it.

        The dense variables are this client's buffers, which the next pull overwrites. So
        are a training ``step``'s rows (and their gradients): the kept row buffers, which a
        GPU worker page-locks. Other pulls (an evaluation's: a whole split's ids, now and
        then) get rows of their own."""
        if ids is not None and self.tables:
            self._route(ids)  # (while the PS applies this worker's last update)
        asked = self._ask(ids, step)  # (answered while the dense variables come)
        self.settle()
        self.pulls += 1
        win = self.windows.params
        for seg in self._segments:
            if not seg.in_place:
                win.Get([seg.params, MPI.BYTE], seg.rank, [seg.offset, seg.params.size, MPI.BYTE])
        if self.reads_in_place:
            win.Sync()  # loads from the PS's memory see every update that has landed
        out = self.params
        fetched: list[tuple[Gathered, np.ndarray]] = []
        if ids is not None and (self.tables or self.dynamic_tables):
            out = {**self.params, **self._table_rows(len(ids), step)}
            if self.reads_in_place:  # zero copy: the rows straight from the PS's memory
                self._read_rows_in_place(out)
            fetched = self._get_rows()
        if fetched or self.nbytes:  # else nothing to complete (zero copy)
            for rank in self.ps_ranks:
                win.Flush(rank)
        for g, staged in fetched:
            if g.run is not None:  # (a row group's rows, in order: one copy)
                out[g.table.name][g.run] = staged
                continue
            start = 0
            for r in g.routed:
                out[r.table.name][r.at] = staged[start : start + len(r.local)]
                start += len(r.local)
        if ids is not None and self.dynamic is not None:
            self._dynamic_rows(ids, step, asked, out)
        return out

    def _get_rows(self) -> list[tuple[Gathered, np.ndarray]]:
        """Start reading the step's table rows, one call per PS task and row type; the
        buffers they land in, once flushed."""
        win, fetched = self.windows.params, []
        for g in self._gathered:
            table = g.table
            staged = np.empty((g.rows, table.width), table.dtype)
            target = [g.disp, 1, g.mpi_type]
            if self.windows.one_node:
                # an atomic read (Get_accumulate NO_OP; its origin is not read), not a Get:
                # on one node MPICH's Get through a new indexed datatype costs ~200 us of
                # CPU, this ~20 us (measured). Across nodes MPICH runs such atomics on the
                # target's CPU, so a Get (RDMA) needs no PS call there.
                origin = [np.empty_like(staged), table.base]
                win.Get_accumulate(
                    origin, [staged, table.base], self.ps_ranks[g.ps_task], target, MPI.NO_OP
                )
            else:
                win.Get([staged, table.base], self.ps_ranks[g.ps_task], target)
            fetched.append((g, staged))
        return fetched

    def _read_rows_in_place(self, out: dict[str, np.ndarray]) -> None:
        """Zero copy: the step's rows of every table read straight from the PS's memory."""
        for r in self._routed:
            part = self._parts_in_place[r.table.name, r.ps_task]
            if isinstance(r.at, slice):  # one PS task: a run of them, in order
                np.take(part, r.local, axis=0, out=out[r.table.name][r.at])
            else:
                out[r.table.name][r.at] = part[r.local]

    def _ask(self, ids: np.ndarray | None, step: bool) -> bool:
        """Post the lookup of a pull's ids in dynamic tables, if they fit one lookup box
        (an evaluation's may not: _dynamic_rows asks for them a box at a time)."""
        if ids is None or self.dynamic is None or len(ids) > self.dynamic.lk.capacity:
            return False
        self.dynamic.ask(ids, train=step)  # (a cache is refreshed by settle, before receive)
        if step:
            self._dynamic_ids = ids
        return True

    def _dynamic_rows(
        self, ids: np.ndarray, step: bool, asked: bool, out: dict[str, np.ndarray]
    ) -> None:
        """The dynamic tables' rows of ``ids`` into ``out``: the answer to the lookup
        posted (``asked``), else a box of ids at a time (never a training pull's: one batch's
        ids fit one box)."""
        assert self.dynamic is not None
        if asked:
            self.dynamic.receive(out)
            return
        if step:
            raise ValueError(
                f"{len(ids)} ids in one batch exceed the lookup box's {self.dynamic.lk.capacity}"
            )
        cap = self.dynamic.lk.capacity
        for lo in range(0, len(ids), cap):
            self.dynamic.ask(ids[lo : lo + cap], train=False)
            self.dynamic.receive({n: out[n][lo : lo + cap] for n in self.dynamic_tables})

    def _table_rows(self, n: int, step: bool) -> dict[str, np.ndarray]:
        """Where a pull of ``n`` ids puts each table's rows (a ``step``'s: the kept
        buffers), their gradient rows set beside them (``gradients()``). The tables of one
        row group (``_row_groups``) share one buffer of rows and one of gradients: each
        table's rows sit at the positions of its own ids."""
        out: dict[str, np.ndarray] = {}
        shared: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for table in [*self.tables.values(), *self.dynamic_tables.values()]:
            key = self._groups.get(table.name, table.name)
            if key not in shared:
                shape = (n, table.width)
                shared[key] = (
                    self._kept_rows(key, table, n)
                    if step
                    else (np.empty(shape, table.dtype), np.empty(shape, table.dtype))
                )
            out[table.name], self._row_grads[table.name] = shared[key]
        return out

    def _kept_rows(self, key: str, table: Table, n: int) -> tuple[np.ndarray, np.ndarray]:
        """``n`` rows of the kept buffers of ``table``'s row group (``key``): where a pull
        puts them, and where the model writes their gradients."""
        kept = self._rows.get(key)
        if kept is None or len(kept[0]) < n:
            shape = (grown(len(kept[0]) if kept else 0, n), table.width)
            kept = self._rows[key] = (
                page_aligned(shape, table.dtype),
                page_aligned(shape, table.dtype),
            )
            if self.on_new_buffers is not None:
                self.on_new_buffers(list(kept))
        return kept[0][:n], kept[1][:n]

    def _route(self, ids: np.ndarray) -> None:
        """Which rows of which PS the step's ids are, and their datatypes (made once a step;
        zero copy reads rows in place, so only a push of SGD deltas makes them there)."""
        for g in self._gathered:
            g.free()
        self._routed, self._row_grads = [], {}
        self._served = self._runs(ids)
        for table in self.tables.values():
            for p, at, local in table.route(ids, True, self._served.get(table.name)):
                self._routed.append(Routed(table, p, at, local))
        self._gathered = [] if self.reads_in_place else _gather(self._routed, self._groups)

    def _runs(self, ids: np.ndarray) -> dict[str, slice]:
        """Each table with a span: the run of the step's ids it serves (positions)."""
        if not self._spanned:
            return {}
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("tables with table_offsets: a pull's ids must be sorted and unique")
        at = np.searchsorted(ids, self._bounds).tolist()
        return {name: slice(at[2 * i], at[2 * i + 1]) for i, name in enumerate(self._spanned)}

    def cache_line(self) -> str:
        """What this worker's cache of hot rows did ('' without one)."""
        cache = self.dynamic.cache if self.dynamic is not None else None
        if cache is None:
            return ""
        return (
            f"row cache: {cache.hit_rate:.1%} of {cache.looked} ids of training pulls read "
            f"from it ({cache.capacity} rows, at most {cache.max_age} steps old)"
        )

    def serve_from(self, first_ids: Mapping[str, int]) -> None:
        """Tables that serve a part of the data's id space: by name, the data id of row 0;
        each is pulled and pushed only for the step's ids in ``[first, first + rows)``
        (the model's ``table_offsets``)."""
        for name, first in first_ids.items():
            table = self.tables[name]
            table.span = (int(first), int(first) + table.num_rows)
        self._spanned = [name for name, t in self.tables.items() if t.span is not None]
        self._bounds = np.array([self.tables[n].span for n in self._spanned], np.int64).ravel()
        self._groups = _row_groups(list(self.tables.values()))

    def gradients(self) -> dict[str, np.ndarray]:
        """Where the model writes this step's gradients: every whole variable, and the rows of
        every table for the ids of the last pull (of a table with a span: those of the ids
        it serves, so that no two tables' rows are one memory)."""
        if not self._row_grads:
            return self.grads
        served = self._served
        rows = {n: g[served[n]] if n in served else g for n, g in self._row_grads.items()}
        return {**self.grads, **rows}

    def push(
        self, lr: float = 0.0, tags: list[int] | None = None, wait: bool = True, t: int = 0
    ) -> bool:
        """Send ``gradients()`` to the PS.

        Where ``applies_in_place`` (zero copy, whole variables only): apply the optimizer's
        rule with ``lr`` and ``t`` (the 1-based update count) to the variables and slots in
        the PS's memory, a stripe at a time under its lock (stripes.py); the grads are the
        gradients. Otherwise plain SGD: the grads already hold deltas (``-lr * grad``);
        Accumulate adds them, atomically per element. Stateful optimizers (and
        sync_replicas): Put the gradient into this worker's inbox on each PS, raise its mail
        flag with ``lr`` (and ``tags[p]``, the step of PS ``p`` it is for), and wait until
        every PS has taken it (so the next pull sees this update, and the inbox is free
        again). Returns False if a PS dropped it as too late for its step (sync_replicas),
        else True. ``wait=False``: return once it is posted; the next pull, push or
        ``settle`` waits for it (the worker prepares its next batch meanwhile).
        """
        if self._stripes is not None:
            rows = [
                (r.table.name, r.ps_task, r.local, self._row_grads[r.table.name][r.at])
                for r in self._routed
            ]
            self._stripes.update(lr, t, rows)
            return True
        if self.stateful:
            self.settle()  # the inbox is free again
            self.mail.post(
                ((s.ps_task, s.offset, s.grads) for s in self._segments),
                self._row_grads,
                ((r.table.name, r.ps_task, r.at, r.local) for r in self._routed),
                lr,
                tags,
            )
            self._posted = True
            self._post_dynamic(lr)
            return self.settle() if wait else True
        win = self.windows.params
        for seg in self._segments:
            data = seg.grads.view(seg.dtype)
            mpi_type = MPI.Datatype.fromcode(seg.dtype.char)  # predefined: fast path
            win.Accumulate([data, mpi_type], seg.rank, [seg.offset, data.size, mpi_type], MPI.SUM)
        staged = [self._accumulate_rows(g) for g in self._gathered]
        for rank in self.ps_ranks:
            win.Flush(rank)
        del staged  # (the origin buffers live until the Flush)
        self._post_dynamic(lr)
        if wait:
            self._settle_dynamic()
        return True

    def _accumulate_rows(self, g: Gathered) -> np.ndarray:
        """Start adding the step's gradient rows (deltas) of ``g``'s tables on its PS task;
        the origin buffer, which must live until the Flush."""
        grads = (
            [self._row_grads[g.table.name][g.run]]
            if g.run is not None
            else [self._row_grads[r.table.name][r.at] for r in g.routed]
        )
        rows = np.concatenate(grads) if len(grads) > 1 else np.ascontiguousarray(grads[0])
        target = [g.disp, 1, g.mpi_type]
        self.windows.params.Accumulate(
            [rows, g.table.base], self.ps_ranks[g.ps_task], target, MPI.SUM
        )
        return rows

    def _post_dynamic(self, lr: float) -> None:
        """Post the gradient rows of the dynamic tables for the last training pull's ids
        (the push before it applied first: the push box is free again)."""
        if self.dynamic is None or self._dynamic_ids is None:
            return
        self._settle_dynamic()
        self.dynamic.post(self._dynamic_ids, self._row_grads, lr)
        self._dynamic_posted = True

    def _settle_dynamic(self) -> None:
        if self._dynamic_posted:
            assert self.dynamic is not None
            self._dynamic_posted = False
            self.dynamic.wait_applied()

    def settle(self) -> bool:
        """Wait until every PS applied the update this worker posted last, if it has not
        seen that yet; False if a PS dropped it as too late (sync_replicas)."""
        self._settle_dynamic()
        if not self._posted:
            return True
        self._posted = False
        return self.mail.wait_applied()

    def ps_steps(self) -> list[int]:
        """Each PS task's aggregated step (sync_replicas)."""
        return self.mail.ps_steps()

    def wait_steps(self, tags: list[int], stopping: Callable[[], bool]) -> bool:
        """Until every PS task ``p`` is past step ``tags[p]`` or ``stopping()`` (then False)."""
        return self.mail.wait_steps(tags, stopping)

    def initialise(
        self, values: dict[str, np.ndarray], slots: dict[str, np.ndarray] | None = None
    ) -> None:
        """Overwrite every dense variable and its slots on the PS (chief initialisation).
        Table partitions and their slots are initialised by their PS tasks."""
        for name, array in self.params.items():
            array[...] = values[name]
        win = self.windows.params
        staged = []  # alive until the Flush below
        for e in self.windows.slots or ():
            if not e.table:
                value = (slots or {})[e.name]
                if e.rows:
                    value = value[e.rows[0] : e.rows[1]]
                staged.append(np.ascontiguousarray(value, e.spec.dtype))
                win.Put(
                    [staged[-1].view(np.uint8).ravel(), MPI.BYTE],
                    self.ps_ranks[e.ps_task],
                    [e.offset, e.spec.nbytes, MPI.BYTE],
                )
        for seg in self._segments:
            if not seg.in_place:  # (in place: written above, straight into PS memory)
                win.Put([seg.params, MPI.BYTE], seg.rank, [seg.offset, seg.params.size, MPI.BYTE])
        for rank in self.ps_ranks:
            win.Flush(rank)
        if self.reads_in_place:
            win.Sync()

    def pull_slots(self) -> dict[str, np.ndarray]:
        """Read the optimizer slots of every dense variable (``<variable>/<slot>``)."""
        self.settle()
        win, out = self.windows.params, dict[str, np.ndarray]()
        for e in self.windows.slots or ():
            if not e.table:
                whole = e.whole or e.spec
                full = out.setdefault(e.name, np.empty(whole.shape, whole.dtype))
                block = full[e.rows[0] : e.rows[1]] if e.rows else full
                win.Get(
                    [block.reshape(-1).view(np.uint8), MPI.BYTE],
                    self.ps_ranks[e.ps_task],
                    [e.offset, e.spec.nbytes, MPI.BYTE],
                )
        for rank in self.ps_ranks:
            win.Flush(rank)
        return out


@dataclass(frozen=True)
class Segment:
    """One contiguous same-dtype run of a PS's dense variables: where it starts in the PS
    window, and the worker's bytes a pull fills and a push sends."""

    ps_task: int
    rank: int
    offset: int
    params: np.ndarray  # uint8
    grads: np.ndarray  # uint8
    dtype: np.dtype
    in_place: bool = False  # params is the PS's own memory (zero copy): nothing to pull


def _segments(client: StoreClient) -> list[Segment]:
    """Per PS task: its whole variables in one segment per dtype run (zero-copy views of the
    per-PS buffers), then each row block of a split variable (views of those rows of the
    worker's full array)."""
    out = []
    for p, rank in enumerate(client.ps_ranks):
        on_ps = client.placement.on_ps(p)
        whole = [e for e in on_ps if e.whole is None]
        live = client._live[p]
        for dtype, group in groupby(whole, key=lambda e: e.spec.dtype):
            members = list(group)
            start, end = members[0].offset, members[-1].offset + members[-1].spec.nbytes
            out.append(
                Segment(
                    p,
                    rank,
                    start,
                    live[start:end],
                    client._grad_bufs[p][start:end],
                    np.dtype(dtype),
                    client.reads_in_place,
                )
            )
        for e in on_ps:
            if e.rows and not e.table and e.spec.nbytes:
                a, b = e.rows[:2]
                out.append(
                    Segment(
                        p,
                        rank,
                        e.offset,
                        client.params[e.name][a:b].reshape(-1).view(np.uint8),
                        client.grads[e.name][a:b].reshape(-1).view(np.uint8),
                        np.dtype(e.spec.dtype),
                    )
                )
    return out

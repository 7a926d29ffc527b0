"""Placement: the table variable -> (ps task, byte offset), computed identically on every rank."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ..models.variables import VariableSpec
from ..process.memory import human

ALIGN = 64  # bytes; every variable starts on a cache line of its PS window


@dataclass(frozen=True)
class Placed:
    """Where one variable lives: its PS task and byte offset inside that PS's window."""

    spec: VariableSpec
    ps_task: int
    offset: int
    rows: tuple[int, int, int] | None = None  # a partition: range(*rows) of the full variable
    whole: VariableSpec | None = None  # the partitioned variable this is a part of
    table: bool = False  # a table's partition (moved by rows a batch touches), not a dense block

    @property
    def name(self) -> str:
        """The variable's name (a partition's is its whole variable's)."""
        return self.whole.name if self.whole else self.spec.name

    def describe(self) -> str:
        shape = "x".join(map(str, self.spec.shape)) or "scalar"
        part = ""
        if self.rows and self.table:
            part = f" rows {self.rows[0]}:{self.rows[1]}:{self.rows[2]} of {self.name}"
        elif self.rows:
            part = f" rows {self.rows[0]}:{self.rows[1]} of {self.name} (layout.partition)"
        return f"{self.spec.name} [{shape}] {self.spec.dtype}{part} on /job:ps/task:{self.ps_task}"


@dataclass(frozen=True)
class Placement:
    """The placement table of every variable, in creation order."""

    entries: tuple[Placed, ...]
    num_ps: int

    def __iter__(self):
        return iter(self.entries)

    def on_ps(self, task: int) -> list[Placed]:
        return [e for e in self.entries if e.ps_task == task]

    def ps_bytes(self, task: int) -> int:
        """Window size a PS task needs (aligned end of its last variable)."""
        ends = [align(e.offset + e.spec.nbytes) for e in self.on_ps(task)]
        return max(ends, default=0)

    def dense_bytes(self, task: int) -> int:
        """Bytes of PS ``task``'s dense variables (whole ones, then row blocks of split ones):
        they come first, and every pull reads all of them; table partitions follow, read
        row by row."""
        ends = [align(e.offset + e.spec.nbytes) for e in self.on_ps(task) if not e.table]
        return max(ends, default=0)

    def whole_bytes(self, task: int) -> int:
        """Bytes of PS ``task``'s whole (unsplit) variables, the start of its window."""
        ends = [align(e.offset + e.spec.nbytes) for e in self.on_ps(task) if e.whole is None]
        return max(ends, default=0)

    @property
    def dense(self) -> list[Placed]:
        """Every entry but table partitions: whole variables and row blocks of split ones."""
        return [e for e in self.entries if not e.table]

    def parts(self, name: str) -> list[Placed]:
        """The partitions of table or split variable ``name``, by PS task."""
        return sorted(
            (e for e in self.entries if e.whole and e.whole.name == name), key=lambda e: e.ps_task
        )

    def entry_digests(self) -> list[int]:
        """One 63-bit hash per variable of (name, shape, dtype, ps task, offset)."""
        out = []
        for e in self.entries:
            key = (
                f"{e.spec.name}|{e.spec.shape}|{e.spec.dtype}|{e.ps_task}|{e.offset}|{e.rows}"
                f"|{e.table}"
            )
            out.append(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1)
        return out


def views(
    placement: Placement | Iterable[Placed],
    bufs: list[np.ndarray],
    base: list[int] | None = None,
    only_ps: int | None = None,
    by_name: bool = False,
) -> dict[str, np.ndarray]:
    """Typed views of each placed variable (of PS ``only_ps``, if given) into per-PS byte
    buffers, each offset by ``base[p]``; keyed by part name, or ``by_name`` by variable."""
    out = {}
    for e in placement:
        if only_ps is not None and e.ps_task != only_ps:
            continue
        start = e.offset - (base[e.ps_task] if base else 0)
        raw = bufs[e.ps_task][start : start + e.spec.nbytes]
        out[e.name if by_name else e.spec.name] = raw.view(e.spec.dtype).reshape(e.spec.shape)
    return out


def align(n: int) -> int:
    """``n`` rounded up to ALIGN bytes: where the next variable (or inbox field) may start."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pack(specs: Iterable[VariableSpec], tasks: Iterable[int], num_ps: int) -> Placement:
    fill = [0] * num_ps
    entries = []
    for spec, task in zip(specs, tasks, strict=True):
        entries.append(Placed(spec, task, fill[task]))
        fill[task] = align(fill[task] + spec.nbytes)
    return Placement(tuple(entries), num_ps)


def round_robin(
    specs: list[VariableSpec],
    num_ps: int,
    pins: dict[str, int] | None = None,
    pins_take_turns: bool = False,
) -> Placement:
    """The replica_device_setter rule: the i-th variable not pinned goes to ps task i mod
    num_ps; a pinned one (``pins``: name -> ps task, like ``tf.device``) to its task.
    ``pins_take_turns``: a pinned variable still uses up a turn of the rule, as in
    TensorFlow 1.x, so the i-th variable, pinned or not, has turn i."""
    _check_names(specs)
    pins = pins or {}
    turns = iter(range(len(specs)))
    tasks = []
    for spec in specs:
        if spec.name not in pins:
            tasks.append(next(turns) % num_ps)
            continue
        if pins_take_turns:
            next(turns)
        tasks.append(pins[spec.name])
    return _pack(specs, tasks, num_ps)


def greedy_by_bytes(
    specs: list[VariableSpec],
    num_ps: int,
    pins: dict[str, int] | None = None,
    pins_take_turns: bool = False,
) -> Placement:
    """Each variable, in creation order, goes to the PS holding the fewest bytes so far
    (pinned ones, first, to their task). ``pins_take_turns``: as TensorFlow 1.x's
    GreedyLoadBalancingStrategy, a pinned variable is counted, in creation order, on the
    task the rule would have chosen for it, not on its own."""
    _check_names(specs)
    pins = pins or {}
    load = [0] * num_ps
    if not pins_take_turns:
        for spec in specs:
            if spec.name in pins:
                load[pins[spec.name]] += spec.nbytes
    tasks = []
    for spec in specs:
        task = pins.get(spec.name)
        if task is None or pins_take_turns:
            chosen = min(range(num_ps), key=lambda t: (load[t], t))
            load[chosen] += spec.nbytes
            task = chosen if task is None else task
        tasks.append(task)
    return _pack(specs, tasks, num_ps)


def imbalance(placement: Placement, strategy: str) -> str:
    """A warning when one PS task holds far more of the dense variables than an even share
    (at least 1.5x, and 256 KB over it), saying what would balance them; "" otherwise."""
    num_ps = placement.num_ps
    if num_ps < 2:
        return ""
    held = [sum(e.spec.nbytes for e in placement.on_ps(t) if not e.table) for t in range(num_ps)]
    share = sum(held) / num_ps
    top = max(range(num_ps), key=lambda t: held[t])
    if held[top] < 1.5 * share or held[top] - share < 256 * 1024:
        return ""
    largest = max((e for e in placement.dense), key=lambda e: e.spec.nbytes)
    split = ", ".join(f"ps:{t} {human(held[t])}" for t in range(num_ps))
    if largest.spec.nbytes > share:
        fix = (
            f"its largest variable {largest.name} ({human(largest.spec.nbytes)}) "
            f"alone is more than an even share: split it by rows over the PS tasks with "
            f'layout.partition = ["{largest.name}"] (or layout.partition_min_bytes)'
        )
    elif strategy != "greedy":
        fix = 'layout.placement = "greedy" balances them (or pin variables with layout.pin)'
    else:
        fix = "pin variables to PS tasks with layout.pin to balance them"
    return f"placement ({strategy}) is unbalanced: {split}; {fix}"


STRATEGIES = {"round_robin": round_robin, "greedy": greedy_by_bytes}


def _check_names(specs: list[VariableSpec]) -> None:
    seen = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"variable name {s.name!r} is used twice")
        seen.add(s.name)


def partition_rows(num_rows: int, num_ps: int, rule: str) -> list[tuple[int, int, int]]:
    """The rows (start, stop, step) each PS task holds, as TensorFlow's embedding_lookup
    partition strategies: "mod" (row r on task r % P) or "div" (contiguous blocks)."""
    if rule == "mod":
        return [(p, num_rows, num_ps) for p in range(num_ps)]
    block = -(-num_rows // num_ps)
    return [(min(p * block, num_rows), min((p + 1) * block, num_rows), 1) for p in range(num_ps)]


def owner_and_row(
    ids: np.ndarray, num_rows: int, num_ps: int, rule: str
) -> tuple[np.ndarray, np.ndarray]:
    """For row ids of a partitioned table: the PS task holding each, and its row there."""
    if rule == "mod":
        return ids % num_ps, ids // num_ps
    block = -(-num_rows // num_ps)
    return ids // block, ids % block


def place_tables(placement: Placement, tables: list[VariableSpec], rule: str) -> Placement:
    """Tables (embeddings, wide weights) split by rows over every PS task, after the whole
    variables, one part per task."""
    _check_names([e.spec for e in placement] + tables)
    num_ps = placement.num_ps
    fill = [placement.ps_bytes(p) for p in range(num_ps)]
    entries = list(placement.entries)
    for table in tables:
        for p, rows in enumerate(partition_rows(table.shape[0], num_ps, rule)):
            shape = (len(range(*rows)),) + table.shape[1:]
            spec = VariableSpec(f"{table.name}:part{p}", shape, table.dtype)
            entries.append(Placed(spec, p, fill[p], rows, table, table=True))
            fill[p] = align(fill[p] + spec.nbytes)
    return Placement(tuple(entries), num_ps)


def place_blocks(placement: Placement, split: list[VariableSpec]) -> Placement:
    """Dense variables split by rows over every PS task (TensorFlow's partitioned
    variables): task p holds the p-th contiguous block of rows, after its whole variables.
    Every pull reads all blocks, each straight into its rows of the worker's full array."""
    _check_names([e.spec for e in placement] + split)
    num_ps = placement.num_ps
    fill = [placement.ps_bytes(p) for p in range(num_ps)]
    entries = list(placement.entries)
    for var in split:
        n = var.shape[0]
        for p in range(num_ps):
            rows = (p * n // num_ps, (p + 1) * n // num_ps, 1)  # sizes differ by at most one
            shape = (rows[1] - rows[0],) + var.shape[1:]
            spec = VariableSpec(f"{var.name}:part{p}", shape, var.dtype)
            entries.append(Placed(spec, p, fill[p], rows, var))
            fill[p] = align(fill[p] + spec.nbytes)
    return Placement(tuple(entries), num_ps)


def slot_placement(placement: Placement, slots: tuple[str, ...]) -> Placement:
    """Optimizer slots (``<variable>/<slot>``) on their variable's PS, after all variables.

    Offsets start where the variables end, so a pull of the variables stays one contiguous Get.
    A partition's slots are partitions of the whole variable's slots.
    """
    fill = [placement.ps_bytes(p) for p in range(placement.num_ps)]
    entries = []
    for e in placement:
        for slot in slots:
            spec = VariableSpec(f"{e.spec.name}/{slot}", e.spec.shape, e.spec.dtype)
            whole = (
                VariableSpec(f"{e.whole.name}/{slot}", e.whole.shape, e.whole.dtype)
                if e.whole
                else None
            )
            entries.append(Placed(spec, e.ps_task, fill[e.ps_task], e.rows, whole, e.table))
            fill[e.ps_task] = align(fill[e.ps_task] + spec.nbytes)
    return Placement(tuple(entries), placement.num_ps)

"""Placement: the table variable -> (ps task, byte offset), computed identically on every rank."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

import numpy as np

ALIGN = 64  # bytes; every variable starts on a cache line of its PS window


@dataclass(frozen=True)
class VariableSpec:
    """A named, shaped, typed parameter, as the model creates it."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Placed:
    """Where one variable lives: its PS task and byte offset inside that PS's window."""

    spec: VariableSpec
    ps_task: int
    offset: int
    rows: tuple[int, int, int] | None = None  # a partition: range(*rows) of the full variable

    def describe(self) -> str:
        shape = "x".join(map(str, self.spec.shape)) or "scalar"
        return f"{self.spec.name} [{shape}] {self.spec.dtype} on /job:ps/task:{self.ps_task}"


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
        ends = [_align(e.offset + e.spec.nbytes) for e in self.on_ps(task)]
        return max(ends, default=0)

    def entry_digests(self) -> list[int]:
        """One 63-bit hash per variable of (name, shape, dtype, ps task, offset)."""
        out = []
        for e in self.entries:
            key = f"{e.spec.name}|{e.spec.shape}|{e.spec.dtype}|{e.ps_task}|{e.offset}"
            out.append(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1)
        return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pack(specs: Iterable[VariableSpec], tasks: Iterable[int], num_ps: int) -> Placement:
    fill = [0] * num_ps
    entries = []
    for spec, task in zip(specs, tasks):
        entries.append(Placed(spec, task, fill[task]))
        fill[task] = _align(fill[task] + spec.nbytes)
    return Placement(tuple(entries), num_ps)


def round_robin(specs: list[VariableSpec], num_ps: int) -> Placement:
    """The replica_device_setter rule: variable i goes to ps task i mod num_ps."""
    _check_names(specs)
    return _pack(specs, (i % num_ps for i in range(len(specs))), num_ps)


def greedy_by_bytes(specs: list[VariableSpec], num_ps: int) -> Placement:
    """Each variable, in creation order, goes to the PS holding the fewest bytes so far."""
    _check_names(specs)
    load = [0] * num_ps
    tasks = []
    for spec in specs:
        task = min(range(num_ps), key=lambda t: (load[t], t))
        tasks.append(task)
        load[task] += spec.nbytes
    return _pack(specs, tasks, num_ps)


STRATEGIES = {"round_robin": round_robin, "greedy": greedy_by_bytes}


def _check_names(specs: list[VariableSpec]) -> None:
    seen = set()
    for s in specs:
        if s.name in seen:
            raise ValueError(f"variable name {s.name!r} is used twice")
        seen.add(s.name)


def slot_placement(placement: Placement, slots: tuple[str, ...]) -> Placement:
    """Optimizer slots (``<variable>/<slot>``) on their variable's PS, after all variables.

    Offsets start where the variables end, so a pull of the variables stays one contiguous Get.
    """
    fill = [placement.ps_bytes(p) for p in range(placement.num_ps)]
    entries = []
    for e in placement:
        for slot in slots:
            spec = VariableSpec(f"{e.spec.name}/{slot}", e.spec.shape, e.spec.dtype)
            entries.append(Placed(spec, e.ps_task, fill[e.ps_task]))
            fill[e.ps_task] = _align(fill[e.ps_task] + spec.nbytes)
    return Placement(tuple(entries), placement.num_ps)

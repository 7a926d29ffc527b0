"""The initial values of table rows: what a sparse checkpoint part leaves out.

A table partition (split by rows over the PS tasks, see placement.py) starts as
``model.initial_rows(table, rows, seed)`` and its optimizer slots as
``optimizer.init_slots(values)``: a function of (table, row, seed) only, the same whatever
the partition. A run touches few rows of a big table, so a PS writes only the rows that
differ from these (mpips.checkpoint) and every reader computes the others again.
``InitialValues`` is how the writer and the readers compute them, a chunk of rows at a time
(``row_chunks``), so that no whole partition's initial values are ever in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

CHUNK_ELEMENTS = 1 << 20  # initial values are computed this many elements at a time

Rows = tuple[int, int, int]  # range(start, stop, step) of a table's rows
# (table, rows, seed) -> {"": the table's rows, <slot>: that slot's rows}
Compute = Callable[[str, Rows, int], dict[str, np.ndarray]]


@dataclass(frozen=True)
class InitialValues:
    """How to compute the initial rows of tables and of their slots: ``compute(table, rows,
    seed)`` gives them by slot name ("" for the table itself), for ``chunk_elements``
    elements at a time (callers split their rows with ``row_chunks``)."""

    compute: Compute
    chunk_elements: int = CHUNK_ELEMENTS


def row_chunks(num_rows: int, row_elements: int, chunk_elements: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges covering ``range(num_rows)`` of about ``chunk_elements`` elements each
    (at least one row): the bounded steps in which initial values are made and compared."""
    chunk = max(1, chunk_elements // max(1, row_elements))
    for lo in range(0, num_rows, chunk):
        yield lo, min(num_rows, lo + chunk)


def rows_of(model: Any, optimizer: Any, table: str, rows: Rows, seed: int) -> dict[str, np.ndarray]:
    """The initial ``range(*rows)`` of ``table`` ("") and of each of its optimizer slots (none
    without an optimizer), computed once for all of them."""
    values = model.initial_rows(table, rows, seed)
    return {"": values, **(optimizer.init_slots(values) if optimizer is not None else {})}


def from_model(
    model: Any, optimizer: Any = None, chunk_elements: int = CHUNK_ELEMENTS
) -> InitialValues:
    """The initial values of ``model``'s tables (and, with ``optimizer``, of their slots)."""

    def compute(table: str, rows: Rows, seed: int) -> dict[str, np.ndarray]:
        return rows_of(model, optimizer, table, rows, seed)

    return InitialValues(compute, chunk_elements)

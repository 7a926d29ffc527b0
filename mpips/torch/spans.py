"""Tables that each serve a span of the data's one id space (``table_offsets``, as DLRM's
per-feature tables): how the module sees a step's rows of them.

The module indexes every table with the batch's ids renumbered (one numbering for all
tables). mpips pulls a table's rows only for the ids it serves, into one buffer for the
tables whose spans do not overlap, each table's rows at the positions of its own ids. A
module that indexes each table only with the ids it serves (DLRM's: feature f's column into
table f) has every table bound to that whole buffer and its gradients land in one gradient
buffer: nothing is copied, one zeroing a step. A module that indexes a table with other ids
too (a bag of all of a row's ids in every table) must read zero rows for them: each table
then gets its own rows among zeros, and its gradient rows are copied out. Which kind a
module is shows in its first training step: it runs on the copies, and the rows each
table's backward touched say whether any lies outside the table's own; every RECHECK-th
step does so again (a module that strays later, by the data, goes to the copies, and is
said). Where mpips's rows are not in a numpy buffer (a GPU's), the copies always.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .binding import RowViews, Traffic, as_tensor, cut_to_both

RECHECK = 64  # training steps between two on copies that check the module's indexing


class Spans:
    """The tables with a span, by variable name: each one's run of the batch's positions,
    and their binding (shared buffers, or copies among zeros)."""

    def __init__(self, params: dict[str, torch.Tensor], offsets: dict[str, int]):
        self.params = {n: p for n, p in params.items() if n in offsets}
        self.bounds = np.array(
            [(offsets[n], offsets[n] + p.shape[0]) for n, p in self.params.items()], np.int64
        ).ravel()
        self.runs: dict[str, tuple[int, int]] = {}  # each table's positions [a, b) (prepare)
        self.rows = 0  # the batch's ids
        # whether the module indexes each table only with the ids it serves (None: not
        # seen yet; False: it does not, and the tables stay on copies)
        self.keeps_to_spans: bool | None = None
        self._values, self._grads = RowViews(), RowViews()
        self._bound: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._cut: dict[str, tuple[torch.Tensor, ...]] = {}  # (cut_to_both)
        self._copies: dict[str, torch.Tensor] = {}  # each table's rows among zeros
        self._copied: dict[str, Any] = {}  # tables on copies this step: their gradient rows
        self._last: tuple[Any, torch.Tensor | None] = (None, None)  # (_shared)
        self._extent: dict[int, int] = {}  # each buffer the last step cleared: its rows
        self.steps = 0  # training steps bound
        self.checking = False  # this step runs on copies to see the module's indexing
        self.news = ""  # what a check found (said once by the model)

    def prepare(self, ids: np.ndarray) -> None:
        """The batch's ids (sorted, unique): each table's run of their positions."""
        at = np.searchsorted(ids, self.bounds).tolist()
        self.runs = {n: (at[2 * i], at[2 * i + 1]) for i, n in enumerate(self.params)}
        self.rows = len(ids)

    def bind(self, params: dict[str, Any], grads: dict[str, Any] | None) -> None:
        """Each table's weight (and, training, its .grad) for the step: the shared buffers
        where the module keeps to the spans, else copies."""
        self._copied.clear()
        self._last = (None, None)
        self.checking = grads is not None and (
            self.keeps_to_spans is None or (self.keeps_to_spans and self.steps % RECHECK == 0)
        )
        self.steps += grads is not None
        last, cleared = self._extent, set()
        if grads is not None:  # (the buffers this step clears: _clear)
            self._extent = {}
        for n, p in self.params.items():
            shared = self._shared(n, params[n], None if grads is None else grads[n])
            if shared is None:
                self._bind_copy(n, p, params[n])
                if grads is not None:
                    self._copied[n] = grads[n]
                continue
            data, grad = shared
            bound = self._bound.get(n)
            if bound is None or bound[0] is not data or bound[1] is not grad or p.grad is not grad:
                p.data = data
                p.grad = grad
                self._bound[n] = (data, grad)
            if grad is not None and data.data_ptr() not in cleared:
                cleared.add(data.data_ptr())
                self._clear(data, grad, last.get(data.data_ptr()))

    def _clear(self, data: torch.Tensor, grad: torch.Tensor, high: int | None) -> None:
        """A shared buffer for a training step: zero its rows past the batch's (those the
        last step's pull wrote; all of them where this buffer was not cleared at the last
        step: new, or a step on copies since), so that a read of the whole weight sees the
        batch's rows and zeros, and its gradient rows a backward may have written."""
        rows = self.rows
        if high is None:
            data[rows:].zero_()
            grad.zero_()
        else:
            data[rows:high].zero_()
            grad[: max(rows, high)].zero_()
        self._extent[data.data_ptr()] = rows

    def _shared(
        self, n: str, rows: Any, grad_rows: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The table's weight and .grad as views of mpips's whole buffers (the gradient
        rows given are those of its own ids, ``runs[n][0]`` rows in), or None: copies."""
        if not self.keeps_to_spans or self.checking:
            return None
        if rows is not self._last[0]:  # (a row group's tables share one array: viewed once)
            self._last = (rows, self._values.of(n, rows))
        data = self._last[1]
        if data is None or grad_rows is None:
            return None if data is None else (data, None)
        grad = self._grads.of(n, grad_rows, before=self.runs[n][0])
        if grad is None:
            return None
        return cut_to_both(self._cut, n, data, grad)

    def _bind_copy(self, n: str, p: torch.Tensor, rows: Any) -> None:
        """The table's weight its own rows of the step among zeros; no .grad yet (backward
        leaves the sparse gradient there: collect copies its rows out)."""
        a, b = self.runs[n]
        src = as_tensor(rows)
        copy = self._copies.get(n)
        if copy is None or len(copy) < self.rows or copy.device != src.device:
            copy = self._copies[n] = src.new_zeros((max(self.rows, 1), *src.shape[1:]))
        view = copy[: self.rows]
        view.zero_()
        view[a:b] = src[a:b]
        p.data = view
        p.grad = None
        self._bound.pop(n, None)

    def collect(self, traffic: Traffic) -> None:
        """The gradient rows of the tables on copies written where mpips pushes them from;
        the first training step's say whether the module keeps to the spans. A table whose
        shared .grad torch replaced (not accumulated into) is copied in."""
        strays = False
        for n, out_rows in self._copied.items():
            p, (a, b) = self.params[n], self.runs[n]
            g, p.grad = p.grad, None
            out = as_tensor(out_rows)
            out.zero_()
            if g is None:  # (the loss did not use the table)
                continue
            if g.is_sparse:
                idx, values = g._indices()[0], g._values()
                inside = (idx >= a) & (idx < b)
                if self.checking:
                    strays = strays or not bool(inside.all())
                out.index_add_(0, idx[inside] - a, values[inside])
            else:  # (a dense use of the weight reads every row)
                strays = True
                out.copy_(g[a:b])
            traffic.copied_bytes += out.nbytes
        if self.checking:
            self._checked(strays)
        for n, (_, grad) in self._bound.items():
            g = self.params[n].grad
            if grad is not None and g is not None and g is not grad:
                a, b = self.runs[n]  # (its own rows: the others are other tables')
                grad[a:b].copy_((g.to_dense() if g.is_sparse else g)[a:b])
                traffic.copied_bytes += grad[a:b].nbytes
                self.params[n].grad = None
                self._bound[n] = (self._bound[n][0], None)

    def _checked(self, strays: bool) -> None:
        """What a step on copies showed: the module keeps to its tables' ids (the shared
        buffers from the next step on) or not (copies from now on; said once if it kept to
        them before: the steps since the last check read other tables' rows there)."""
        if self.keeps_to_spans and strays:
            self.news = (
                "indexes a table with ids it does not serve (table_offsets), which it did "
                f"not before: its tables are copies from now on (the up to {RECHECK} steps "
                "since the last check read other tables' rows at those ids, not zeros)"
            )
        self.keeps_to_spans = not strays

"""The layout of the PS windows' mail: the words of a PS's mail window and a worker's inbox
in a PS window (the whole variables' gradients, then a row box per table partition). What
window.py allocates and the mailbox protocol (mailbox.py) reads and writes."""

from __future__ import annotations

import numpy as np

from ..placement.table import Placed, Placement, align, views

MAIL_FLAG, MAIL_LR, MAIL_WORDS = 0, 1, 2  # a worker's words in a PS's mail window


def mail_words(workers: int) -> int:
    """int64 words of a PS's mail window: each worker's, then the PS's aggregated step
    (train.mode = "sync_replicas")."""
    return MAIL_WORDS * workers + 1


class RowBox:
    """Where one table partition's gradient rows go in a worker's inbox (byte offsets from
    the inbox start)."""

    def __init__(self, part: Placed, start: int, capacity: int):
        self.part, self.capacity = part, capacity
        self.width = int(np.prod(part.spec.shape[1:]))
        self.count = start  # int64
        self.rows = align(start + 8)  # int64 x capacity
        self.grads = align(self.rows + 8 * capacity)
        self.end = align(self.grads + capacity * self.width * np.dtype(part.spec.dtype).itemsize)

    def arrays(self, inbox: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(count, rows, grads) views into an inbox's bytes."""
        n = inbox[self.count : self.count + 8].view(np.int64)
        rows = inbox[self.rows : self.rows + 8 * self.capacity].view(np.int64)
        grads = inbox[self.grads : self.end].view(self.part.spec.dtype)[
            : self.capacity * self.width
        ]
        return n, rows, grads.reshape(self.capacity, self.width)


class Inbox:
    """The layout of a worker's inbox on PS ``task`` (the same for every worker): the whole
    variables' gradients, then a row box per table partition, by table name."""

    def __init__(self, placement: Placement, task: int, row_capacity: int):
        self.dense = [e for e in placement.on_ps(task) if not e.table]
        self.num_ps = placement.num_ps
        start = placement.dense_bytes(task)
        self.boxes: dict[str, RowBox] = {}
        for e in placement.on_ps(task):
            if e.table:
                box = RowBox(e, start, max(1, min(e.spec.shape[0], row_capacity)))
                self.boxes[e.name] = box
                start = box.end
        self.nbytes = start

    def views(
        self, inbox: np.ndarray
    ) -> tuple[dict[str, np.ndarray], list[tuple[str, RowBox, tuple]]]:
        """Typed views into an inbox's bytes: dense variables' gradients by variable name (a
        row block of a split variable by its variable's), and (table, box, (count, rows,
        grads)) of every row box."""
        return views(self.dense, [inbox] * self.num_ps, by_name=True), [
            (name, box, box.arrays(inbox)) for name, box in self.boxes.items()
        ]

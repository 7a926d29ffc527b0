"""Zero copy's push: a worker applies its own update straight to the PS memory it shares
(``train.zero_copy``), a stripe of a few MiB at a time, each under a lock word of that PS
(``Windows.lock_words``) taken with the CPU's compare-and-swap (atomics.py). Imported only
by zero copy.

Why: on one node the bytes are the cost. MPICH serialises ``Accumulate`` into a shared-memory
window and runs it through a generic loop: 7.2 ms a step for the wide MLP's 23 MB, where this
path takes 1.5-5 ms, mostly the fused update itself (docs/performance.md). A stateful
optimizer's update through the PS's mailbox costs a copy of the gradient, a PS wake-up and an
acknowledgement. Here the rule (SGD's fused ``var -= lr * grad``, Adam's fused kernel, ...)
runs on the worker, on the variables and slots in place.

Under a word's lock no two workers update the same elements at once, so no update is lost;
every rule is elementwise, so each element (and its slots) sees whole updates one after
another, as on the PS. A worker holds one word at a time and never waits while holding one;
it updates the stripes of free words first. A PS task takes all of its words before it writes
a checkpoint shard (``hold_ps``), so each element of the shard is from whole updates, with
its slots. Reads stay Hogwild, as zero copy's pulls always were.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial

import numpy as np

from ..errors import Stalled
from ..process.waits import MIN_SLEEP
from .atomics import Words
from .cluster import stall_limit
from .control import LOST
from .rules import Apply, apply_rows
from .window import LOCKS_PER_PS, Windows

STRIPE_BYTES = 4 << 20  # small enough that two workers interleave, few enough locks a step
# a piece this big (a stripe, or a variable or a variable's last part smaller than one) has
# a word of its own: two workers then update different variables at once (the reference
# MLP's two kernels, 1.6 and 1.0 MB); smaller ones, and table rows, share one word a PS
OWN_WORD_BYTES = 256 << 10
RECLAIM_SECONDS = 0.5  # a word held this long: its holder declared lost? (survive mode)
SPIN_SECONDS = 5e-4  # try a taken word again at once for this long, then sleep between tries

Word = tuple[Words, int]  # a lock word: its PS's words, and which


def _try_lock(word: Word, me: int) -> int:
    """Take lock ``word`` if it is free (0): returns 0, else its holder (see ``_holder``)."""
    words, k = word
    return words.compare_and_swap(k, 0, me)


def _unlock(word: Word) -> None:
    words, k = word
    words.exchange(k, 0)


def _holder(word_value: int) -> str:
    """Who holds a word: worker k writes k + 1, PS task p writes -(p + 1)."""
    if word_value > 0:
        return f"/job:worker/task:{word_value - 1}"
    return f"/job:ps/task:{-word_value - 1} (writing its checkpoint shard)"


def _stalled(me: str, word_value: int, waited: float) -> Stalled:
    return Stalled(
        f"{me}: a stripe of PS memory has been locked by {_holder(word_value)} for "
        f"{waited:.0f} s (hung in the middle of its update?)"
    )


def _reclaimed(windows: Windows, word: Word, holder: int) -> bool:
    """Take back lock ``word`` from ``holder`` if it is a worker declared lost (survive
    mode: its done flag says LOST, RunControl.declare_lost): the stripe it was updating
    keeps whatever part of that update it had written. True if the word is free again."""
    if holder <= 0 or not windows.control_shared:
        return False
    layout = windows.layout
    done = windows.control_words().load(windows.clocks_at + layout.num_workers + holder - 1, 1)
    if int(done[0]) != LOST:
        return False
    words, k = word
    return words.compare_and_swap(k, holder, 0) == holder


def ps_words(windows: Windows, ps_task: int) -> list[Word]:
    """Every lock word of PS task ``ps_task``'s memory."""
    words = windows.lock_words(ps_task)
    return [(words, k) for k in range(LOCKS_PER_PS)]


def hold_ps(windows: Windows, ps_task: int) -> None:
    """PS task ``ps_task``: take every lock word of its memory, in order, each as soon as the
    worker holding it has finished its stripe (workers never wait while holding a word, so
    this cannot deadlock). Until ``release_ps``, no worker changes this PS's memory."""
    for word in ps_words(windows, ps_task):
        since, sleep = time.monotonic(), MIN_SLEEP
        while taken := _try_lock(word, -(ps_task + 1)):
            waited = time.monotonic() - since
            if waited > stall_limit(windows.layout.num_workers + ps_task):
                raise _stalled(f"/job:ps/task:{ps_task}", taken, waited)
            if waited > RECLAIM_SECONDS and _reclaimed(windows, word, taken):
                continue
            time.sleep(sleep)
            sleep = min(1e-3, sleep * 2)


def release_ps(windows: Windows, ps_task: int) -> None:
    """PS task ``ps_task``: give back the words ``hold_ps`` took."""
    for word in ps_words(windows, ps_task):
        _unlock(word)


class Stripes:
    """Worker ``task``'s updates in place: ``pieces`` are (ps task, the variable in that
    PS's memory, this worker's gradient, the variable's slots there), all flat arrays of
    one length; ``tables`` map (table name, ps task) to that partition in the PS's memory
    and its slots there, as (rows, width) arrays; ``apply`` is the optimizer's rule.

    A stripe of OWN_WORD_BYTES or more has a lock word of its own (up to LOCKS_PER_PS - 1 per
    PS, then shared). Everything smaller on a PS (small variables, a small last part of a big
    one, the touched rows of its table partitions) goes under one more word, taken once a
    step: a CTR step's tiny dense update and its rows cost one lock, not one each."""

    def __init__(
        self,
        windows: Windows,
        task: int,
        pieces: list[tuple[int, np.ndarray, np.ndarray, dict[str, np.ndarray]]],
        tables: dict[tuple[str, int], tuple[np.ndarray, dict[str, np.ndarray]]],
        apply: Apply,
    ):
        self.task, self.apply, self.windows = task, apply, windows
        # lock word -> the updates(lr, t) it guards, in the order this worker takes them
        self.stripes: dict[int, list[Callable[[float, int], None]]] = {}
        count: dict[int, int] = {}

        def word(ps_task: int, own: bool) -> int:
            """A word of its own for a big piece (the next of its PS), or the small ones'."""
            k = 0
            if own:
                k = count[ps_task] = count.get(ps_task, 0) % (LOCKS_PER_PS - 1) + 1
            return ps_task * LOCKS_PER_PS + k

        for ps_task, var, grad, slots in pieces:
            step = max(1, STRIPE_BYTES // var.itemsize)
            for a in range(0, var.size, step):
                cut = slice(a, a + step)
                parts = {s: v[cut] for s, v in slots.items()}
                key = word(ps_task, var[cut].nbytes >= OWN_WORD_BYTES)
                self.stripes.setdefault(key, []).append(partial(apply, var[cut], grad[cut], parts))
        order = list(self.stripes)  # workers start at different words, not queued behind
        shift = task * len(order) // windows.layout.num_workers  # one another
        self.order = order[shift:] + order[:shift]
        # (table name, ps task) -> (its lock word, the partition, its slots)
        self.tables = {key: (word(key[1], False), *part) for key, part in tables.items()}
        self._me = task + 1  # a held word names its holder
        words = [windows.lock_words(p) for p in range(windows.layout.num_ps)]
        # key (PS task * LOCKS_PER_PS + its index there) -> that lock word
        self.locks: dict[int, Word] = {
            key: (words[key // LOCKS_PER_PS], key % LOCKS_PER_PS)
            for key in (*self.stripes, *(word for word, _, _ in self.tables.values()))
        }

    def _reclaimed(self, key: int, holder: int) -> bool:
        return _reclaimed(self.windows, self.locks[key], holder)

    def update(
        self,
        lr: float,
        t: int,
        rows: list[tuple[str, int, np.ndarray, np.ndarray]],
    ) -> None:
        """Apply the rule with ``lr`` (and ``t``, the 1-based update count) to every stripe
        and to the ``rows`` (table, ps task, the rows in its partition, their gradient) of
        the step, under their locks; a word held by another worker is left for later. A
        lock held past the stall limit (a worker hung in the middle of its update) ends the
        job, naming that worker."""
        jobs = {key: list(self.stripes[key]) for key in self.order}
        for name, p, local, grad in rows:
            word, part, slots = self.tables[name, p]
            jobs.setdefault(word, []).append(
                partial(apply_rows, self.apply, part, slots, local, grad)
            )
        pending = list(jobs.items())
        since, holder = time.monotonic(), 0
        while pending:
            later = []
            for key, updates in pending:
                lock = self.locks[key]
                taken = _try_lock(lock, self._me)
                if taken:
                    later.append((key, updates))
                    holder = taken
                    continue
                try:  # taking the word ordered the previous holder's stores before our loads
                    for run in updates:
                        run(lr, t)
                finally:  # and giving it back orders ours before the next holder's
                    _unlock(lock)
            if len(later) < len(pending):
                since = time.monotonic()
            elif (waited := time.monotonic() - since) < SPIN_SECONDS:
                os.sched_yield()  # a stripe's update takes ~0.1-2 ms: the holder is nearly done
            elif waited > stall_limit(self.task):
                raise _stalled(f"/job:worker/task:{self.task}", holder, waited)
            elif waited > RECLAIM_SECONDS and _reclaimed(
                self.windows, self.locks[later[-1][0]], holder
            ):
                since = time.monotonic()
            else:
                time.sleep(MIN_SLEEP)
            pending = later

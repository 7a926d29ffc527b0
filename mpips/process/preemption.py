"""Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C: mpirun forwards it to every rank) on any
rank during training asks the whole job to stop at the next step, write a checkpoint and
exit with EXIT_PREEMPTED (rerunning the same command resumes).

The signals themselves (caught while ``mpips.train`` runs, a repeat within
DUPLICATE_SECONDS taken for the same request, a later one ending the rank at once, the
caller's handlers back afterwards) are the training phase of mpips/process/signals.py,
whose docstring tells a rank's whole signal story. This module is what a request means for
the run: the training loops poll ``requested()`` at step boundaries and spread it to every
rank (the store's control counters in async mode, one small allreduce per step in sync
mode), and the run ends with EXIT_PREEMPTED, its message naming the signal (``name``).
"""

from __future__ import annotations

import signal

from . import signals
from .signals import DUPLICATE_SECONDS, Previous

EXIT_PREEMPTED = 3
SIGNALS = signals.PREEMPTING
__all__ = [
    "DUPLICATE_SECONDS",
    "EXIT_PREEMPTED",
    "SIGNALS",
    "install",
    "name",
    "requested",
    "restore",
]


def install() -> Previous | None:
    """Catch SIGTERM, SIGUSR1 and SIGINT from now on (the training phase); returns what it
    replaced, for ``restore()``. Outside the main thread (where Python cannot set handlers)
    it does nothing and returns None: that run is not preemptible by signal."""
    return signals.training()


def restore(previous: Previous | None) -> None:
    """Put back what ``install()`` replaced (from the main thread, when the run is over),
    once the rest of a request's DUPLICATE_SECONDS has passed."""
    signals.after_training(previous)


def requested() -> int:
    """The signal number received on this rank (0: none)."""
    return signals.requested()


def name(signum: int) -> str:
    return signal.Signals(signum).name

"""Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C: mpirun forwards it to every rank) on any
rank asks the whole job to stop at the next step, write a checkpoint and exit with
EXIT_PREEMPTED (rerunning the same command resumes).

The handler only records the signal; the training loops poll ``requested()`` at step
boundaries and spread the request to every rank (the store's control counters in async
mode, one small allreduce per step in sync mode). A second signal gets the default action
(the job dies).
"""

from __future__ import annotations

import signal

EXIT_PREEMPTED = 3
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_received: int = 0


def _handler(signum: int, frame: object) -> None:
    global _received
    _received = signum
    signal.signal(signum, signal.SIG_DFL)  # a second one ends the process at once


def install() -> None:
    """Catch SIGTERM, SIGUSR1 and SIGINT from now on (call from the main thread)."""
    global _received
    _received = 0
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def requested() -> int:
    """The signal number received on this rank (0: none)."""
    return _received


def name(signum: int) -> str:
    return signal.Signals(signum).name

"""Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C: mpirun forwards it to every rank) on any
rank asks the whole job to stop at the next step, write a checkpoint and exit with
EXIT_PREEMPTED (rerunning the same command resumes).

The handler only records the signal; the training loops poll ``requested()`` at step
boundaries and spread the request to every rank (the store's control counters in async
mode, one small allreduce per step in sync mode). A second signal, a second or more after
the first, gets the default action (the job dies). One within that second is the same
request delivered twice, and is ignored: GNU ``timeout`` signals mpirun and then its whole
process group, so each rank gets the signal from it and again as mpirun forwards it.
"""

from __future__ import annotations

import os
import signal
import time

EXIT_PREEMPTED = 3
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DUPLICATE_SECONDS = 1.0  # a signal this soon after the first is the same request again
_received: int = 0
_first_at: float = 0.0


def _handler(signum: int, frame: object) -> None:
    global _received, _first_at
    now = time.monotonic()
    if not _received:
        _received, _first_at = signum, now
    elif now - _first_at >= DUPLICATE_SECONDS:  # a second request: end the process at once
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


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

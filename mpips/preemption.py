"""Preemption: SIGTERM, SIGUSR1 or SIGINT (Ctrl-C: mpirun forwards it to every rank) on any
rank asks the whole job to stop at the next step, write a checkpoint and exit with
EXIT_PREEMPTED (rerunning the same command resumes).

The handler only records the signal; the training loops poll ``requested()`` at step
boundaries and spread the request to every rank (the store's control counters in async
mode, one small allreduce per step in sync mode). A second signal, a second or more after
the first, gets the default action (the job dies), even while the rank is stuck in C code
(a blocking MPI call) where no Python handler runs. One within that second is the same
request delivered twice, and is ignored: GNU ``timeout`` signals mpirun and then its whole
process group, so each rank gets the signal from it and again as mpirun forwards it.
"""

from __future__ import annotations

import ctypes
import signal
import threading

EXIT_PREEMPTED = 3
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DUPLICATE_SECONDS = 1.0  # a signal this soon after the first is the same request again
_received: int = 0


def _handler(signum: int, frame: object) -> None:
    """The first request: recorded; the signals ignored for DUPLICATE_SECONDS (in the
    kernel: no Python code needs to run for it), then given their default action."""
    global _received
    if _received:
        return
    _received = signum
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    timer = threading.Timer(DUPLICATE_SECONDS, _default_action)
    timer.daemon = True
    timer.start()


def _default_action() -> None:
    """SIG_DFL for the signals, set from this thread by the C library's ``signal()``
    (Python's signal.signal works only in the main thread, which may be stuck in C)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    for sig in SIGNALS:
        libc.signal(int(sig), None)  # (SIG_DFL is the null handler)


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

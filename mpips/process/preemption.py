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
(mpirun itself takes a second SIGINT, however soon, for a forced abort: exit 255 whatever
the ranks chose; ``python -m mpips.launch`` runs it so that it gets one: mpips/launch.py.)

``install()`` returns the handlers it replaced and ``restore()`` puts them back when a run
ends, so a script or notebook that trains gets its own Ctrl-C (KeyboardInterrupt) back.
"""

from __future__ import annotations

import ctypes
import signal
import threading
import time
from typing import Any

EXIT_PREEMPTED = 3
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
DUPLICATE_SECONDS = 1.0  # a signal this soon after the first is the same request again
_received: int = 0
_received_at: float = 0.0


class _Watch:
    """The thread that gives the signals their default action DUPLICATE_SECONDS after the
    first request. Started by install(), not by the handler: a thread started inside a
    handler could wait forever on a lock the interrupted main thread holds."""

    def __init__(self) -> None:
        self.first = threading.Event()  # set by the handler (no lock the main thread holds)
        self.over = threading.Event()  # set by restore(): the run is over
        self.thread = threading.Thread(target=self._run, name="mpips-preemption", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.first.wait()
        if not self.over.is_set() and not self.over.wait(DUPLICATE_SECONDS):
            _default_action()

    def stop(self) -> None:
        self.over.set()
        self.first.set()
        self.thread.join()


_watch: _Watch | None = None


def _handler(signum: int, frame: object) -> None:
    """The first request: recorded; the signals ignored for DUPLICATE_SECONDS (in the
    kernel: no Python code needs to run for it), then given their default action."""
    global _received, _received_at
    if _received:
        return
    _received, _received_at = signum, time.monotonic()
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if _watch is not None:
        _watch.first.set()


def _default_action() -> None:
    """SIG_DFL for the signals, set from the watching thread by the C library's
    ``signal()`` (Python's signal.signal works only in the main thread, which may be stuck
    in C)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    for sig in SIGNALS:
        libc.signal(int(sig), None)  # (SIG_DFL is the null handler)


def install() -> dict[int, Any] | None:
    """Catch SIGTERM, SIGUSR1 and SIGINT from now on; returns the handlers replaced, for
    ``restore()``. Outside the main thread (where Python cannot set handlers) it does
    nothing and returns None: that run is not preemptible by signal."""
    global _received, _watch
    if threading.current_thread() is not threading.main_thread():
        return None
    if _watch is not None:  # an earlier install() never restored: its watch ends here
        _watch.stop()
    previous = {int(sig): signal.getsignal(sig) for sig in SIGNALS}
    _received = 0
    _watch = _Watch()
    for sig in SIGNALS:
        signal.signal(sig, _handler)
    return previous


def restore(previous: dict[int, Any] | None) -> None:
    """Put back the handlers ``install()`` replaced (call from the main thread when the
    run is over). After a request it first waits out the rest of DUPLICATE_SECONDS, so a
    duplicate of that request still finds the signals ignored."""
    global _watch
    if previous is None:
        return
    if _received:
        time.sleep(max(0.0, _received_at + DUPLICATE_SECONDS - time.monotonic()))
    if _watch is not None:
        _watch.stop()
        _watch = None
    for sig, handler in previous.items():
        signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def requested() -> int:
    """The signal number received on this rank (0: none)."""
    return _received


def name(signum: int) -> str:
    return signal.Signals(signum).name

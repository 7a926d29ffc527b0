"""Every signal disposition of a rank, phase by phase: the one place a rank's handling of
SIGINT (Ctrl-C), SIGTERM and SIGUSR1 is decided. Importing this module changes nothing; each
phase begins with an explicit call, and its state (the phase, a request received, the thread
that watches for a second one) is on one object, ``STATE``, that tests can reset.

1. **Start-up** (``start_up()``, called by the package ``mpips`` before it imports numpy,
   only when the process is ``python -m mpips ...``): SIGINT keeps its default action, which
   ends the rank at once and quietly, wherever it is. mpirun forwards Ctrl-C to every rank,
   and a rank still importing would otherwise print a KeyboardInterrupt traceback from the
   middle of an import (or crash in one), or, inside MPI_Init (C code, where no Python
   handler runs), not notice it and wait there for ranks that are gone. Nothing has started,
   so nothing is lost; the launcher then ends the job. A library import (``import mpips`` in
   a script) leaves Ctrl-C alone.
2. **A command** (``command(argv)``, by ``mpips/__main__.py`` once the CLI is imported):
   every command but ``train`` takes SIGINT as Python does by default, a KeyboardInterrupt
   (it has nothing to checkpoint); ``train`` stays in the start-up phase until its run
   begins.
3. **Training** (``training()``, by ``mpips.train`` first thing, through
   ``preemption.install``): SIGTERM, SIGUSR1 and SIGINT are a preemption request. The
   handler only records the first (``requested()``); the training loops poll it at step
   boundaries and spread it to every rank, and the job stops with a checkpoint and exit 3
   (mpips/process/preemption.py). From the first request on the three signals are ignored,
   in the kernel, for DUPLICATE_SECONDS, and then get their default action: one within that
   second is the same request delivered twice (GNU ``timeout`` signals mpirun and then its
   whole process group, so each rank gets it from both), one after it ends the rank at once,
   even a rank stuck in C code (a blocking MPI call), as a thread sets the default action
   through the C library. Outside the main thread, where Python cannot set handlers, a run
   is not stopped by signals.
4. **After** (``after_training(previous)``, when ``mpips.train`` returns): the handlers from
   before the run are back, once the rest of a request's DUPLICATE_SECONDS has passed (its
   duplicate still finds the signals ignored). Under ``python -m mpips train`` that is the
   start-up phase's default action; in a script or notebook, the caller's own (Ctrl-C raises
   KeyboardInterrupt again).

The launcher is no rank, and its rules are not ours. mpirun (MPICH's hydra) forwards SIGINT,
SIGTERM and SIGUSR1 to every rank, but takes any second SIGINT, however soon, for a forced
abort: it kills every rank and exits 255, even after the ranks committed their checkpoint
and chose exit 3. ``srun`` prints the tasks' state at one Ctrl-C and kills them at a second
within a second; ``srun -X`` passes one on as SIGINT and still kills them at a second. A
terminal sends Ctrl-C to its whole foreground process group, so the launcher gets every
press. ``python -m mpips.launch LAUNCHER ...`` (mpips/launch.py, a process of its own
holding no MPI) runs the launcher in a process group of its own, out of the terminal's
reach, and passes signals on to it: SIGINT once, a repeat within DUPLICATE_SECONDS dropped
(the same request, as the ranks take it), a later one passed on (Ctrl-C pressed again later
still aborts the job); the others as they come.

Standard library only: mpips/launch.py imports DUPLICATE_SECONDS from here.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

# (threading and ctypes are imported when training begins, and typing not at all: under
# ``python -m mpips`` this module is imported first, and until start_up() runs Ctrl-C still
# comes as a KeyboardInterrupt, so it imports only what the interpreter already has)

PREEMPTING = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # a request during training
DUPLICATE_SECONDS = 1.0  # a signal this soon after the first is the same request again


class Phase(enum.Enum):
    """Where a rank is in its run, and so what its signals do (see the module's docstring)."""

    START_UP = "start-up"  # SIGINT: its default action (the rank ends at once, quietly)
    COMMAND = "command"  # SIGINT: KeyboardInterrupt (the commands other than train)
    TRAINING = "training"  # SIGTERM, SIGUSR1, SIGINT: a preemption request
    AFTER = "after"  # the handlers from before the run, back


def as_run_from_the_command_line(argv: Sequence[str] | None = None) -> bool:
    """Whether this process is ``python -m mpips ...`` (``argv``: the interpreter's own
    command line, ``sys.orig_argv`` unless given)."""
    argv = list(sys.orig_argv if argv is None else argv)
    return "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["mpips"]


class _Watch:
    """The thread that gives the signals their default action DUPLICATE_SECONDS after the
    first request. Started with the training phase, not by the handler: a thread started
    inside a handler could wait forever on a lock the interrupted main thread holds. It
    sets SIG_DFL through the C library's ``signal()``, made ready here: Python's
    signal.signal works only in the main thread, which may then be stuck in C."""

    def __init__(self) -> None:
        import ctypes
        import threading

        self.libc_signal = ctypes.CDLL(None, use_errno=True).signal
        self.libc_signal.restype = ctypes.c_void_p
        self.libc_signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        self.first = threading.Event()  # set by the handler (no lock the main thread holds)
        self.over = threading.Event()  # set when the training phase ends
        self.thread = threading.Thread(target=self._run, name="mpips-preemption", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.first.wait()
        if not self.over.is_set() and not self.over.wait(DUPLICATE_SECONDS):
            for sig in PREEMPTING:
                self.libc_signal(int(sig), None)  # (SIG_DFL is the null handler)

    def stop(self) -> None:
        self.over.set()
        self.first.set()
        self.thread.join()


class Previous:
    """What the training phase replaced, for ``after_training``: the handlers, and the
    phase the rank was in. (No dataclass: see the imports. ``signal._HANDLER``, typeshed's
    name for what getsignal returns, is only an annotation: never evaluated.)"""

    def __init__(self, handlers: dict[int, signal._HANDLER], phase: Phase | None) -> None:
        self.handlers, self.phase = handlers, phase


class SignalState:
    """This process's signal state: its phase, the request received in training (its signal
    number, 0 for none, and when), and the thread that watches for a second one."""

    def __init__(self) -> None:
        self.phase: Phase | None = None  # None: no phase begun (a library import)
        self.received = 0
        self.received_at = 0.0
        self.watch: _Watch | None = None
        # survive mode (mpips/store/liveness.py): whether a SIGUSR1 is hydra's notice that a
        # rank of the node died or left (no request); None: every SIGUSR1 is a request
        self.notice: Callable[[], bool] | None = None
        self.departing = False  # leaving after a loss: SIGUSR1 ignored to the end

    def start_up(self) -> None:
        """Phase 1, under ``python -m mpips`` only: SIGINT ends this process at once,
        quietly (its default action)."""
        if as_run_from_the_command_line():
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            self.phase = Phase.START_UP

    def command(self, argv: Sequence[str]) -> None:
        """Phase 2, for the CLI's command ``argv[0]``: SIGINT raises KeyboardInterrupt,
        unless the command is ``train`` (its run begins the training phase)."""
        if list(argv[:1]) != ["train"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self.phase = Phase.COMMAND

    def training(self) -> Previous | None:
        """Phase 3: catch the PREEMPTING signals as a request; returns what it replaced, for
        ``after_training``. Outside the main thread it does nothing and returns None."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return None
        if self.watch is not None:  # an earlier run never ended: its watch ends here
            self.watch.stop()
        previous = Previous({int(s): signal.getsignal(s) for s in PREEMPTING}, self.phase)
        self.received = 0
        self.watch = _Watch()
        for sig in PREEMPTING:
            signal.signal(sig, self._handler)
        self.phase = Phase.TRAINING
        return previous

    def _handler(self, signum: int, frame: object) -> None:
        """The first request: recorded; the signals ignored for DUPLICATE_SECONDS (in the
        kernel: no Python code needs to run for it), then given their default action."""
        if self.received:
            return
        if signum == signal.SIGUSR1 and self.notice is not None and self.notice():
            return  # a peer died or left: hydra's notice, not a preemption request
        self.received, self.received_at = signum, time.monotonic()
        for sig in PREEMPTING:
            signal.signal(sig, signal.SIG_IGN)
        if self.watch is not None:
            self.watch.first.set()

    def after_training(self, previous: Previous | None) -> None:
        """Phase 4: the handlers ``training()`` replaced, back (from the main thread), after
        the rest of a request's DUPLICATE_SECONDS."""
        if previous is None:
            return
        if self.received:
            time.sleep(max(0.0, self.received_at + DUPLICATE_SECONDS - time.monotonic()))
        if self.watch is not None:
            self.watch.stop()
            self.watch = None
        for sig, handler in previous.handlers.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        if self.departing or os.environ.get("MPIPS_SUPERVISOR_FD"):  # (see depart)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        self.phase = Phase.TRAINING if previous.phase is Phase.TRAINING else Phase.AFTER

    def depart(self) -> None:
        """Survive mode, at the end of the run: hydra signals SIGUSR1 on the node as each
        rank leaves (after a loss, without MPI_Finalize): ignored from now on, in training
        and after it."""
        self.departing = True
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    def reset(self) -> None:
        """Forget the phase and any request, ending the watch (for tests; the handlers
        stay as they are)."""
        if self.watch is not None:
            self.watch.stop()
        self.phase, self.received, self.received_at, self.watch = None, 0, 0.0, None
        self.notice, self.departing = None, False


STATE = SignalState()  # this process's: never rebound


def start_up() -> None:
    """Begin the start-up phase (``python -m mpips`` only): see SignalState.start_up."""
    STATE.start_up()


def command(argv: Sequence[str]) -> None:
    """Begin the phase of the CLI's command ``argv[0]``: see SignalState.command."""
    STATE.command(argv)


def training() -> Previous | None:
    """Begin the training phase: see SignalState.training."""
    return STATE.training()


def after_training(previous: Previous | None) -> None:
    """End the training phase ``training()`` began: see SignalState.after_training."""
    STATE.after_training(previous)


def requested() -> int:
    """The signal number of the request received in training on this rank (0: none)."""
    return STATE.received

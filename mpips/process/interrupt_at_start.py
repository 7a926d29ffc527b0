"""Ctrl-C while ``python -m mpips`` starts: mpirun forwards it to every rank, and a rank
still importing numpy, MPI and the rest would print a KeyboardInterrupt traceback from the
middle of an import (or crash in one), or, inside MPI_Init (C code, where no Python handler
runs), not notice it at all and wait there for ranks that are gone. Nothing has started
then, so SIGINT keeps its default action, which ends the process at once, wherever it is
(and the launcher then ends the job); ``mpips train`` keeps this until it installs its own
handling (preemption.install: a checkpoint, exit 3), the other commands until the CLI is
imported."""

from __future__ import annotations

import signal
import sys


def quiet_interrupt() -> None:
    """From now on, SIGINT ends this process at once, quietly (its default action)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def as_run_from_the_command_line() -> bool:
    """Whether this process is ``python -m mpips ...``."""
    argv = sys.orig_argv
    return "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["mpips"]


if as_run_from_the_command_line():  # (imported first by the package: see above)
    quiet_interrupt()

"""Ctrl-C while ``python -m mpips`` starts: mpirun forwards it to every rank, and a rank
still importing numpy, MPI and the rest would print a KeyboardInterrupt traceback from the
middle of an import (or crash in one). Nothing has started then, so each rank ends at once
and quietly, with 130; ``mpips train`` keeps this until it installs its own handling
(preemption.install: a checkpoint, exit 3), the other commands until the CLI is imported."""

from __future__ import annotations

import os
import signal
import sys


def _end(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def quiet_interrupt() -> None:
    """From now on, SIGINT ends this process at once, quietly."""
    signal.signal(signal.SIGINT, _end)


def as_run_from_the_command_line() -> bool:
    """Whether this process is ``python -m mpips ...``."""
    argv = sys.orig_argv
    return "-m" in argv and argv[argv.index("-m") + 1 :][:1] == ["mpips"]


if as_run_from_the_command_line():  # (imported first by the package: see above)
    quiet_interrupt()

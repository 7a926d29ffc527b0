"""Log lines that name the task: ``[/job:worker/task:3] step 120 ...``.

Two levels, so that a first run prints a handful of lines: ``log`` for what every run says
(start, progress, warnings, the result), ``detail`` for what one looks at when something is
off (each rank's pid, each worker's rows and "done" line, per-worker statistics that the
result file holds anyway). Details are printed when ``MPIPS_VERBOSE=1`` (mpips.process.settings)
or after ``set_verbose(True)`` (``-v/--verbose``).
"""

from __future__ import annotations

import sys

from . import settings


class Verbosity:
    """Whether ``detail`` lines are printed, as ``-v/--verbose`` said (``word``; None: as
    MPIPS_VERBOSE says)."""

    def __init__(self) -> None:
        self.word: bool | None = None

    def reset(self) -> None:
        """Back to MPIPS_VERBOSE's say (for tests)."""
        self.word = None


VERBOSITY = Verbosity()  # this process's: never rebound


def set_verbose(on: bool) -> None:
    """Print ``detail`` lines too (``-v/--verbose``); MPIPS_VERBOSE sets the default."""
    VERBOSITY.word = on


def counted(n: int, noun: str) -> str:
    """``1 worker``, ``6 workers``: a count with its noun, for the lines users read."""
    return f"{n} {noun}{'s' * (n != 1)}"


def verbose() -> bool:
    """Whether ``detail`` lines are printed (a line never fails: a bad MPIPS_VERBOSE reads
    as unset here, and start-up says it)."""
    word = VERBOSITY.word
    return settings.cached().verbose if word is None else word


def log(role: object, message: str) -> None:
    """Print one whole line in a single write, so mpirun never splices two ranks' lines."""
    sys.stdout.write(f"[{role}] {message}\n")
    sys.stdout.flush()


def detail(role: object, message: str) -> None:
    """A line only a verbose run prints (see the module's docstring)."""
    if verbose():
        log(role, message)

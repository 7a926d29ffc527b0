"""Kept for the package's ``from .process import interrupt_at_start``, its first line: that
import begins the start-up phase of mpips/process/signals.py (under ``python -m mpips``
only: Ctrl-C ends the rank at once, quietly, while it imports). Once mpips/__init__.py calls
``signals.start_up()`` itself, this module goes."""

from __future__ import annotations

from .signals import as_run_from_the_command_line, start_up

__all__ = ["as_run_from_the_command_line", "quiet_interrupt"]


def quiet_interrupt() -> None:
    """Begin the start-up phase (signals.start_up)."""
    start_up()


quiet_interrupt()  # (the one import with an effect, until the package calls it itself)

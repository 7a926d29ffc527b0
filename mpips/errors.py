"""User-facing errors: one readable message and exit code 2, never a traceback storm."""
from __future__ import annotations


class MpipsError(Exception):
    """A problem with the user's input or environment (job, layout, data, checkpoint).

    The CLI prints only the message and exits with ``exit_code``.
    """

    exit_code = 2


class ConfigError(MpipsError):
    """Malformed job or layout file."""


class DataError(MpipsError):
    """Missing or malformed input data."""


class CheckpointError(MpipsError):
    """Missing, corrupt or incompatible checkpoint."""


class AgreedError(MpipsError):
    """An error every rank knows about (raised collectively), so each rank can exit cleanly."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class Stalled(MpipsError):
    """A task stopped making progress in the middle of a run (hung, not dead)."""

    exit_code = 1

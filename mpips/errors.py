"""User-facing errors: one readable message and a documented exit code, never a traceback storm.

Exit codes: 2 bad input (job, layout, data, checkpoint), 1 a failure during the run (a hung or
dead task, a loss that is not finite, replicas that diverged), 3 stopped early by a signal
(see process/preemption.py).
"""

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
    """Missing, corrupt or incompatible checkpoint, or a checkpoint directory that cannot be
    written."""


class AgreedError(MpipsError):
    """An error every rank knows about (raised collectively), so each rank can exit cleanly:
    rank 0 says it once."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class AlreadyReported(MpipsError):
    """Another rank has already reported this failure (or is reporting it): abort quietly, a
    little later than that rank, so the failure is said once."""

    exit_code = 1


class Stalled(MpipsError):
    """A task stopped making progress in the middle of a run (hung, not dead)."""

    exit_code = 1


class StartTimeout(Stalled):
    """Some rank never reached a start-up step (or the end of the run)."""


class ExitDuringTraining(MpipsError):
    """``sys.exit()`` called by a model or a hook while a job trains: on one rank it would
    leave the others waiting for that rank until a watchdog's timeout (and blame a hang),
    so the whole job ends at once, this rank named. The exit code is kept where it is one
    (else 1: the run did not finish, whatever the code)."""

    def __init__(self, code: object):
        self.exit_code = code if isinstance(code, int) and code else 1
        shown = "" if code is None else repr(code)
        super().__init__(
            f"sys.exit({shown}) was called during training (by the model or a hook); the "
            "other ranks cannot go on without this one. Raise an exception for an error, "
            "or call run.request_stop() in a hook to end the run with a checkpoint"
        )


class NonFinite(MpipsError):
    """A loss or a variable became NaN or infinite (TensorFlow's NanTensorHook): training
    stops, and no checkpoint holding such values is committed."""

    exit_code = 1


class PlacementMismatch(AgreedError):
    """Ranks computed different placement tables (e.g. variables created in another order)."""


class ReplicasDiverged(MpipsError):
    """Sync replicas are no longer bitwise identical (the chief says it; the other replicas
    know it too and end quietly)."""

    exit_code = 1


class DeadlineMissed(RuntimeError):
    """A wait's ``on_timeout`` returned instead of raising (a bug in mpips, not the job)."""

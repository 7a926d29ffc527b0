"""mpips: parameter-server training on MPI.

A thin public face: load a job, train it (collectively, under mpirun), hook into the loop.
``import mpips`` does not initialise MPI; ``mpips.train`` does, on first use.
"""

from .process import signals

signals.start_up()  # first, before numpy: Ctrl-C while `python -m mpips` starts

from typing import Any

from . import layers
from .errors import MpipsError
from .job import Job, load_job, parse_job
from .models.contract import Model, Variable
from .process.failure import abort_on_error
from .run.hooks import Hook, Run, StepInfo, StopAtLoss, StopAtStep

__version__ = "0.1.0"  # the one place the version is set (setup.cfg reads it)
__all__ = [
    "Hook",
    "Job",
    "Model",
    "MpipsError",
    "Run",
    "StepInfo",
    "StopAtLoss",
    "StopAtStep",
    "TrainResult",
    "Variable",
    "abort_on_error",
    "layers",
    "load_job",
    "parse_job",
    "train",
]


def __getattr__(name: str) -> Any:
    if name in ("train", "TrainResult"):  # imports mpi4py.MPI, which initialises MPI
        from . import training

        return getattr(training, name)
    raise AttributeError(f"module 'mpips' has no attribute {name!r}")

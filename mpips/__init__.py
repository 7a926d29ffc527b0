"""mpips: parameter-server training on MPI.

A thin public face: load a job, train it (collectively, under mpirun), hook into the loop.
"""
from .errors import MpipsError
from .failure import abort_on_error
from .hooks import Hook, StepInfo
from .job import Job, load_job, parse_job
from .train import TrainResult, train

__version__ = "0.1.0"
__all__ = ["Hook", "Job", "MpipsError", "StepInfo", "TrainResult", "abort_on_error",
           "load_job", "parse_job", "train"]

"""PS memory and everything that moves data over MPI (with mpips.allreduce for sync mode):
cluster collectives and arrival checks, the windows, pull/push/initialise, the control
counters (RunControl), the mailbox protocol, PS serving and the hung-task watchdog. The rest
of mpips uses what is exported here and touches no ``MPI.Win``."""

from . import liveness
from .client import StoreClient
from .cluster import (
    Cluster,
    agreed,
    allgather_json,
    barrier,
    node_of_each_rank,
    stall_limit,
    stall_timeout,
    start_limit,
    start_timeout,
    unreachable,
    wait,
    watched_barrier,
)
from .control import NO_MORE_TICKETS, RunControl
from .mailbox import publish_start_step
from .rules import Apply
from .server import StepPolicy, serve
from .watchdog import Watchdog
from .window import TICKETS, Exposed, NodeShared, WindowPlan, Windows, has_inboxes, updates_in_place

__all__ = [
    "Apply",
    "NO_MORE_TICKETS",
    "TICKETS",
    "Cluster",
    "Exposed",
    "NodeShared",
    "RunControl",
    "StepPolicy",
    "StoreClient",
    "Watchdog",
    "WindowPlan",
    "Windows",
    "agreed",
    "allgather_json",
    "barrier",
    "has_inboxes",
    "liveness",
    "updates_in_place",
    "node_of_each_rank",
    "publish_start_step",
    "serve",
    "stall_limit",
    "stall_timeout",
    "start_limit",
    "start_timeout",
    "unreachable",
    "wait",
    "watched_barrier",
]

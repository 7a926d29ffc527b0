"""Synchronous replicas' data movement: gradient buckets reduced over the replicas and the
update sharded over them (mechanism: it imports no policy). Import from here: the modules
inside are the package's own business (buckets.py composes layout.py, step.py and one
transport of solo.py, shared.py and messages.py; agreement.py holds the small collectives).
"""

from .agreement import (
    agree_max,
    broadcast,
    check_replicas,
    complete,
    forward_stop,
    idle_until_end,
    replica_hash,
    stop_from_ps,
)
from .buckets import GradientBuckets
from .layout import Update

__all__ = [
    "GradientBuckets",
    "Update",
    "agree_max",
    "broadcast",
    "check_replicas",
    "complete",
    "forward_stop",
    "idle_until_end",
    "replica_hash",
    "stop_from_ps",
]

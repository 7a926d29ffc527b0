"""Synchronous replicas' data movement: gradient buckets reduced over the replicas and the
update sharded over them (mechanism: it imports no policy). Import from here: the modules
inside are the package's own business."""

from .buckets import (
    GradientBuckets,
    Update,
    agree_max,
    broadcast,
    check_replicas,
    complete,
    forward_stop,
    idle_until_end,
    replica_hash,
    stop_from_ps,
)

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

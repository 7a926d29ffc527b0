"""PS side of the store. Plain SGD needs no PS code in the hot path: Accumulate is atomic
per element, so a PS only keeps its window alive, asleep, until every worker is done."""
from __future__ import annotations

from .cluster import Cluster, sleepy_barrier


def serve(cluster: Cluster) -> None:
    """Hold this PS's window open until all ranks reach the end-of-run barrier."""
    sleepy_barrier(cluster.comm)

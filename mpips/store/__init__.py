"""The only package (with sync.py) that moves data over MPI: cluster collectives and PS windows."""
from .client import StoreClient
from .cluster import Cluster, agreed, allgather_json, barrier
from .counters import Counters
from .server import serve
from .window import Windows

__all__ = ["Cluster", "Counters", "StoreClient", "Windows", "agreed", "allgather_json",
           "barrier", "serve"]

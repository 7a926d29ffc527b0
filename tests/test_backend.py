"""Device selection for GPU workers, tested with a stand-in array module (no GPU needed)."""
import sys
import types

import numpy as np
import pytest

from mpips.backend import get_xp
from mpips.errors import ConfigError
from mpips.layout import make_layout


def fake_cupy(count=None, error=None):
    """A module that looks like cupy to get_xp: ``count`` visible devices, or ``error`` when
    asked (no driver); it records which device was made current."""
    cupy = types.ModuleType("cupy")
    used = []

    def get_count():
        if error is not None:
            raise error
        return count

    class Device:
        def __init__(self, index):
            self.index = index

        def use(self):
            used.append(self.index)

    cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count),
                                      Device=Device)
    return cupy, used


def test_cpu_is_numpy():
    assert get_xp("cpu", 5) is np


def test_a_missing_cuda_driver_is_a_clear_config_error(monkeypatch):
    cupy, _ = fake_cupy(error=RuntimeError("cudaErrorInsufficientDriver: CUDA driver version "
                                           "is insufficient for CUDA runtime version"))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    with pytest.raises(ConfigError, match=r'train.device = "gpu" but CUDA cannot be used here: '
                                          r'RuntimeError: cudaErrorInsufficientDriver'):
        get_xp("gpu", 0)
    cupy, _ = fake_cupy(count=0)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        get_xp("gpu", 0)


def test_each_worker_of_a_node_gets_its_own_gpu(monkeypatch):
    """2 nodes x 4 ranks, one PS on each (ranks 0 and 4), 2 GPUs per node: the three workers
    of a node use GPUs 0, 1, 0 (by worker index, not by local rank, which counts the PS and
    would put two workers on GPU 1 while GPU 0 had one)."""
    from mpips.store.cluster import Cluster
    layout = make_layout(8, [0, 4])
    nodes = [(0, 1, 2, 3), (4, 5, 6, 7)]
    got = {}
    for node in nodes:
        for rank in node:
            if rank in layout.ps_ranks:
                continue
            cluster = object.__new__(Cluster)  # no MPI: only what the property reads
            cluster.layout, cluster.rank, cluster.node_ranks = layout, rank, node
            cupy, used = fake_cupy(count=2)
            monkeypatch.setitem(sys.modules, "cupy", cupy)
            assert get_xp("gpu", cluster.local_worker_index) is cupy
            got[rank] = used[0]
    assert got == {1: 0, 2: 1, 3: 0, 5: 0, 6: 1, 7: 0}

"""Array backend: numpy on the CPU, cupy on a GPU (one device per local rank); BLAS pinning."""
from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import numpy as np

from .errors import ConfigError


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def pin_blas_threads(local_size: int) -> int:
    """Give each of the ``local_size`` ranks on this node an equal share of the cores.

    Default BLAS threading made the reference MLP ~10x slower with 8 ranks on 2 cores.
    """
    from threadpoolctl import threadpool_limits
    threads = max(1, cpu_count() // max(1, local_size))
    threadpool_limits(limits=threads)
    return threads


def get_xp(device: str, local_rank: int = 0) -> ModuleType:
    """numpy for "cpu"; cupy on GPU ``local_rank % device_count`` for "gpu"."""
    if device == "cpu":
        return np
    try:
        import cupy
    except ImportError:
        raise ConfigError('train.device = "gpu" needs cupy (pip install "mpips[gpu]")') from None
    count = cupy.cuda.runtime.getDeviceCount()
    if count == 0:
        raise ConfigError('train.device = "gpu" but no CUDA device is visible')
    cupy.cuda.Device(local_rank % count).use()
    return cupy


def to_device(xp: ModuleType, a: np.ndarray) -> Any:
    return a if xp is np else xp.asarray(a)


def to_host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()

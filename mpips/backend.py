"""Array backend: numpy on the CPU, cupy on a GPU (one device per worker on a node); BLAS
pinning."""
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


def get_xp(device: str, local_worker: int = 0) -> ModuleType:
    """numpy for "cpu"; for "gpu", cupy on GPU ``local_worker % visible GPUs``.

    ``local_worker`` is the worker's index among the workers on its node (PS ranks do not
    count, so no GPU idles while two workers share one). GPUs are those CUDA_VISIBLE_DEVICES
    leaves visible (Slurm's --gpus-per-task sets it per rank: each rank then sees its own).
    """
    if device == "cpu":
        return np
    try:
        import cupy
    except ImportError:
        raise ConfigError('train.device = "gpu" needs cupy (pip install "mpips[gpu]")') from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, a driver too old for this cupy, no device nodes
        raise ConfigError(f'train.device = "gpu" but CUDA cannot be used here: '
                          f'{type(e).__name__}: {e}') from None
    if count == 0:
        raise ConfigError('train.device = "gpu" but no CUDA device is visible')
    cupy.cuda.Device(local_worker % count).use()
    return cupy


def to_device(xp: ModuleType, a: np.ndarray) -> Any:
    return a if xp is np else xp.asarray(a)


def to_host(a: Any) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else a.get()

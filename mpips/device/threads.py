"""A rank's BLAS (and OpenMP) threads: its share of the node's cores, or the count the user
set (MPIPS_BLAS_THREADS, or a library's own variable)."""

from __future__ import annotations

import os

from ..process import settings


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


BLAS_THREADS_ENV = "MPIPS_BLAS_THREADS"  # a rank's BLAS threads, set by hand (benchmarks)
# the variables each kind of threaded library reads at load (threadpoolctl's internal_api):
# a count the user set there wins over the share mpips would give the rank
LIBRARY_THREAD_VARIABLES = {
    "openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"),
    "mkl": ("MKL_NUM_THREADS", "OMP_NUM_THREADS"),
    "blis": ("BLIS_NUM_THREADS", "OMP_NUM_THREADS"),
    "flexiblas": ("FLEXIBLAS_NUM_THREADS", "OMP_NUM_THREADS"),
}


def node_blas_threads(cores: int, ranks: int, ps: int = 0) -> list[int]:
    """BLAS threads of each of the ``ranks`` ranks on a node of ``cores`` cores, ``ps`` of
    them PS tasks: the PS tasks' first, then the workers' in their order on the node.

    A PS task computes no matrix products (its updates are serial kernels), so it gets 1;
    the workers split the other cores, the remainder going one each to the first workers, so
    the node's total is its cores: 1 PS + 8 workers on 16 cores is 1 + 7 x 2 + 1 (an even
    split of 16 // 9 left 7 cores idle). With more ranks than cores every rank gets 1.
    """
    if cores < 1 or ranks < 1 or not 0 <= ps <= ranks:
        raise ValueError(f"node_blas_threads({cores}, {ranks}, {ps}): no such node")
    workers = ranks - ps
    base, extra = divmod(max(0, cores - ps), workers) if workers else (0, 0)
    return [1] * ps + [max(1, base + (i < extra)) for i in range(workers)]


def blas_threads_override() -> int | None:
    """The threads MPIPS_BLAS_THREADS asks for (None when unset or empty; ConfigError for a
    bad value)."""
    return settings.current().blas_threads


def user_thread_count(internal_api: str) -> str | None:
    """The variable that sets the threads of a library of kind ``internal_api`` (openblas,
    mkl, blis, openmp, ...) where the user set one (``OMP_NUM_THREADS=1``), else None. The
    library read it when it loaded, so leaving it alone keeps the user's count."""
    set_here = settings.current().thread_variables
    names = LIBRARY_THREAD_VARIABLES.get(internal_api, ("OMP_NUM_THREADS",))
    return next((n for n in names if n in set_here), None)


def pin_blas_threads(
    local_size: int, ps_on_node: int | None = None, local_worker: int | None = None
) -> int:
    """Limit this rank's BLAS threads to its share of the node's cores; returns the share.

    With ``ps_on_node`` (the PS tasks among the ``local_size`` ranks on this node), the share
    is ``node_blas_threads``'s: 1 for a PS task (``local_worker`` None), else worker number
    ``local_worker`` of the node's workers gets its part of the other cores. Without it,
    every rank gets ``cores // local_size`` (the rule before PS tasks were told apart).
    MPIPS_BLAS_THREADS, when set, is the share of every library. Otherwise a library whose
    own thread count the user set (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS,
    ...: user_thread_count) keeps it, and the others get the share. Default BLAS threading
    made the reference MLP ~10x slower with 8 ranks on 2 cores.
    """
    from threadpoolctl import ThreadpoolController

    threads = blas_threads_override()
    by_hand = threads is not None
    if threads is None:
        if ps_on_node is None:
            threads = max(1, cpu_count() // max(1, local_size))
        else:
            shares = node_blas_threads(cpu_count(), max(1, local_size), ps_on_node)
            threads = 1 if local_worker is None else shares[ps_on_node + local_worker]
    for library in ThreadpoolController().lib_controllers:
        if by_hand or user_thread_count(library.internal_api) is None:
            library.set_num_threads(threads)
    return threads

"""``train``: choose the training mode (mpips.modes), map the ranks to tasks, check
everything at start-up, then hand over to the mode."""

from __future__ import annotations

import copy
import dataclasses
import os
import shlex
import socket
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from mpi4py import MPI

from . import checkpoint, modes, optim
from .data.batches import open_data
from .device.backend import Device
from .device.threads import pin_blas_threads
from .errors import ConfigError, ExitDuringTraining
from .job import Job
from .models.contract import Model, factory_name
from .models.mlp import build_model
from .optim import build_optimizer, unused_settings
from .placement.layout import node_indices, ps_imbalance
from .process import preemption, settings
from .process.failure import set_role
from .process.log import detail, log
from .process.settings import launch_hint
from .run.hooks import Hook
from .run.result import TrainResult
from .run.startup import Prepared, StartUp, check_same_model, prepare
from .store import (
    Cluster,
    agreed,
    allgather_json,
    has_inboxes,
    node_of_each_rank,
    start_timeout,
    updates_in_place,
)

__all__ = ["TrainResult", "train"]


def train(
    job: Job,
    hooks: Iterable[Hook] | None = (),
    comm: MPI.Intracomm | None = None,
    model: Any = None,
    data: Mapping[str, tuple[Any, Any]] | None = None,
) -> TrainResult:
    """Run ``job`` on every rank of ``comm`` (collective): PS ranks serve, workers train.

    ``model``: a model of your own (an ``mpips.Model``, or a callable ``factory(data,
    **job.model.args)`` returning one) instead of the job's ``model.kind``. ``data``: your
    arrays instead of the job's [data]: ``{"train": (x, y), "test": (x, y)}`` and optionally
    ``"val"`` (numpy arrays, memory maps or h5py datasets; every rank passes the same; each
    worker reads only its part). On one process (no mpirun) the job trains as a single
    synchronous replica, to debug a model locally.
    """
    previous = preemption.install()  # first: a signal during start-up acts at the first step
    try:
        return _collective_train(job, hooks, comm or MPI.COMM_WORLD, model, data)
    finally:  # the caller's handlers back (a notebook's Ctrl-C is KeyboardInterrupt again)
        preemption.restore(previous)


def _collective_train(
    job: Job,
    hooks: Iterable[Hook] | None,
    comm: MPI.Intracomm,
    model: Any,
    data: Mapping[str, tuple[Any, Any]] | None,
) -> TrainResult:
    """train() once the signals are caught."""
    agreed(comm, settings.check)  # first: every later wait's deadline is one of them
    mode = agreed(comm, lambda: modes.select(job, comm.size))  # (its rules: one message)
    note = one_process_note(job) if mode.single else ""
    job = as_run(job, mode, model)
    nodes = node_of_each_rank(comm)
    layout = agreed(comm, lambda: mode.layout(job, comm.size, nodes))
    cluster = Cluster(comm, layout)
    set_role(cluster.role)
    spread = ps_imbalance(layout.ps_ranks, nodes) if mode.ps_holds_variables else None
    if cluster.rank == 0:
        warnings = [spread] if spread else []
        for warning in warnings + unused_settings(job.optimizer) + settings.unknown():
            log(cluster.role, f"warning: {warning}")
    # which process plays which task (a rank killed outright is named by the failure watcher)
    node = node_indices(nodes)
    detail(
        cluster.role,
        f"rank {cluster.rank}, pid {os.getpid()} on {socket.gethostname()}, node "
        f"{node[cluster.rank]} of {max(node) + 1}",
    )
    if note:
        log(cluster.role, note)
    # numpy's overflow warnings, one storm per rank, give way to the check that stops the
    # job at the first loss that is not finite (naming the worker and the global step)
    try:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            result = _train(job, mode, cluster, list(hooks or ()), model, data)
    except SystemExit as e:  # (not an Exception: it would end this rank alone)
        raise ExitDuringTraining(e.code) from None
    finally:  # the run is over, whether or not it raised: another run may take the directory
        if job.checkpoint.dir:
            checkpoint.release_directory(job.checkpoint.dir)
    cluster.free()  # collective: only on success (an error aborts the world instead)
    return result


def as_run(job: Job, mode: modes.Mode, model: Any = None) -> Job:
    """The job as this run records it (manifest, digest, layout): a copy with the mode it
    trains in (one process: sync, unbounded, and no [layout]: its PS tasks, world size,
    pins and partitions are for a launch with several ranks) and the name of a model of
    your own as model.kind. The caller's Job is left as it was (every part copied, so a
    hook that changes run.job changes only this run's)."""
    job = copy.deepcopy(job)
    if mode.single:
        job.train.mode, job.train.max_staleness = mode.name, None
        job.layout = dataclasses.replace(
            job.layout,
            ps=None,
            world_size=None,
            pin={},
            partition=[],
            partition_min_bytes=0,
            pins_take_turns=False,
        )
    if model is not None:
        job.model.kind = factory_name(
            model if callable(model) and not isinstance(model, Model) else type(model)
        )
    return job


def _train(
    job: Job,
    mode: modes.Mode,
    cluster: Cluster,
    hooks: list[Hook],
    factory: Any,
    arrays: Mapping[str, tuple[Any, Any]] | None,
) -> TrainResult:
    optimizer = build_optimizer(job.optimizer)
    device = agreed(
        cluster.comm,
        lambda: (
            Device()
            if cluster.is_ps
            else Device.select(job.train.device, cluster.local_worker_index)
        ),
    )
    if not device.on_host:  # where the GPU work runs: the chief says it, each worker in detail
        say = log if cluster.is_chief else detail
        say(cluster.role, f"computing on {device.describe()}")

    def start() -> Prepared:
        model = factory
        if cluster.comm.size == 1:  # (one process: the model built first, to name it)
            model = one_process_model(job, device.xp, factory, arrays)
        return prepare(StartUp(job, mode, cluster, optimizer, device.xp), model, arrays)

    prep = agreed(cluster.comm, start)
    agreed(cluster.comm, lambda: check_same_model(cluster, prep.fingerprints))
    ctx = modes.RunContext(job, mode, cluster, optimizer, prep, device, hooks)
    if job.train.zero_copy is None:  # (job: this run's copy) unset: the mode's default here
        mine = agreed(cluster.comm, lambda: mode.zero_copy(ctx))
        every = allgather_json(cluster.comm, mine, "the zero-copy check", start_timeout())
        job.train.zero_copy = all(every)
        if job.train.zero_copy and cluster.is_chief:
            detail(
                cluster.role,
                "every rank on one node: the workers read and update the PS memory in place "
                "(train.zero_copy; set it to false for copied pulls)",
            )
    elements = kernel_elements(ctx)
    optimizer, kernel = optim.plan_kernel(optimizer, elements)
    _await_kernel(cluster, kernel, elements)
    # a PS task 1 BLAS thread, the node's workers the other cores (none left idle); after
    # the kernel: numba's import loads scipy's BLAS too, pinned likewise
    ps_here = sum(r in cluster.layout.ps_ranks for r in cluster.node_ranks)
    pin_blas_threads(
        cluster.local_size,
        ps_on_node=ps_here,
        local_worker=None if cluster.is_ps else cluster.local_worker_index,
    )
    return mode.train(replace(ctx, optimizer=optimizer))  # (the kernel's, where it loads one)


def _await_kernel(cluster: Cluster, kernel: str | None, elements: int) -> None:
    """Before the first step: the fused kernel plan_kernel started loading, so that its
    compile (or load from numba's cache) is not among the run's steps."""
    if kernel is None:
        return
    t0 = time.perf_counter()
    ready = optim.await_kernel(kernel, start_timeout())
    took = time.perf_counter() - t0
    detail(
        cluster.role,
        f"fused {kernel} kernel {'ready' if ready else 'still loading'} after {took:.2f} s "
        f"at start-up (updates of {elements} elements pay for it)",
    )


def kernel_elements(ctx: modes.RunContext) -> int:
    """The float32 elements one update of this process applies the optimizer's rule to on
    the CPU (0: it applies none), which decides whether it loads the fused kernel
    (optim.plan_kernel). A replica (sync; hybrid's dense part) updates its share of the
    dense variables; a PS task its part, where it applies the updates; a worker every
    stored variable, where it updates the PS memory in place (zero copy). A table counts
    the rows a batch touches."""
    job, mode, cluster, model = ctx.job, ctx.mode, ctx.cluster, ctx.model
    if model is None or (job.train.device != "cpu" and not cluster.is_ps):
        return 0
    workers = cluster.layout.num_workers
    dense = sum(_float32(s.shape, s.dtype) for s in model.variables())
    if not mode.ps_holds_variables:  # sync replicas: each updates its 1/W part
        return 0 if cluster.is_ps else dense // workers
    placement = mode.store_placement(job, model, cluster.layout.num_ps)
    zero_copy, touched = (
        bool(job.train.zero_copy),
        job.train.batch_size * max(1, ctx.prep.info.max_nnz),
    )

    def size(entries: Iterable[Any]) -> int:
        return sum(
            _float32((min(len(range(*e.rows)), touched), *e.spec.shape[1:]), e.spec.dtype)
            if e.table and e.rows
            else _float32(e.spec.shape, e.spec.dtype)
            for e in entries
        )

    if cluster.is_ps:
        applies = has_inboxes(placement, zero_copy, mode.ps_applies(ctx.optimizer.stateful))
        return size(placement.on_ps(cluster.role.task)) if applies else 0
    held = 0 if mode.dense_on_ps else dense // workers  # (hybrid: the replicas' dense part)
    return held + (size(placement) if updates_in_place(placement, zero_copy) else 0)


def _float32(shape: Iterable[int], dtype: str) -> int:
    """The elements of an array of ``shape`` if it is float32 (the kernels' one type)."""
    return int(np.prod(tuple(shape))) if np.dtype(dtype) == np.float32 else 0


def one_process_note(job: Job) -> str:
    """What a run in one process (no mpirun) says first: it trains as one synchronous
    replica, the job's [layout] waits for a launch with several ranks (how, under Slurm
    too), and a Slurm allocation of several tasks that started one process is named."""
    note = (
        f"one process (no {settings.launcher()}): training as a single synchronous replica, "
        f"to try a model out"
    )
    size = job.layout.world_size
    if size:
        note += f"; the job's [layout] (world_size = {size}) applies under {launch_hint(size)}"
    else:
        note += f"; run under {launch_hint('N')} for ps/worker training"
    tasks = settings.lenient().slurm_tasks
    if settings.lenient().slurm and tasks and tasks > 1:
        note += (
            f" (this Slurm allocation has {tasks} tasks: srun python -m mpips train ... starts "
            f"one process on each)"
        )
    return note


def one_process_model(
    job: Job, xp: Any, factory: Any, arrays: Mapping[str, tuple[Any, Any]] | None
) -> Model:
    """The job's model for a run in one process (no mpirun): a model with row-partitioned
    tables (the CTR models) needs PS tasks to hold them, which one process has not, so it
    is refused here with its name and the command that runs it under MPI."""
    model = build_model(job.model, open_data(job.data, arrays), xp, job.source, factory)
    refuse_tables_in_one_process(job, model, this_command())
    return model


def refuse_tables_in_one_process(job: Job, model: Model, command: str) -> None:
    """ConfigError for a model with tables on one process (its tables live on PS tasks),
    naming the ``command`` to run under ``mpirun -n 3`` (Slurm: ``srun --ntasks=3``)."""
    if model.tables():
        table = model.tables()[0]
        kind = job.model.kind
        name = kind if kind in ("logreg", "wide_deep") else f"{kind} ({type(model).__name__})"
        raise ConfigError(
            f"model.kind = {name!r} keeps its tables ({table.name} "
            f"{table.dtype}{list(table.shape)}) on PS tasks, and one process "
            f"(no {settings.launcher()}) has none: run it with a PS task and workers, e.g. "
            f"{launch_hint(3)} {command} (1 ps + 2 workers)"
        )


def this_command() -> str:
    """This process's command line as a user would type it (``python -m mpips train
    JOB.toml ...``, or ``python script.py ...``), to show it under mpirun."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(os.path.join("mpips", "__main__.py")):
        argv[0:1] = ["-m", "mpips"]
    return shlex.join(["python", *argv])

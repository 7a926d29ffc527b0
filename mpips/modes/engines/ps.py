"""The PS engine, and the PS tasks' store as the modes that keep variables there use it
(async, sync_replicas, hybrid): open the windows, serve on a PS task, ask the PS tasks for
a checkpoint's shards, close the store at the end."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import checkpoint
from ...job import Job
from ...optim import Optimizer
from ...placement.table import imbalance, slot_placement
from ...process import preemption, settings
from ...process.log import log
from ...run.checkpoints import manifest_meta
from ...run.hooks import PendingSave
from ...run.result import TrainResult
from ...run.startup import table_initial
from ...run.summaries import job_timeline, ps_summaries
from ...store import (
    Apply,
    Cluster,
    RunControl,
    StepPolicy,
    Windows,
    barrier,
    has_inboxes,
    liveness,
    publish_start_step,
    serve,
    stall_limit,
    stall_timeout,
)
from ...store.lookups import DynamicServer
from ..base import RunContext
from . import dynamic_tables
from .dynamic_tables import open_lookups


def open_store(ctx: RunContext) -> Windows:
    """Every rank: the windows of what the PS tasks hold (Mode.store_placement), each PS
    task's memory filled (restored state, fresh table partitions), up to the start barrier."""
    job, mode, cluster, optimizer, prep = ctx.job, ctx.mode, ctx.cluster, ctx.optimizer, ctx.prep
    placement = mode.store_placement(job, prep.model, cluster.layout.num_ps)
    # zero copy: the workers apply their updates in PS memory (store/stripes.py), else a
    # PS task applies those of stateful optimizers and sync_replicas
    zero_copy = bool(job.train.zero_copy)  # (resolved by now: mpips.train)
    inboxes = has_inboxes(placement, zero_copy, mode.ps_applies(optimizer.stateful))
    cluster.check_placement(placement)
    warning = imbalance(placement, job.layout.placement)
    if warning and cluster.is_chief:
        log(cluster.role, warning)
    slots = slot_placement(placement, optimizer.slots) if optimizer.stateful else None
    windows = Windows(
        cluster.comm,
        cluster.layout,
        placement,
        slots,
        inboxes,
        row_capacity=job.train.batch_size * max(1, prep.info.max_nnz),
        shared=zero_copy,
    )
    open_lookups(ctx, windows, windows.row_capacity)  # (dynamic tables)
    liveness.begin(cluster.comm, cluster.layout, mode.name, windows)  # (survive mode)
    if prep.local:  # a PS task: restored state or fresh table partitions
        windows.fill_own(cluster.role.task, prep.local)
    if cluster.is_ps and windows.inboxes:
        # the step it starts from is set before any worker reads it (sync_replicas) or an
        # update is posted (async: a worker counts its update before it is applied)
        publish_start_step(windows, cluster.role.task, cluster.rank, prep.start_step)
    barrier(cluster.comm, "the start of training")  # filled before the chief raises ready
    return windows


def shard_count(num_ps: int, model: Any, chief_writes: bool = False) -> int:
    """A checkpoint's shards: one a PS task, and one the chief writes itself where it holds
    values (``chief_writes``: hybrid's dense part) or the model keeps state (a framework
    module's buffers: the chief's are checkpointed)."""
    return num_ps + int(chief_writes or bool(model is not None and model.state()))


def run_ps(
    ctx: RunContext,
    windows: Windows,
    num_shards: int,
    aggregate: Callable[[Apply], StepPolicy] | None = None,
) -> TrainResult:
    """A PS task: serve until the chief ends the run (applying updates itself for stateful
    optimizers and sync_replicas), writing its checkpoint shard (one of ``num_shards``)
    when asked: its table partitions sparsely where that pays (the model's initial rows
    are the untouched ones), or only their rows changed since its last checkpoint
    (checkpoint.increments). ``aggregate(apply)``: sync_replicas' policy for the gradients
    posted for a step (store.serve), given the rule it applies them with."""
    job, cluster, optimizer = ctx.job, ctx.cluster, ctx.optimizer
    task = cluster.role.task
    dynamic = dynamic_tables.server(ctx, windows)
    write_shard = _shard_writer(ctx, windows, num_shards, dynamic)
    timeline = job_timeline(job, "ps", task)
    apply = optimizer.apply if windows.inboxes else None
    # this PS's apply rate and dynamic tables' counts, where it has them and summaries are on
    rate = ps_summaries(job, task) if apply is not None or dynamic is not None else None
    if apply is not None and rate is not None:
        apply = rate.timed(apply)
    if dynamic is not None and rate is not None:
        dynamic.reports(rate.record, job.summary.every_steps)
    if timeline is not None:
        apply = apply and timeline.timed("apply", apply)
        write_shard = timeline.timed("checkpoint write", write_shard)
    serve(
        cluster,
        windows,
        apply,
        optimizer.slots,
        write_shard if job.checkpoint.dir else None,
        preemption.requested,
        aggregate=aggregate(apply) if aggregate is not None and apply is not None else None,
        on_applied=rate.applied if rate and windows.inboxes else None,
        dynamic=dynamic,
    )
    dynamic_tables.report(ctx, dynamic)
    if rate is not None:
        rate.close()
    if timeline is not None:
        timeline.write()
    return TrainResult(cluster.role, 0, 0)


def _shard_writer(
    ctx: RunContext, windows: Windows, num_shards: int, dynamic: DynamicServer | None
) -> Callable[[int, dict[str, Any], dict[str, Any]], None]:
    """How PS task ``ctx.role.task`` writes its shard of a checkpoint at ``step``: what it
    holds in its window (its table partitions sparsely, or as increments), and its dynamic
    tables' live rows."""
    job, task = ctx.job, ctx.role.task
    tables = sparse_tables(job, windows, task, ctx.model, ctx.optimizer)
    c = job.checkpoint
    increments = checkpoint.Increments(c.increments, int(c.increments_min_mb * 2**20))

    def write_shard(step: int, variables: dict[str, Any], slots: dict[str, Any]) -> None:
        variables, slots = dict(variables), dict(slots)
        marked = dynamic_tables.shard_part(dynamic, variables, slots)
        checkpoint.write_shard(
            c.dir,
            step,
            task,
            num_shards,
            variables,
            slots,
            tables,
            increments=increments,
            dynamic=marked,
        )

    return write_shard


def sparse_tables(
    job: Job, windows: Windows, task: int, model: Any, optimizer: Optimizer
) -> checkpoint.SparseTables | None:
    """What PS ``task`` needs to write its table partitions sparsely: their rows, the seed
    and the model's initial values; None (every array whole) without a model or tables, or
    with MPIPS_SPARSE_CHECKPOINTS=0."""
    rows = {e.name: e.rows for e in windows.placement.on_ps(task) if e.table and e.rows}
    if model is None or not rows or not settings.current().sparse_checkpoints:
        return None
    return checkpoint.SparseTables(rows, job.model.init_seed, table_initial(model, optimizer))


def save_from_ps(
    ctx: RunContext,
    windows: Windows,
    step: int,
    clocks: list[int],
    chief_part: tuple[dict[str, Any], dict[str, Any]] | None = None,
) -> PendingSave:
    """Chief: ask every PS task to write its shard of a checkpoint at ``step`` (in parallel,
    while the chief trains on); ``chief_part`` (variables, slots): what the chief holds
    itself, written now as one more shard (hybrid mode's dense part). The manifest is
    committed once every shard is written (PendingSave.commit)."""
    job, cluster = ctx.job, ctx.cluster
    control, c = RunControl(windows), job.checkpoint
    num_ps = windows.placement.num_ps
    number, asked = control.request_checkpoint(step), time.monotonic()
    limit = stall_timeout()
    variables, slots = checkpoint.index_of(windows.placement, windows.slots)
    shards = num_ps
    if chief_part is not None:
        shards += 1
        checkpoint.write_shard(c.dir, step, num_ps, shards, *chief_part)
        variables.update(checkpoint.whole_index(chief_part[0], num_ps))
        slots.update(checkpoint.whole_index(chief_part[1], num_ps))

    def commit(block: bool) -> Path | None:
        if block:
            control.wait_shards(number, step, limit - (time.monotonic() - asked))
        elif control.shards_missing(number):
            if time.monotonic() - asked > limit:
                control.wait_shards(number, step, 0)  # raises, naming the PS tasks
            return None
        return checkpoint.commit(
            c.dir,
            step,
            shards,
            variables,
            slots,
            manifest_meta(job, cluster, clocks),
            c.max_to_keep,
        )

    return PendingSave(step, commit)


def close_store(cluster: Cluster, windows: Windows, result: TrainResult) -> TrainResult:
    """Every rank, once the chief has ended the run (its last checkpoint and evaluation are
    done): the end barrier (a backstop only: a hung chief is named first by the PS tasks'
    watchdogs), the signal that stopped the run, the windows freed."""
    control = RunControl(windows)
    liveness.ending()  # (survive mode: SIGUSR1 ignored from now on, before the barrier)
    dead = liveness.lost_ranks(control)
    if dead:  # survive mode: only the survivors meet, and nothing is freed (it would hang)
        # (read first: after the meeting the rank that holds the counters may be gone)
        result.stopped_by = control.stop_signal()
        liveness.last_meeting(cluster.comm, dead, stall_limit(cluster.comm.size) + 5)
        cluster.departing = True
    else:
        barrier(cluster.comm, "the end of the run", stall_limit(cluster.comm.size) + 5)
        result.stopped_by = control.stop_signal()
    if not dead:
        windows.free()  # collective, so never in a finally: a failing rank must reach Abort
    return result

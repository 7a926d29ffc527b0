"""Dynamic tables (``tables.kind = "dynamic"``) in the modes that keep tables on the PS
tasks (async, hybrid): which tables, the checks, the lookup window every rank opens, a PS
task's rows (fresh, or the rows it owns restored from a checkpoint of any layout), what it
writes into its checkpoint shard, and what it reports."""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import checkpoint
from ...checkpoint.dynamic import IDS, marked
from ...errors import CheckpointError, ConfigError
from ...job import Job
from ...models.variables import VariableSpec
from ...optim.rules import apply_rowwise_adagrad
from ...process.log import log
from ...store import Windows
from ...store.dynamic_rows import DynamicRows, Policy, owner_of
from ...store.lookups import DynamicServer, DynamicSpec, Lookups
from ..base import RunContext


def dynamic_specs(job: Job, model: Any) -> list[DynamicSpec]:
    """The model's tables, if the job makes them dynamic (else none)."""
    if job.tables.kind != "dynamic" or model is None:
        return []
    return [
        DynamicSpec(t.name, int(np.prod(t.shape[1:])), np.dtype(t.dtype)) for t in model.tables()
    ]


def open_lookups(ctx: RunContext, windows: Windows, capacity: int) -> None:
    """Every rank (collective): the window of the dynamic tables, if any, for ``capacity``
    ids a pull."""
    tables = dynamic_specs(ctx.job, ctx.model)
    if tables:
        comm, ranks = ctx.cluster.comm, ctx.cluster.layout.ps_ranks
        t = ctx.job.tables
        windows.lookups = Lookups(comm, ranks, tables, capacity, (t.cache_rows, t.cache_steps))


def ps_rows(ctx: RunContext) -> DynamicRows:
    """PS task: its rows of the dynamic tables, restored from the checkpoint start-up found
    (the rows whose ids it owns), or none yet."""
    job, model, optimizer = ctx.job, ctx.model, ctx.optimizer
    seed, t = job.model.init_seed, job.tables
    rowwise = t.optimizer == "rowwise_adagrad"
    first = job.optimizer.initial_accumulator_value
    specs = dynamic_specs(job, model)

    def initial(ids: np.ndarray) -> dict[str, dict[str, np.ndarray]]:
        out = {}
        for s in specs:
            values = model.initial_rows_of(s.name, ids, seed)
            if rowwise:
                out[s.name] = {"": values, "accumulator": np.full((len(ids), 1), first, s.dtype)}
            else:
                out[s.name] = {"": values, **optimizer.init_slots(values)}
        return out

    rows = DynamicRows(
        {s.name: s.width for s in specs},
        specs[0].dtype,
        optimizer.slots,
        initial,
        Policy(t.capacity, t.min_count, t.ttl_steps),
        storage=np.dtype(t.dtype),
        rowwise=rowwise,
    )
    if ctx.prep.restored is not None:
        _restore(ctx, rows)
    return rows


def _restore(ctx: RunContext, rows: DynamicRows) -> None:
    """The rows this task owns of each table, from the checkpoint start-up restored."""
    assert ctx.prep.restored is not None
    ckpt = checkpoint.Checkpoint(ctx.prep.restored)
    task, num_ps = ctx.role.task, ctx.cluster.layout.num_ps
    ids, values = None, {}
    for name in rows.widths:
        if name + IDS not in ckpt.variables:
            raise CheckpointError(
                f"checkpoint {ckpt.path}: table '{name}' was written as a fixed table; "
                f'tables.kind = "dynamic" restores only what a dynamic table wrote'
            )
        names = [name, name + IDS]
        specs = [VariableSpec(n, ckpt.variables[n].shape, ckpt.variables[n].dtype) for n in names]
        slots = [f"{name}/{s}" for s in rows.slot_names]
        slot_specs = [VariableSpec(n, ckpt.slots[n].shape, ckpt.slots[n].dtype) for n in slots]
        got = ckpt.read(specs, slot_specs, finite="restore an earlier checkpoint")
        if ids is None:
            ids = got[name + IDS]
        elif not np.array_equal(ids, got[name + IDS]):
            raise CheckpointError(
                f"checkpoint {ckpt.path}: the dynamic tables' ids differ ('{name}' has "
                f"others): not written by mpips, or damaged"
            )
        values[name] = {"": got[name]} | {s: got[f"{name}/{s}"] for s in rows.slot_names}
    if ids is None:
        return
    if len(np.unique(ids)) < len(ids):
        raise CheckpointError(
            f"checkpoint {ckpt.path}: a dynamic table holds an id twice: not written by "
            f"mpips, or damaged"
        )
    mine = owner_of(ids, num_ps) == task
    cap = ctx.job.tables.capacity
    if cap and int(mine.sum()) > cap:
        raise ConfigError(
            f"checkpoint {ckpt.path} gives /job:ps/task:{task} {int(mine.sum())} rows of each "
            f"dynamic table, more than tables.capacity = {cap}: raise the capacity, or "
            f"restore onto more PS tasks"
        )
    rows.load(
        ids[mine],
        {t: {k: a[mine] for k, a in v.items()} for t, v in values.items()},
        ctx.prep.start_step,
    )
    log(ctx.role, f"restored {rows.live} ids' rows of dynamic tables from {ckpt.path.name}")


def server(ctx: RunContext, windows: Windows) -> DynamicServer | None:
    """PS task: what answers the dynamic tables' lookups and pushes (None: no such tables)."""
    if windows.lookups is None:
        return None
    optimizer, job = ctx.optimizer, ctx.job
    apply = optimizer.apply if optimizer.stateful else None
    if job.tables.optimizer == "rowwise_adagrad":
        epsilon = job.optimizer.epsilon

        def apply(var: Any, grad: Any, slots: dict[str, Any], lr: float, t: int) -> None:
            apply_rowwise_adagrad(var, grad, slots["accumulator"], lr, epsilon)

    return DynamicServer(windows.lookups, ps_rows(ctx), apply, ctx.prep.start_step)


def shard_part(
    dynamic: DynamicServer | None, variables: dict[str, Any], slots: dict[str, Any]
) -> str | None:
    """Add every dynamic table's live rows (ids, rows, slots) to a shard's arrays; the
    shard's ``dynamic`` attribute (None: no such tables)."""
    if dynamic is None:
        return None
    names, slot_names = [], []
    ids, rows, held = dynamic.rows.live_arrays()
    for name in rows:
        variables[name], variables[name + IDS] = rows[name], ids
        names += [name, name + IDS]
        for s, a in held[name].items():
            slots[f"{name}/{s}"] = a
            slot_names.append(f"{name}/{s}")
    return marked(names, slot_names)


def report(ctx: RunContext, dynamic: DynamicServer | None) -> None:
    """PS task, at the end: what each dynamic table did here."""
    if dynamic is not None:
        rows = dynamic.rows
        log(ctx.role, f"dynamic tables ({', '.join(rows.widths)}): {rows.counts.line(rows.live)}")

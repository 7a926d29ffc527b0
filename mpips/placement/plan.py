"""Placement as a step of its own: a job's rank layout, and where its model's variables live
(the job's placement strategy, pins and partitions applied to the model's variables)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ConfigError
from ..job import Job, LayoutConfig
from ..models.variables import VariableSpec
from .layout import Layout, make_layout
from .table import STRATEGIES, Placement, place_blocks, place_tables


def job_layout(job: Job, world_size: int, nodes: list[int] | None = None, *, sync: bool) -> Layout:
    """The job's rank layout on ``world_size`` ranks placed on ``nodes`` (each rank's node,
    named by its lowest rank; None: one node); ``sync``: the mode keeps no variables on the
    PS tasks (Mode.ps_holds_variables is False). ConfigError if it does not fit."""
    return make_layout(
        world_size,
        job.layout.ps,
        job.layout.world_size,
        source=f"{job.source}: [layout]",
        sync=sync,
        nodes=nodes,
    )


def job_placement(
    job: Job, specs: list[VariableSpec], num_ps: int, tables: Sequence[VariableSpec] = ()
) -> Placement:
    """The job's placement strategy applied to the model's variables, except those split by
    rows over every PS task (layout.partition); then the split ones; then its tables, split
    by rows over every PS task (model.partition)."""
    names = [s.name for s in specs]
    pins = job.layout.pin
    for name, task in pins.items():
        if name not in names:
            raise ConfigError(
                f"layout.pin: the model has no variable {name!r} (its "
                f"variables: {', '.join(names)})"
            )
        if not isinstance(task, int) or isinstance(task, bool) or not 0 <= task < num_ps:
            raise ConfigError(
                f"layout.pin.{name}: {task!r} is not a ps task of this layout (0..{num_ps - 1})"
            )
    split = _split(job.layout, specs, num_ps)
    whole = [s for s in specs if s.name not in split]
    strategy = STRATEGIES[job.layout.placement]
    placement = strategy(whole, num_ps, pins, job.layout.pins_take_turns)
    if split:
        placement = place_blocks(placement, [s for s in specs if s.name in split])
    return place_tables(placement, list(tables), job.model.partition) if tables else placement


def _split(layout: LayoutConfig, specs: list[VariableSpec], num_ps: int) -> set[str]:
    """The variables layout.partition (by name) and layout.partition_min_bytes (by size)
    split by rows over the PS tasks; none with one PS task."""
    by_name = {s.name: s for s in specs}
    for name in layout.partition:
        if name not in by_name:
            raise ConfigError(
                f"layout.partition: the model has no variable {name!r} (its "
                f"variables: {', '.join(by_name)})"
            )
        if name in layout.pin:
            raise ConfigError(
                f"layout.partition: {name!r} is also pinned by layout.pin; a variable "
                f"is either split over every PS task or held by one"
            )
        rows = by_name[name].shape[0] if by_name[name].shape else 0
        if rows < num_ps:
            raise ConfigError(
                f"layout.partition: {name!r} has {rows} rows, fewer than the {num_ps} PS "
                f"tasks it would be split over"
            )
    if num_ps < 2:
        return set()
    limit = layout.partition_min_bytes
    return set(layout.partition) | {
        s.name
        for s in specs
        if limit
        and s.nbytes >= limit
        and s.name not in layout.pin
        and s.shape
        and s.shape[0] >= num_ps
    }

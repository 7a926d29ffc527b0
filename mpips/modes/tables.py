"""What dynamic tables (``tables.kind = "dynamic"``) rule out, checked at start-up with the
mode's own rules (Mode.check), before anything is allocated."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..job import Job

MODES = ("async", "hybrid")


def check(job: Job, model: Any, max_nnz: int) -> None:
    """What dynamic tables rule out, said before anything is allocated (``max_nnz``: the
    data's most ids in a row)."""
    t = job.tables
    if t.kind != "dynamic":
        if t.optimizer or t.dtype != "float32":
            raise ConfigError(
                'tables.optimizer and tables.dtype: for tables.kind = "dynamic" (a fixed '
                "table's rows are stored and updated as the model's variables)"
            )
        return
    if t.optimizer == "rowwise_adagrad" and job.optimizer.kind != "adagrad":
        raise ConfigError(
            f'tables.optimizer = "rowwise_adagrad": with optimizer.kind = "adagrad" (its '
            f"learning rate, epsilon and initial_accumulator_value), not "
            f'"{job.optimizer.kind}"'
        )
    if not model.tables():
        raise ConfigError(
            f'tables.kind = "dynamic": {type(model).__name__} has no tables (sparse models: '
            f'model.kind = "logreg" or "wide_deep", or a module with sparse embeddings)'
        )
    if job.train.mode not in MODES:
        raise ConfigError(
            f'tables.kind = "dynamic": train.mode = "async" or "hybrid", not '
            f'"{job.train.mode}" (a PS task answers each lookup)'
        )
    if job.train.zero_copy:
        raise ConfigError(
            'tables.kind = "dynamic": not with train.zero_copy (workers never address a '
            "dynamic table's rows; set it to false)"
        )
    if getattr(model, "table_offsets", dict)():
        raise ConfigError(
            'tables.kind = "dynamic": not with table_offsets (a dynamic table serves every '
            "id; give each feature's ids their own range of values instead)"
        )
    capacity, most = job.tables.capacity, job.train.batch_size * max(1, max_nnz)
    if capacity and capacity < most:
        raise ConfigError(
            f"tables.capacity = {capacity}: below the {most} ids one batch may touch "
            f"(train.batch_size x the data's longest row); a PS task must hold them all"
        )

"""What dynamic tables (``tables.kind = "dynamic"``) rule out, checked at start-up with the
mode's own rules (Mode.check), before anything is allocated."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..job import Job
from ..process.memory import check_fits

MODES = ("async", "hybrid")
# the [tables] keys of dynamic tables only, with their defaults
DYNAMIC_ONLY = {
    "capacity": 0,
    "min_count": 1,
    "ttl_steps": 0,
    "optimizer": "",
    "dtype": "float32",
    "cache_rows": 0,
    "cache_steps": 10,
}


def check(job: Job, model: Any, max_nnz: int) -> None:
    """What dynamic tables rule out, said before anything is allocated (``max_nnz``: the
    data's most ids in a row)."""
    t = job.tables
    if t.kind != "dynamic":
        given = [k for k, v in DYNAMIC_ONLY.items() if getattr(t, k) != v]
        if given:
            raise ConfigError(
                f'tables.{given[0]}: for tables.kind = "dynamic" only (a fixed table has '
                f"the rows its model declares, stored and updated as its variables)"
            )
        return
    if t.cache_rows and model.tables():
        row = sum(s.nbytes // max(1, s.shape[0]) for s in model.tables())
        check_fits(  # (a worker's cache: its rows, and 2 map slots of 16 B a row)
            t.cache_rows * (row + 32), f"tables.cache_rows = {t.cache_rows}", ConfigError
        )
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

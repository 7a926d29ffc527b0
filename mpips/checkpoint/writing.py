"""Writing a checkpoint: each writer's shard, then the commit, the manifest renamed into
place after every shard is (a crash at any moment leaves the checkpoints before intact)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..data.hdf5 import H5PY_ERRORS, fixed_text, open_plain, plain_attrs, reason
from ..errors import CheckpointError
from ..process.files import TEXT_LIMIT, atomic_write
from .checks import check_finite
from .checksum import CHECKSUM, CRC32, write_array
from .dynamic import DYNAMIC, Collected, collect, entries
from .format import FORMAT, RUN, SHARDS, Entry, h5_path, manifest_name, shard_name, text_attr
from .increments import BASES, Increments, Plan
from .lock import run_of
from .manifest import encode_index
from .pruning import prune
from .sparse import SparseTables, integer, sparse_parts, write_sparse

NOT_COMMITTED = "checkpoint at global_step {step} not committed; the ones before it are intact"


class ForeignShard(CheckpointError):
    """A shard in place for a commit was written by another run: the run stops (exit 1)."""

    exit_code = 1


def write_shard(
    directory: str | Path,
    step: int,
    shard: int,
    num_shards: int,
    variables: dict[str, np.ndarray],
    slots: dict[str, np.ndarray] | None = None,
    tables: SparseTables | None = None,
    run: str | None = None,
    increments: Increments | None = None,
    dynamic: str | None = None,
) -> Path:
    """Write one shard atomically: ``variables`` (name -> array, or the part of it this
    shard holds) and ``slots`` (``<variable>/<slot>`` -> array), tagged with ``run`` (by
    default the run this process writes in ``directory``, see run_of). With ``tables``, the
    table partitions among them and their slots are written sparsely where that writes at
    most SPARSE_MAX_FRACTION of their bytes (see write_sparse), else whole. Every dataset
    carries the crc32 of the bytes written (see checksum). With ``increments`` too (the
    writer's memory of its last checkpoint), a table array holds only the rows changed
    since that checkpoint, if it is committed, until ``increments.every`` lie on one base
    (see increments). ``dynamic``: the arrays of dynamic tables among them
    (dynamic.marked), indexed by the commit from the shards. NonFinite, and
    nothing written, if any value is NaN or infinite; WriteFailed (exit 1) if the file
    system refuses it (disk full, read-only)."""
    slots = slots or {}
    check_finite({**variables, **slots}, step)
    run = run or run_of(directory)
    plan = Plan.of(variables, slots, tables, increments, directory, step)

    def write(tmp: Path) -> None:
        sparse = plan.changed()
        sparse.update(sparse_parts(variables, slots, tables, done=sparse))
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = fixed_text(FORMAT)
            f.attrs["global_step"] = step
            f.attrs["shard"] = shard
            f.attrs[SHARDS] = num_shards
            f.attrs[CHECKSUM] = fixed_text(CRC32)
            if run:
                f.attrs[RUN] = fixed_text(run)
            if plan.overlays:
                f.attrs[BASES] = np.array(plan.overlays, np.int64)
            if dynamic:
                f.attrs[DYNAMIC] = fixed_text(dynamic)
            for is_slot, arrays in ((False, variables), (True, slots)):
                for name, value in arrays.items():
                    path = h5_path(name, is_slot)
                    if tables is not None and path in sparse:
                        write_sparse(f, path, sparse[path], tables)
                    else:
                        write_array(f, path, value)

    path = atomic_write(
        Path(directory) / shard_name(step, shard, num_shards),
        write,
        NOT_COMMITTED.format(step=step),
        checkpoint_file=True,
    )
    plan.wrote(step)
    return path


def commit(
    directory: str | Path,
    step: int,
    num_shards: int,
    variables: dict[str, Entry],
    slots: dict[str, Entry],
    meta: dict[str, Any],
    max_to_keep: int = 3,
    run: str | None = None,
) -> Path:
    """After every shard of ``step`` is in place, each written by run ``run`` (by default
    the run this process writes in ``directory``, see run_of; None: not checked): write the
    manifest (the commit), then prune to the newest ``max_to_keep`` and delete what
    uncommitted writes left behind."""
    d = Path(directory)
    run = run or run_of(d)
    found: Collected = {}
    bases = _check_shards(d, step, num_shards, run, found)
    more_variables, more_slots = entries(found)
    variables, slots = {**variables, **more_variables}, {**slots, **more_slots}
    manifest = {
        "format": FORMAT,
        "global_step": step,
        "shards": num_shards,
        **meta,
        **({RUN: run} if run else {}),
        **({BASES: bases} if bases else {}),
        "variables": encode_index(variables),
        "slots": encode_index(slots),
    }
    text = json.dumps(manifest, indent=1)
    if len(text) > TEXT_LIMIT:  # a reader would refuse it: never commit what cannot load
        raise CheckpointError(
            f"checkpoint {d}: the manifest of global_step {step} would be {len(text)} bytes, "
            f"more than the {TEXT_LIMIT} a reader accepts (too many variables or parts); "
            f"not committed"
        )

    def write(tmp: Path) -> None:
        tmp.write_text(text)

    path = atomic_write(
        d / manifest_name(step), write, NOT_COMMITTED.format(step=step), checkpoint_file=True
    )
    prune(d, max_to_keep)
    return path


def _check_shards(
    d: Path, step: int, num_shards: int, run: str | None, dynamic: Collected
) -> list[int]:
    """Every shard of ``step`` is in place and, if ``run``, was written by that run, and
    every checkpoint one overlays (an increment) is committed: else CheckpointError (a shard
    missing, a base gone) or ForeignShard (another run's), nothing committed. The steps of
    the checkpoints the shards overlay, ascending; the dynamic tables' arrays they hold
    added to ``dynamic``."""
    bases: set[int] = set()
    for k in range(num_shards):
        path = d / shard_name(step, k, num_shards)
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {d}: shard {k} of {num_shards} for global_step "
                f"{step} is missing; not committed"
            )
        what = f"checkpoint {d}: shard {path.name}"
        try:  # (checked as a reader checks it where a run is named: open_plain)
            with open_plain(path, CheckpointError, what) if run else h5py.File(path, "r") as f:
                attrs = plain_attrs(f)
                collect(f, k, attrs, dynamic, what)
        except H5PY_ERRORS as e:
            raise CheckpointError(f"{what}: unreadable ({reason(e)})") from None
        wrote = text_attr(attrs.get(RUN))
        if run and wrote != run:
            raise ForeignShard(
                f"checkpoint {d}: shard {path.name} was written by "
                f"{f'run {wrote}' if wrote else 'a run with no id'}, not by this run "
                f"({run}): not committed (another run writes into {d}?)"
            )
        overlays = [integer(b) for b in np.atleast_1d(attrs.get(BASES, []))]
        if any(b is None or not 0 <= b < step for b in overlays):
            raise CheckpointError(
                f"{what}: the checkpoints it overlays ({BASES}) are not steps before {step}; "
                f"not committed"
            )
        bases.update(b for b in overlays if b is not None)
    for b in sorted(bases):
        if not (d / manifest_name(b)).is_file():
            raise CheckpointError(
                f"checkpoint {d}: a shard of global_step {step} holds the rows changed since "
                f"the checkpoint of global_step {b}, which is not committed; not committed"
            )
    return sorted(bases)

"""The on-disk format of a checkpoint: its file names, where an array lives in a shard, and
the index entries (name -> shape, dtype, parts) its manifest holds."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..process.files import MANIFEST_FILE, SHARD_FILE  # noqa: F401 (reserved there for checkpoints)

FORMAT = "mpips-checkpoint-2"
TEMPORARY_FILE = re.compile(r"^\.ckpt-\d+\..*\.tmp-")
NUMBER_KINDS = "biufc"  # numbers only: an object dtype would mean pickled data
MAX_SHARDS = 1 << 20  # one shard per PS task: more is a corrupt or hostile manifest
SPARSE = "sparse"  # the layout attribute of a part stored as (index, values)
RUN = "run"  # the run id: a shard attribute and a manifest field
SHARDS = "shards"  # how many shards the checkpoint has: a shard attribute and a manifest field

Rows = tuple[int, int, int]  # range(start, stop, step) of axis 0


@dataclass(frozen=True)
class Part:
    """Rows of a variable held by one shard (``rows`` None: the whole variable)."""

    shard: int
    rows: Rows | None = None


@dataclass(frozen=True)
class Entry:
    """One variable or slot in the index."""

    shape: tuple[int, ...]
    dtype: str
    parts: tuple[Part, ...]


def shard_name(step: int, shard: int, num_shards: int) -> str:
    return f"ckpt-{step}.shard-{shard}-of-{num_shards}.h5"


def manifest_name(step: int) -> str:
    return f"ckpt-{step}.json"


def h5_path(name: str, slot: bool) -> str:
    """Variables live at ``variables/<name>``, slot ``<var>/<slot>`` at ``slots/<slot>/<var>``."""
    if not slot:
        return f"variables/{name}"
    var, slot_name = name.rsplit("/", 1)
    return f"slots/{slot_name}/{var}"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints in ``directory`` as (global_step, manifest path), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [
        (int(m.group(1)), d / p.name) for p in d.iterdir() if (m := MANIFEST_FILE.match(p.name))
    ]
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def text_attr(value: Any) -> str | None:
    """An HDF5 string attribute as str (None if absent)."""
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

"""The manifest's index: which shard holds which rows of each variable and slot, built
from a placement or from whole arrays, encoded as JSON, and parsed back with every declared
size and row range checked before anything is allocated."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from typing import Any

import numpy as np

from ..placement.table import Placement
from ..process.memory import ABSURD_BYTES, human
from .format import MAX_SHARDS, NUMBER_KINDS, Entry, Part

# the largest integer a manifest may hold (steps, update counts, shapes, rows, the data's
# batch size and seed): they become 64-bit counters and sizes, and a step must be able to
# count on from there; anything larger is a corrupt or crafted manifest
MAX_INT = (1 << 62) - 1


def index_of(
    placement: Placement, slots: Placement | None = None
) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """The variable and slot index of shards written one per PS task of ``placement``."""

    def entries(p: Placement | None) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        for e in p or ():
            whole = e.whole or e.spec
            parts = out[e.name].parts if e.name in out else ()
            out[e.name] = Entry(whole.shape, whole.dtype, parts + (Part(e.ps_task, e.rows),))
        return out

    return entries(placement), entries(slots)


def whole_index(arrays: dict[str, np.ndarray], shard: int = 0) -> dict[str, Entry]:
    """The index of whole arrays all held by one shard."""
    return {n: Entry(tuple(a.shape), str(a.dtype), (Part(shard),)) for n, a in arrays.items()}


def job_digest(job: Any) -> str:
    """sha256 of the job's effective settings (as JSON), to tell which job wrote a checkpoint."""
    settings = {k: v for k, v in asdict(job).items() if k != "source"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def encode_index(index: dict[str, Entry]) -> dict[str, Any]:
    """An index as the manifest's JSON holds it."""
    return {
        n: {
            "shape": list(e.shape),
            "dtype": e.dtype,
            "parts": [
                {"shard": p.shard, "rows": list(p.rows) if p.rows else None} for p in e.parts
            ],
        }
        for n, e in index.items()
    }


def _covers_once(parts: list[Part], num_rows: int) -> bool:
    """Whether the parts' row ranges cover ``range(num_rows)`` exactly once: their lengths
    add up and no two overlap. The ranges share one step (every partition rule does), so
    two can only overlap within one residue class: sorting each class is enough (n log n,
    nothing allocated per row, however the manifest was crafted)."""
    if len(parts) == 1 and parts[0].rows is None:
        return True
    if any(p.rows is None for p in parts):
        return False
    ranges = [r for r in (range(*p.rows) for p in parts if p.rows is not None) if r]
    if len({r.step for r in ranges}) > 1:
        return False
    if sum(len(r) for r in ranges) != num_rows or any(
        r[0] < 0 or r[-1] >= num_rows for r in ranges
    ):
        return False
    ranges.sort(key=lambda r: (r.start % r.step, r.start))
    return all(
        a.start % a.step != b.start % b.step or a[-1] < b.start
        for a, b in zip(ranges, ranges[1:], strict=False)
    )


def parse_ints(value: Any, what: str) -> list[int]:
    """``value``, a list of integers in 0..MAX_INT; ValueError saying ``what`` is wrong."""
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} must be a list of non-negative integers")
    if any(v > MAX_INT for v in value):
        raise ValueError(f"{what} must be integers in 0..2**62 - 1, got {max(value)}")
    return value


def check_meta(raw: dict[str, Any]) -> None:
    """The manifest's layout and data position records, if there, are tables whose numbers
    are integers in 0..MAX_INT (a restore compares the batch size and seed with the job's);
    ValueError otherwise."""
    for key, fields in (("layout", ("world_size", "ps", "workers")), ("data", DATA_INTS)):
        table = raw.get(key)
        if table is None:
            continue
        if not isinstance(table, dict):
            raise ValueError(f"'{key}' must be a table")
        for name in fields:
            if name in table:
                parse_ints([table[name]], f"{key}.{name}")


DATA_INTS = ("batch_size", "seed")  # the settings a data position was counted with


def parse_index(raw: Any, num_shards: int, what: str) -> dict[str, Entry]:
    if not isinstance(raw, dict):
        raise ValueError(f"'{what}' must be a table")
    out = {}
    for name, e in raw.items():
        if not isinstance(e, dict) or not {"shape", "dtype", "parts"} <= e.keys():
            raise ValueError(f"{what} '{name}' needs shape, dtype and parts")
        shape = tuple(parse_ints(e["shape"], f"{what} '{name}': shape"))
        if not isinstance(e["dtype"], str) or np.dtype(e["dtype"]).kind not in NUMBER_KINDS:
            raise ValueError(f"{what} '{name}': dtype {e['dtype']!r} is not a number type")
        if not isinstance(e["parts"], list) or not e["parts"]:
            raise ValueError(f"{what} '{name}': parts must be a non-empty list")
        nbytes = math.prod(shape) * np.dtype(e["dtype"]).itemsize
        if nbytes > ABSURD_BYTES:
            raise ValueError(
                f"{what} '{name}' declares {human(nbytes)} ({e['dtype']}{list(shape)}): absurd"
            )
        parts = []
        for p in e["parts"]:
            if (
                not isinstance(p, dict)
                or type(p.get("shard")) is not int
                or not 0 <= p["shard"] < num_shards
            ):
                raise ValueError(f"{what} '{name}': a part names no shard of 0..{num_shards - 1}")
            rows = p.get("rows")
            if rows is not None:
                rows = tuple(parse_ints(rows, f"{what} '{name}': rows"))
                if len(rows) != 3 or rows[2] == 0 or not shape or rows[1] > shape[0]:
                    raise ValueError(f"{what} '{name}': rows {list(rows)} do not fit {list(shape)}")
                if rows[2] > MAX_SHARDS:
                    raise ValueError(f"{what} '{name}': rows {list(rows)} step past {MAX_SHARDS}")
            parts.append(Part(p["shard"], rows))
        if len({p.shard for p in parts}) != len(parts):
            raise ValueError(f"{what} '{name}': a shard holds two of its parts")
        if not _covers_once(parts, shape[0] if shape else 1):
            raise ValueError(f"{what} '{name}': its parts do not cover it exactly once")
        out[name] = Entry(shape, e["dtype"], tuple(parts))
    return out

"""Dynamic tables in a checkpoint (``tables.kind = "dynamic"``): each PS task writes the live
rows it holds, in id order, as ``<table>`` (rows), ``<table>:ids`` (their ids) and the
slots ``<table>/<slot>``, and lists those names in the shard's ``dynamic`` attribute. A
task's row count is known only when it writes, so the commit reads the counts from the
shards and indexes each array as the concatenation of the shards' parts, in shard order:
to every reader it is an ordinary variable split by rows. A restore reads a table's arrays
whole and keeps the rows whose ids its task owns, whatever the layout that wrote them."""

from __future__ import annotations

import json
from typing import Any

import h5py

from ..errors import CheckpointError
from .format import Entry, Part, h5_path, text_attr

DYNAMIC = "dynamic"  # a shard's attribute: {"variables": [names], "slots": [names]}
IDS = ":ids"  # <table>:ids, the ids of a dynamic table's rows

# per array name: (is a slot, shape of a row, dtype, [(shard, rows)])
Collected = dict[str, tuple[bool, tuple[int, ...], str, list[tuple[int, int]]]]


def marked(variables: list[str], slots: list[str]) -> str:
    """The ``dynamic`` attribute of a shard holding these arrays."""
    return json.dumps({"variables": variables, "slots": slots})


def collect(f: h5py.File, shard: int, attrs: dict[str, Any], into: Collected, what: str) -> None:
    """Add the dynamic arrays a shard lists (with their row counts) to ``into``."""
    text = text_attr(attrs.get(DYNAMIC))
    if text is None:
        return
    try:
        listed = json.loads(text)
        names = [(n, False) for n in listed["variables"]] + [(n, True) for n in listed["slots"]]
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{what}: its {DYNAMIC} attribute is not a list of arrays") from None
    for name, is_slot in names:
        obj = f.get(h5_path(str(name), is_slot))
        if not isinstance(obj, h5py.Dataset) or not obj.ndim:
            raise CheckpointError(f"{what}: dynamic array '{name}' is missing or not an array")
        row, dtype = tuple(int(d) for d in obj.shape[1:]), str(obj.dtype)
        held = into.setdefault(str(name), (is_slot, row, dtype, []))
        if held[1:3] != (row, dtype):
            raise CheckpointError(f"{what}: dynamic array '{name}' differs from other shards'")
        held[3].append((shard, int(obj.shape[0])))


def entries(collected: Collected) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """The index of the dynamic arrays: (variables, slots)."""
    out: tuple[dict[str, Entry], dict[str, Entry]] = ({}, {})
    for name, (is_slot, row, dtype, parts) in collected.items():
        at, index = 0, []
        for shard, n in parts:
            index.append(Part(shard, (at, at + n, 1)))
            at += n
        out[is_slot][name] = Entry((at, *row), dtype, tuple(index))
    return out

"""Pruning a checkpoint directory after a commit: only then are old checkpoints, and what
writes that never committed left behind, deleted."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from ..process.files import TEXT_LIMIT, read_text
from .format import SHARD_FILE, TEMPORARY_FILE, list_checkpoints
from .increments import BASES


def prune(directory: Path, max_to_keep: int) -> None:
    """Keep the newest ``max_to_keep`` committed checkpoints and every checkpoint they
    overlay (incremental table shards: see increments), however far back: each other one is
    uncommitted first (its manifest removed), then its shards deleted, with every shard and
    temporary file no kept checkpoint owns."""
    committed = list_checkpoints(directory)
    manifests = dict(committed)
    keep = {s for s, _ in committed[-max_to_keep:]}
    todo = list(keep)
    while todo:
        for base in bases_of(manifests[todo.pop()]):
            if base in manifests and base not in keep:
                keep.add(base)
                todo.append(base)
    for step, old in committed:
        if step not in keep:
            old.unlink(missing_ok=True)  # uncommit first, then delete its shards below
    for p in directory.iterdir():
        m = SHARD_FILE.match(p.name)
        if (m and int(m.group(1)) not in keep) or TEMPORARY_FILE.match(p.name):
            p.unlink(missing_ok=True)


def bases_of(manifest: Path) -> list[int]:
    """The steps of the checkpoints that the checkpoint of ``manifest`` overlays (none if
    it holds no increment, or cannot be read: a reader refuses it anyway)."""
    try:
        raw = json.loads(read_text(manifest, CheckpointError, str(manifest), TEXT_LIMIT))
    except (CheckpointError, OSError, ValueError, RecursionError):
        return []
    found = raw.get(BASES, []) if isinstance(raw, dict) else []
    return [b for b in found if type(b) is int] if isinstance(found, list) else []

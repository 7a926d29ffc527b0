"""Pruning a checkpoint directory after a commit: only then are old checkpoints, and what
writes that never committed left behind, deleted."""

from __future__ import annotations

from pathlib import Path

from .format import SHARD_FILE, TEMPORARY_FILE, list_checkpoints


def prune(directory: Path, max_to_keep: int) -> None:
    """Keep the newest ``max_to_keep`` committed checkpoints: each older one is uncommitted
    first (its manifest removed), then its shards deleted, with every shard and temporary
    file no kept checkpoint owns."""
    committed = list_checkpoints(directory)
    for _, old in committed[:-max_to_keep]:
        old.unlink(missing_ok=True)  # uncommit first, then delete its shards below
    keep = {s for s, _ in committed[-max_to_keep:]}
    for p in directory.iterdir():
        m = SHARD_FILE.match(p.name)
        if (m and int(m.group(1)) not in keep) or TEMPORARY_FILE.match(p.name):
            p.unlink(missing_ok=True)

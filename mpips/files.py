"""Durable atomic file writes: every file mpips writes (checkpoint shards and manifests,
exported models, converted datasets) appears whole or not at all, even after a crash."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's) data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(final: Path) -> Path:
    """Where ``final`` is written before its rename: hidden, and unique per host and process
    (several ranks may write beside each other on a shared file system)."""
    return final.with_name(f".{final.name}.tmp-{os.uname().nodename}-{os.getpid()}")


def atomic_write(final: str | Path, write: Callable[[Path], object]) -> Path:
    """``write(tmp)`` (its return value is ignored), fsync it, rename it to ``final``, fsync
    the directory; on any failure no trace is left and an existing ``final`` is untouched."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(final)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    finally:
        tmp.unlink(missing_ok=True)
    return final

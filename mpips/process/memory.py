"""How much memory this process may still allocate, and a check against it.

Sizes read from files (manifests, HDF5 attributes and shapes) are not trusted: before anything
is allocated from them, the total is compared with the memory available here, so a hostile or
corrupt file is one clear error, not a MemoryError traceback or an OOM kill.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import MpipsError
from .files import nearest_existing

# more than this is absurd for any one array or allocation, whatever the machine (1 PiB)
ABSURD_BYTES = 1 << 50


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 or v1), if it has one."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit, usage, cache = base / "memory.max", base / "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit, usage = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
            cache = "total_inactive_file"
        else:
            continue
        try:
            text = limit.read_text().strip()
            if text == "max" or int(text) >= ABSURD_BYTES:
                continue
            # the usage counts page cache, which the kernel reclaims before it OOM-kills
            used = int(usage.read_text()) - _stat(base / "memory.stat", cache)
            return max(0, int(text) - used)
        except (OSError, ValueError):
            continue
    return None


def _stat(path: Path, key: str) -> int:
    """One figure of a cgroup's memory.stat (0 if absent)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def available_bytes() -> int:
    """Memory this process can still get: MemAvailable, or less under a cgroup limit."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = _cgroup_room()
    return min(available, room) if room is not None else available


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(nbytes) < 1024 or unit == "PiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError


def check_fits(
    nbytes: int, what: str, error: type[MpipsError], available: int | None = None
) -> None:
    """Raise ``error`` if ``nbytes`` (for ``what``) is absurd or more than the memory available
    here (``available``: a figure the caller already has, e.g. for a whole node)."""
    if nbytes > ABSURD_BYTES:
        raise error(f"{what} needs {human(nbytes)}: absurd (a corrupt or hostile file?)")
    room = available_bytes() if available is None else available
    if nbytes > room:
        raise error(
            f"{what} needs {human(nbytes)}, more than the {human(room)} of memory available here"
        )


def check_disk(nbytes: int, path: str | Path, what: str, error: type[MpipsError]) -> None:
    """Raise ``error`` if ``nbytes`` (for ``what``, to be written at ``path``) is more than the
    disk free where ``path`` would go: refused before writing, not a full disk halfway."""
    folder = nearest_existing(path)
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise error(
            f"{what} needs about {human(nbytes)}, more than the {human(free)} free in {folder}"
        )


SHM_DIR = "/dev/shm"  # where MPI's shared memory lives on Linux
SHM_SPARE = 1.25  # MPI shared memory is put there only with a quarter of it to spare
SHM_REMEDY = f"give {SHM_DIR} more: docker run --shm-size, or a bigger {SHM_DIR} on the host"


def shared_memory_free(nbytes: int) -> int:
    """Bytes free in the node's shared-memory file system (SHM_DIR): a process that runs
    past the end of its MPI shared memory there dies of SIGBUS. With no SHM_DIR here, twice
    ``nbytes`` (MPI finds its own place)."""
    try:
        return shutil.disk_usage(SHM_DIR).free
    except OSError:
        return nbytes * 2


def shared_memory_fits(nbytes: int, free: int) -> bool:
    """Whether ``free`` bytes of SHM_DIR hold ``nbytes`` of MPI shared memory with SHM_SPARE
    to spare (for what else the node's processes put there meanwhile)."""
    return free >= nbytes * SHM_SPARE

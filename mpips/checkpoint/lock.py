"""The directory lock: a checkpoint directory belongs to one run at a time.

The chief holds an exclusive flock of ``D/.mpips-lock`` for the whole run (released by the
OS when it ends, however it ends), so a second run started on the same directory stops at
start-up naming the first. The run's id, agreed by all ranks, tags every shard and manifest
this process writes there (run_of).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..process.files import LOCK_FILE, os_reason  # (LOCK_FILE: in a checkpoint directory, held by

# the run that writes there; reserved in files.py, so no other output takes its name)
HOLDER_BYTES = 4096  # what the lock file says of its holder: a short JSON object
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a file system
# without flock (some Lustre and NFS mounts): the run goes on unlocked, and says so


class Held:
    """What this process holds, by checkpoint directory (its one name: _key): the run it
    writes there (``runs``), and the open lock file whose flock it holds (``locks``)."""

    def __init__(self) -> None:
        self.runs: dict[Path, str] = {}
        self.locks: dict[Path, int] = {}

    def reset(self) -> None:
        """Release every lock and forget every run (for tests; a process that ends
        releases its locks anyway)."""
        for fd in self.locks.values():
            os.close(fd)
        self.runs.clear()
        self.locks.clear()


HELD = Held()  # this process's: never rebound


def _key(directory: str | Path) -> Path:
    """The directory's one name (links resolved); as given, made absolute, where it cannot
    be resolved (a loop of links: the error that comes of it is said elsewhere)."""
    try:
        return Path(directory).resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(directory))


def run_of(directory: str | Path) -> str | None:
    """The id of the run this process writes checkpoints for in ``directory`` (see
    lock_directory and join_run), or None: shards and manifests then carry no run id."""
    return HELD.runs.get(_key(directory))


def join_run(directory: str | Path, run: str) -> None:
    """This process writes shards of run ``run`` into ``directory``, whose lock another
    process of the run holds (a PS task in async mode: the chief holds it)."""
    HELD.runs[_key(directory)] = run


@dataclass(frozen=True)
class DirectoryLock:
    """A checkpoint directory taken for a run: its id, and why it is not locked, if the
    file system has no locks (the run goes on; another run could still write there)."""

    run: str
    unlocked: str | None = None


def lock_directory(directory: str | Path, job: str, run: str | None = None) -> DirectoryLock:
    """Take ``directory`` (created if needed) for a new run of ``job``, until this process
    ends or release_directory: an exclusive flock of its LOCK_FILE, which then says who
    holds it (host, pid, start time, job, run id). CheckpointError naming the holder if
    another run holds it, or if the directory cannot be written. A process that holds the
    lock already (a second run in one Python process) keeps it, for the new run. ``run``:
    the id of the run taken over (a worker that became the chief), else a new one."""
    d, run = Path(directory), run or uuid.uuid4().hex[:16]
    key = _key(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = HELD.locks.get(key)
        if fd is None:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(d / LOCK_FILE, flags, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise CheckpointError(
                        f"checkpoint.dir {d}: {LOCK_FILE} is not a regular file; remove it"
                    )
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(fd)
                os.close(fd)
                raise CheckpointError(
                    f"checkpoint.dir {d} is in use by another run: {holder}. Two runs "
                    f"writing into one directory would mix and lose their checkpoints: wait "
                    f"for it to end, or give this run another directory with --ckpt-dir DIR "
                    f"(if that run is gone with its node, a network file system may keep its "
                    f"lock until the server notices, ~90 s for NFSv4: retry then)"
                ) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in _NO_LOCKS:
                    raise
                HELD.runs[key] = run
                return DirectoryLock(run, f"its file system has no locks ({os_reason(e)})")
            except BaseException:
                os.close(fd)
                raise
            HELD.locks[key] = fd
        said = {
            "job": job,
            "run": run,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(said).encode(), 0)
    except OSError as e:
        reason = os_reason(e)
        if os.path.islink(d) and not os.path.exists(d):
            reason = "a symbolic link to nothing: its target is missing, or links loop"
        raise CheckpointError(
            f"checkpoint.dir {d}: cannot write checkpoints there ({reason}); choose "
            f"another with --ckpt-dir"
        ) from None
    HELD.runs[key] = run
    return DirectoryLock(run)


def release_directory(directory: str | Path) -> None:
    """The end of this process's run in ``directory``: its lock released, its run id
    forgotten (a process that ends releases it anyway)."""
    key = _key(directory)
    HELD.runs.pop(key, None)
    fd = HELD.locks.pop(key, None)
    if fd is not None:
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds a lock, as its lock file says (a bounded read of a small JSON object)."""
    try:
        said = json.loads(os.pread(fd, HOLDER_BYTES, 0))
    except (OSError, ValueError, RecursionError):
        said = None
    if not isinstance(said, dict):
        return "a run that did not say which"

    def field(key: str) -> str:
        return str(said.get(key, "?"))[:200]

    return (
        f"job {field('job')} (run {field('run')}, pid {field('pid')} on {field('host')}, "
        f"started {field('started')})"
    )

"""Durable atomic file writes: every file mpips writes (checkpoint shards and manifests,
exported models, converted datasets) appears whole or not at all, even after a crash; and
the names of a checkpoint's own files, which no other output may take."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from ..errors import MpipsError

TEXT_LIMIT = 64 << 20  # job, layout and manifest files are small: more is not one of them
# a checkpoint's files (checkpoint/format.py) and its directory's lock (checkpoint/lock.py)
MANIFEST_FILE = re.compile(r"^ckpt-(\d+)\.json$")
SHARD_FILE = re.compile(r"^ckpt-(\d+)\.shard-(\d+)-of-(\d+)\.h5$")
LOCK_FILE = ".mpips-lock"


class OutputRefused(MpipsError):
    """An output path mpips will not write: a device, directory or other special file, or a
    checkpoint's own file (which only the run writing that checkpoint writes). Bad input:
    exit 2, and nothing is touched."""


class WriteFailed(MpipsError):
    """A file could not be written (disk full, read-only file system, an I/O error): a
    failure of the machine, not of the input, so exit 1; what was there before is intact."""

    exit_code = 1


def os_reason(e: OSError) -> str:
    """The cause of ``e`` in a few words ("No space left on device"), also for h5py's
    errors, whose text runs over several lines but whose errno is set."""
    if e.errno:
        return os.strerror(e.errno)
    text = e.strerror or str(e)
    return text.splitlines()[0] if text else type(e).__name__


def nearest_existing(path: str | Path) -> Path:
    """The nearest folder above ``path`` that exists (or a file in its place): where it
    would be written, for checks before writing."""
    return next((p for p in Path(path).absolute().parents if p.exists()), Path("/"))


def check_regular(
    path: str | Path, error: type[MpipsError], what: str, max_bytes: int | None = None
) -> int:
    """The size of ``path`` after checking that it is a regular file (following links) of at
    most ``max_bytes``; ``error`` naming ``what`` otherwise. Opening a FIFO blocks and a
    device such as /dev/zero never ends, so every file mpips reads is checked here first."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{what}: not found") from None
    except OSError as e:
        raise error(f"{what}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{what}: is {_kind(st.st_mode)}, not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise error(f"{what}: {st.st_size} bytes, more than the {max_bytes} such a file may hold")
    return st.st_size


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, in words."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def refuse_overwriting(
    output: str | Path, inputs: list[str | Path | None], error: type[MpipsError]
) -> None:
    """``error`` (one line) if ``output`` is the same file as one of ``inputs``: written,
    it would replace what the command reads (a job file, a data source), which is lost."""
    for given in inputs:
        if not given:  # (None or "": an input not given)
            continue
        try:
            same = os.path.samefile(output, given)
        except OSError:  # (one of them does not exist yet, or cannot be looked at)
            same = Path(output).resolve() == Path(given).resolve()
        if same:
            raise error(
                f"{output}: the same file as the input {given}: writing it would replace "
                f"what this command reads; give another output name"
            )


def check_output(final: Path, checkpoint_file: bool = False) -> None:
    """OutputRefused unless ``final`` may be written (replaced by a rename): a new name, a
    regular file or a link (the link is replaced, never what it names); and, unless
    ``checkpoint_file`` (the checkpoint writer's own shards and manifests), not a name a
    checkpoint's files or its directory lock have: an export, a result or predictions
    written over ``ckpt-40.json`` would destroy the checkpoint."""
    try:
        st = os.lstat(final)
    except OSError:
        st = None  # (a new name; or one the write itself will fail on, with its cause)
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise OutputRefused(
            f"{final}: is {_kind(st.st_mode)}: mpips writes its output into a regular file "
            f"(give a file name)"
        )
    name = final.name
    ours = MANIFEST_FILE.match(name) or SHARD_FILE.match(name) or name == LOCK_FILE
    if ours and not checkpoint_file:
        raise OutputRefused(
            f"{final}: a checkpoint's file name (ckpt-N.json, ckpt-N.shard-K-of-M.h5, "
            f"{LOCK_FILE}): only the run that writes a checkpoint writes those, and this "
            f"would replace or shadow one; give another name"
        )


def read_text(
    path: str | Path, error: type[MpipsError], what: str, max_bytes: int = TEXT_LIMIT
) -> str:
    """A small text file (job, layout, manifest) read whole, after check_regular: never more
    than ``max_bytes`` (a file that grows while read is refused too), UTF-8."""
    check_regular(path, error, what, max_bytes)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
        if len(raw) > max_bytes:
            raise error(f"{what}: more than the {max_bytes} bytes such a file may hold")
        return raw.decode()
    except UnicodeDecodeError as e:
        raise error(f"{what}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise error(f"{what}: cannot read ({e.strerror or e})") from None


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


def atomic_write(
    final: str | Path,
    write: Callable[[Path], object],
    failed: str | None = None,
    checkpoint_file: bool = False,
) -> Path:
    """``write(tmp)`` (its return value is ignored), fsync it, rename it to ``final``, fsync
    the directory; on any failure no trace is left and an existing ``final`` is untouched.
    ``final`` is checked first (check_output): never a device or directory, and a
    checkpoint's file name only for the checkpoint writer (``checkpoint_file``).
    With ``failed`` (what a failure means, e.g. "checkpoint not committed"), an OSError
    (disk full, read-only file system) becomes WriteFailed naming ``final``, the cause and
    ``failed``; without it, it passes through. Cleaning up never hides the first error (on
    a read-only file system even removing a file that is not there fails)."""
    final = Path(final)
    check_output(final, checkpoint_file)
    tmp = temporary_name(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    except OSError as e:
        if failed is None:
            raise
        raise WriteFailed(
            f"cannot write {final} ({os_reason(e)}: an I/O failure, not bad input); {failed}"
        ) from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the write's own error (if any) is the one to say
    return final

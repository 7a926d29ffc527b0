"""Open HDF5 files from users and checkpoints as plain data, and nothing else.

HDF5 can make a file read other files: external links, soft links, virtual datasets and
datasets whose raw data lives in external files (``external=``). A crafted checkpoint or data
file could use them to make mpips read (and ``ckpt export`` copy out) any file the user can
read. Every file mpips reads is opened here, and refused as a whole unless every link in it
is a hard link and every dataset is contiguous, chunked or compact, stored in the file itself.

A damaged file (a flipped byte in its metadata) makes h5py raise whatever its C library's
error maps to: RuntimeError, OSError, KeyError, ValueError, TypeError, or a SystemError
wrapping one of them. ``h5py_errors`` turns those into the project's one-line error naming
the file; it goes around h5py calls only, so a bug elsewhere keeps its traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..errors import MpipsError
from ..process.files import check_regular

_PLAIN_LAYOUTS = (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT)

# what h5py raises on a damaged file (SystemError: an error inside one of its callbacks)
H5PY_ERRORS = (RuntimeError, SystemError, OSError, KeyError, ValueError, TypeError)

Damaged = Callable[[str], MpipsError]  # the reason in words -> the error to raise


def reason(e: BaseException) -> str:
    """What went wrong, in h5py's words: a SystemError says only that an exception was set
    inside h5py; the one it wraps says what."""
    if isinstance(e, SystemError) and (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return text or type(e).__name__


@contextlib.contextmanager
def h5py_errors(damaged: Damaged) -> Iterator[None]:
    """Around h5py calls that read a file: h5py's exceptions (H5PY_ERRORS) raised as
    ``damaged(reason)``, one message naming the file; an MpipsError passes unchanged. Wrap
    the h5py calls only: a RuntimeError or TypeError from other code is a bug, and keeps
    its traceback."""
    try:
        yield
    except MpipsError:
        raise
    except H5PY_ERRORS as e:
        raise damaged(reason(e)) from None


_PLAIN_ATTRIBUTES = (h5py.h5t.INTEGER, h5py.h5t.FLOAT, h5py.h5t.STRING)


def fixed_text(value: str) -> np.ndarray:
    """``value`` as a fixed-length UTF-8 string attribute, the way mpips writes text into
    HDF5 (labelled UTF-8, so h5dump and others show it as written). h5py keeps a str as a
    variable-length string in the file's global heap, and libhdf5 (2.0) loops forever, in
    C, reading one whose size a damaged byte changed; a fixed-length string lies in its
    object's header, where damage is an error h5py reports. plain_attrs gives either kind
    back as str."""
    raw = value.encode()
    return np.array(raw, dtype=h5py.string_dtype("utf-8", max(1, len(raw))))


def plain_attrs(obj: h5py.HLObject) -> dict[str, Any]:
    """The attributes of ``obj`` (a file, group or dataset) that hold numbers or strings
    (as str, fixed-length or not), by name; any other (a variable-length sequence, a
    compound, a reference) is left out unread: mpips writes none, and reading a damaged
    one can crash the HDF5 library itself (a flipped byte in a string attribute's type
    makes it a sequence, which h5py cannot read). h5py's errors pass through (wrap the
    call in h5py_errors)."""
    out = {}
    for i in range(h5py.h5a.get_num_attrs(obj.id)):
        attr = h5py.h5a.open(obj.id, index=i)
        if attr.get_type().get_class() in _PLAIN_ATTRIBUTES:
            name = attr.name.decode(errors="replace")
            value = obj.attrs[attr.name]
            out[name] = value.decode(errors="replace") if isinstance(value, bytes) else value
    return out


def _problem(f: h5py.File) -> str | None:
    """What in ``f`` is not plain data (the first thing found), else None. Low-level calls:
    the high-level objects cost ~140 us each, which a checkpoint restore would notice."""
    found: list[str] = []
    failed: list[Exception] = []

    def visit(raw: bytes, info: h5py.h5l.LinkInfo) -> int | None:
        name = raw.decode(errors="replace")
        if info.type != h5py.h5l.TYPE_HARD:
            kind = {h5py.h5l.TYPE_SOFT: "a soft link", h5py.h5l.TYPE_EXTERNAL: "an external link"}
            found.append(f"'{name}' is {kind.get(info.type, 'a link of another kind')}")
            return 1
        try:
            obj = h5py.h5o.open(f.id, raw)
            if isinstance(obj, h5py.h5d.DatasetID):
                plist = obj.get_create_plist()
                layout, external = plist.get_layout(), plist.get_external_count()
            else:
                layout, external = _PLAIN_LAYOUTS[0], 0
        except H5PY_ERRORS as e:  # a damaged object: said after the visit, not through it
            failed.append(e)  # (raised inside the visit, it would become a SystemError)
            return 1
        if layout not in _PLAIN_LAYOUTS:
            found.append(f"'{name}' is a virtual dataset (data from other files)")
            return 1
        if external:
            found.append(f"'{name}' keeps its data in an external file")
            return 1
        return None

    f.id.links.visit(visit, info=True)
    if failed:
        raise failed[0]
    return found[0] if found else None


def open_plain(
    path: str | Path, error: type[MpipsError], what: str, damaged: Damaged | None = None
) -> h5py.File:
    """``path`` opened read-only, after checking it holds plain data only; ``error`` (with
    ``what``, e.g. "data file x.h5") if it does not, or if it is no regular file (a FIFO
    would block the open). A file h5py cannot open or walk (not HDF5, truncated, damaged
    metadata) raises ``damaged(reason)``, by default ``error`` saying "{what}: not a
    readable HDF5 file (reason)"."""
    check_regular(path, error, what)

    def unreadable(why: str) -> MpipsError:
        return error(f"{what}: not a readable HDF5 file ({why})")

    damaged = damaged or unreadable
    with h5py_errors(damaged):
        f = h5py.File(path, "r")
    try:
        with h5py_errors(damaged):
            problem = _problem(f)
    except BaseException:
        f.close()
        raise
    if problem is not None:
        f.close()
        raise error(
            f"{what}: {problem}; mpips reads only hard-linked datasets stored in the "
            f"file itself, so a file cannot make it read other files"
        )
    return f

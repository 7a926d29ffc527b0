"""Open HDF5 files from users and checkpoints as plain data, and nothing else.

HDF5 can make a file read other files: external links, soft links, virtual datasets and
datasets whose raw data lives in external files (``external=``). A crafted checkpoint or data
file could use them to make mpips read (and ``ckpt export`` copy out) any file the user can
read. Every file mpips reads is opened here, and refused as a whole unless every link in it
is a hard link and every dataset is contiguous, chunked or compact, stored in the file itself.
"""

from __future__ import annotations

from pathlib import Path

import h5py

from .errors import MpipsError
from .files import check_regular

_PLAIN_LAYOUTS = (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT)


def _problem(f: h5py.File) -> str | None:
    """What in ``f`` is not plain data (the first thing found), else None. Low-level calls:
    the high-level objects cost ~140 us each, which a checkpoint restore would notice."""
    found: list[str] = []

    def visit(raw: bytes, info: h5py.h5l.LinkInfo) -> int | None:
        name = raw.decode(errors="replace")
        if info.type != h5py.h5l.TYPE_HARD:
            kind = {h5py.h5l.TYPE_SOFT: "a soft link", h5py.h5l.TYPE_EXTERNAL: "an external link"}
            found.append(f"'{name}' is {kind.get(info.type, 'a link of another kind')}")
            return 1
        obj = h5py.h5o.open(f.id, raw)
        if isinstance(obj, h5py.h5d.DatasetID):
            plist = obj.get_create_plist()
            if plist.get_layout() not in _PLAIN_LAYOUTS:
                found.append(f"'{name}' is a virtual dataset (data from other files)")
                return 1
            if plist.get_external_count():
                found.append(f"'{name}' keeps its data in an external file")
                return 1
        return None

    f.id.links.visit(visit, info=True)
    return found[0] if found else None


def open_plain(path: str | Path, error: type[MpipsError], what: str) -> h5py.File:
    """``path`` opened read-only, after checking it holds plain data only; ``error`` (with
    ``what``, e.g. "data file x.h5") if it does not, or if it is no regular file (a FIFO
    would block the open). OSError from h5py passes through."""
    check_regular(path, error, what)
    f = h5py.File(path, "r")
    try:
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

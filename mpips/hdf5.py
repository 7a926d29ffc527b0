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

_PLAIN_LAYOUTS = (h5py.h5d.CONTIGUOUS, h5py.h5d.CHUNKED, h5py.h5d.COMPACT)


def _problem(f: h5py.File) -> str | None:
    """What in ``f`` is not plain data (the first thing found), else None."""
    found: list[str] = []

    def visit(name: str, link: object) -> bool | None:
        if not isinstance(link, h5py.HardLink):
            kind = {h5py.SoftLink: "a soft link", h5py.ExternalLink: "an external link"}.get(
                type(link), "a link of another kind")
            found.append(f"'{name}' is {kind}")
            return True
        obj = f.get(name)
        if isinstance(obj, h5py.Dataset):
            plist = obj.id.get_create_plist()
            if plist.get_layout() not in _PLAIN_LAYOUTS:
                found.append(f"'{name}' is a virtual dataset (data from other files)")
                return True
            if plist.get_external_count():
                found.append(f"'{name}' keeps its data in an external file")
                return True
        return None

    f.visititems_links(visit)
    return found[0] if found else None


def open_plain(path: str | Path, error: type[MpipsError], what: str) -> h5py.File:
    """``path`` opened read-only, after checking it holds plain data only; ``error`` (with
    ``what``, e.g. "data file x.h5") if it does not. OSError from h5py passes through."""
    f = h5py.File(path, "r")
    try:
        problem = _problem(f)
    except BaseException:
        f.close()
        raise
    if problem is not None:
        f.close()
        raise error(f"{what}: {problem}; mpips reads only hard-linked datasets stored in the "
                    f"file itself, so a file cannot make it read other files")
    return f

"""Checksums of the values a shard stores, so that a flipped byte in them is refused at
restore instead of trained on.

Each dataset a shard writes carries the crc32 (zlib's: about 4 GB/s, stdlib) of its bytes
in C order, as attribute CRC32, and the shard says so (attribute CHECKSUM). The checksum
is computed over exactly what the file receives: a block of rows is copied out of the
array, checksummed and written, so an SGD update landing in a PS's window during the write
changes both or neither. A crc32 continues from block to block, so the blocks' checksum is
the whole dataset's, and a reader that reads every row of a dataset (in any number of
reads, in order) checks it. Shards written before checksums carry none and are read as
they are.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator

import h5py
import numpy as np

from ..data.hdf5 import plain_attrs
from ..errors import CheckpointError
from ..models.initial import CHUNK_ELEMENTS, row_chunks

CHECKSUM = "checksum"  # the shard's attribute: the checksum its datasets carry
CRC32 = "crc32"  # a dataset's attribute (and CHECKSUM's value): the crc32 of its bytes


def crc32(a: np.ndarray, value: int = 0) -> int:
    """The crc32 of ``a``'s bytes in C order, continuing ``value`` (the checksum of the
    rows before it). A strided view is copied a block of rows at a time, never whole."""
    a = np.asarray(a)
    if a.flags.c_contiguous:
        return zlib.crc32(a.reshape(-1).view(np.uint8).data, value)
    for lo, hi in row_chunks(len(a), a[:1].size, CHUNK_ELEMENTS):
        value = zlib.crc32(np.ascontiguousarray(a[lo:hi]).reshape(-1).view(np.uint8).data, value)
    return value


Rows = tuple[slice, ...]  # which rows of a dataset a block is: (lo:hi,), or () for a scalar


def copied_blocks(a: np.ndarray) -> Iterator[tuple[Rows, np.ndarray]]:
    """``a`` as (rows, a copy of them) blocks of about CHUNK_ELEMENTS elements: what a
    writer checksums and writes (memory for one block, whatever the size of ``a``)."""
    if a.ndim == 0:
        yield (), np.array(a)
        return
    for lo, hi in row_chunks(len(a), a[:1].size, CHUNK_ELEMENTS):
        yield (slice(lo, hi),), np.array(a[lo:hi])


def write_checked(
    parent: h5py.Group,
    path: str,
    shape: tuple[int, ...],
    dtype: np.dtype,
    blocks: Iterator[tuple[Rows, np.ndarray]],
) -> h5py.Dataset:
    """Dataset ``path`` of ``shape`` and ``dtype`` in ``parent``, written from ``blocks``
    (rows, values; in row order, covering every row), tagged with the crc32 of what was
    written."""
    ds = parent.create_dataset(path, shape, dtype)
    value = 0
    for rows, block in blocks:
        value = crc32(block, value)
        ds[rows] = block
    ds.attrs[CRC32] = np.uint32(value)
    return ds


def write_array(parent: h5py.Group, path: str, value: np.ndarray) -> h5py.Dataset:
    """``value`` as dataset ``path`` of ``parent``, tagged with its crc32 (see
    write_checked)."""
    a = np.asarray(value)
    return write_checked(parent, path, a.shape, a.dtype, copied_blocks(a))


def recorded(
    ds: h5py.Dataset, checksummed: bool, bad: Callable[[str], CheckpointError]
) -> int | None:
    """The crc32 ``ds`` was written with; None if its shard records no checksums
    (``checksummed`` False: written before them). ``bad(what)`` if the shard records
    them and ``ds`` has none, or one that is not a crc32 (damaged metadata)."""
    if not checksummed:
        return None
    value = plain_attrs(ds).get(CRC32)
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if (
        isinstance(value, bool | np.bool_)
        or not isinstance(value, int | np.integer)
        or not 0 <= int(value) < 1 << 32
    ):
        raise bad(ds.name or "")
    return int(value)

"""Sharded HDF5 checkpoints, committed by a small JSON manifest.

A checkpoint at global step S in directory D is:

* ``D/ckpt-S.shard-K-of-N.h5``: one per writer. In async mode every PS task writes the
  variables and slots it holds, in parallel; in sync mode the chief writes one shard.
* ``D/ckpt-S.json``: the manifest (global step, layout, job hash, data position and the
  variable index: name -> shape, dtype, and the parts that hold its rows in which shard).

Every file is written under a temporary name, fsynced and renamed into place; the chief
renames the manifest last, after every shard is in place, and *that* is the commit. A crash
at any moment leaves every earlier checkpoint loadable. Old checkpoints, and files of a write
that never committed, are deleted only after a new commit. Restore is keyed by variable name:
parts are reassembled, so a checkpoint loads on any number of PS tasks or workers. Loading
reads JSON and arrays only (no pickle, no eval, no code the files name: the rows a sparse
part leaves out are computed by a model the reader is given); every file is checked to be
a regular file of bounded size before it is opened; file names come from a fixed pattern
and never leave the checkpoint directory.

A directory belongs to one run at a time: the chief holds an exclusive lock on
``D/.mpips-lock`` for the whole run (released by the OS when it ends, however it ends), so a
second run started on the same directory stops at start-up naming the first. Every shard
and the manifest carry the run's id (agreed by all ranks at start-up): a manifest never
commits, and a reader never reads, another run's shard; nor one whose format, global step,
index or count is not the manifest's, nor values whose crc32 is not the one written.

The package, a module per job: format (file names, index entries), lock (the directory lock
and run id), checks (finite values, a writable directory), checksum (the crc32 of every
dataset, as written and as read), sparse (table partitions stored
by their changed rows), increments (only the rows changed since the last checkpoint),
manifest (the index, encoded and parsed), writing (shards and the
commit), pruning (what a commit makes obsolete), reading (Checkpoint, resolve) and export.
Nothing here builds a job, a dataset or a model: initial values are handed in.
"""

from .checks import check_finite, check_writable, count_non_finite
from .export import export
from .format import (
    FORMAT,
    MAX_SHARDS,
    RUN,
    SPARSE,
    Entry,
    Part,
    Rows,
    h5_path,
    latest_checkpoint,
    list_checkpoints,
    manifest_name,
    shard_name,
)
from .increments import Increments
from .lock import (
    HOLDER_BYTES,
    LOCK_FILE,
    DirectoryLock,
    join_run,
    lock_directory,
    release_directory,
    run_of,
)
from .manifest import index_of, job_digest, whole_index
from .reading import Checkpoint, NeedsModel, resolve
from .sparse import SPARSE_MAX_FRACTION, SPARSE_MIN_BYTES, SparseTables
from .writing import ForeignShard, commit, write_shard

__all__ = [
    "FORMAT",
    "HOLDER_BYTES",
    "LOCK_FILE",
    "MAX_SHARDS",
    "RUN",
    "SPARSE",
    "SPARSE_MAX_FRACTION",
    "SPARSE_MIN_BYTES",
    "Checkpoint",
    "DirectoryLock",
    "Entry",
    "ForeignShard",
    "Increments",
    "NeedsModel",
    "Part",
    "Rows",
    "SparseTables",
    "check_finite",
    "check_writable",
    "commit",
    "count_non_finite",
    "export",
    "h5_path",
    "index_of",
    "job_digest",
    "join_run",
    "latest_checkpoint",
    "list_checkpoints",
    "lock_directory",
    "manifest_name",
    "release_directory",
    "resolve",
    "run_of",
    "shard_name",
    "whole_index",
    "write_shard",
]

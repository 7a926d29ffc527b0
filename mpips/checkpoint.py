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
commits, and a reader never reads, another run's shard.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .errors import CheckpointError, NonFinite
from .files import TEXT_LIMIT, atomic_write, os_reason, read_text, temporary_name
from .hdf5 import open_plain
from .initial import CHUNK_ELEMENTS, InitialValues, row_chunks
from .memory import ABSURD_BYTES, check_fits, human
from .placement import Placement
from .variables import VariableSpec

FORMAT = "mpips-checkpoint-2"
_MANIFEST = re.compile(r"^ckpt-(\d+)\.json$")
_SHARD = re.compile(r"^ckpt-(\d+)\.shard-(\d+)-of-(\d+)\.h5$")
_TEMPORARY = re.compile(r"^\.ckpt-\d+\..*\.tmp-")
_DTYPE_KINDS = "biufc"  # numbers only: an object dtype would mean pickled data
MAX_SHARDS = 1 << 20  # one shard per PS task: more is a corrupt or hostile manifest
SPARSE = "sparse"  # the layout attribute of a part stored as (index, values)
SPARSE_MIN_BYTES = 1 << 16  # smaller partitions are written whole: sparse saves too little
SPARSE_MAX_FRACTION = 0.5  # sparse only if it writes at most this fraction of the bytes

LOCK_FILE = ".mpips-lock"  # in a checkpoint directory: held by the run that writes there
RUN = "run"  # the run id: a shard attribute and a manifest field
HOLDER_BYTES = 4096  # what the lock file says of its holder: a short JSON object
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # a file system
# without flock (some Lustre and NFS mounts): the run goes on unlocked, and says so

Rows = tuple[int, int, int]  # range(start, stop, step) of axis 0


class NeedsModel(CheckpointError):
    """A sparse part's untouched rows are the initial values of the model that wrote it, and
    the reader was given no model to compute them (mpips never builds one the files name)."""


class ForeignShard(CheckpointError):
    """A shard in place for a commit was written by another run: the run stops (exit 1)."""

    exit_code = 1


@dataclass(frozen=True)
class Part:
    """Rows of a variable held by one shard (``rows`` None: the whole variable)."""

    shard: int
    rows: Rows | None = None


@dataclass(frozen=True)
class Entry:
    """One variable or slot in the index."""

    shape: tuple[int, ...]
    dtype: str
    parts: tuple[Part, ...]


def shard_name(step: int, shard: int, num_shards: int) -> str:
    return f"ckpt-{step}.shard-{shard}-of-{num_shards}.h5"


def manifest_name(step: int) -> str:
    return f"ckpt-{step}.json"


def h5_path(name: str, slot: bool) -> str:
    """Variables live at ``variables/<name>``, slot ``<var>/<slot>`` at ``slots/<slot>/<var>``."""
    if not slot:
        return f"variables/{name}"
    var, slot_name = name.rsplit("/", 1)
    return f"slots/{slot_name}/{var}"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints in ``directory`` as (global_step, manifest path), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), d / p.name) for p in d.iterdir() if (m := _MANIFEST.match(p.name))]
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


_runs: dict[Path, str] = {}  # checkpoint directory -> the run this process writes there
_locks: dict[Path, int] = {}  # checkpoint directory -> the lock file this process holds


def _key(directory: str | Path) -> Path:
    return Path(directory).resolve()


def run_of(directory: str | Path) -> str | None:
    """The id of the run this process writes checkpoints for in ``directory`` (see
    lock_directory and join_run), or None: shards and manifests then carry no run id."""
    return _runs.get(_key(directory))


def join_run(directory: str | Path, run: str) -> None:
    """This process writes shards of run ``run`` into ``directory``, whose lock another
    process of the run holds (a PS task in async mode: the chief holds it)."""
    _runs[_key(directory)] = run


@dataclass(frozen=True)
class DirectoryLock:
    """A checkpoint directory taken for a run: its id, and why it is not locked, if the
    file system has no locks (the run goes on; another run could still write there)."""

    run: str
    unlocked: str | None = None


def lock_directory(directory: str | Path, job: str) -> DirectoryLock:
    """Take ``directory`` (created if needed) for a new run of ``job``, until this process
    ends or release_directory: an exclusive flock of its LOCK_FILE, which then says who
    holds it (host, pid, start time, job, run id). CheckpointError naming the holder if
    another run holds it, or if the directory cannot be written. A process that holds the
    lock already (a second run in one Python process) keeps it, for the new run."""
    d, run = Path(directory), uuid.uuid4().hex[:16]
    key = _key(d)
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = _locks.get(key)
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
                _runs[key] = run
                return DirectoryLock(run, f"its file system has no locks ({os_reason(e)})")
            except BaseException:
                os.close(fd)
                raise
            _locks[key] = fd
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
        raise CheckpointError(
            f"checkpoint.dir {d}: cannot write checkpoints there ({os_reason(e)}); choose "
            f"another with --ckpt-dir"
        ) from None
    _runs[key] = run
    return DirectoryLock(run)


def release_directory(directory: str | Path) -> None:
    """The end of this process's run in ``directory``: its lock released, its run id
    forgotten (a process that ends releases it anyway)."""
    key = _key(directory)
    _runs.pop(key, None)
    fd = _locks.pop(key, None)
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


def _text(value: Any) -> str | None:
    """An HDF5 string attribute as str (None if absent)."""
    if value is None:
        return None
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def count_non_finite(a: np.ndarray) -> int:
    """How many values of ``a`` are NaN or infinite (0 for integers), a chunk at a time."""
    if np.asarray(a).dtype.kind not in "fc":
        return 0
    flat = np.asarray(a).reshape(-1)
    return sum(int((~np.isfinite(c)).sum()) for c in np.array_split(flat, max(1, flat.size >> 20)))


def check_finite(arrays: dict[str, np.ndarray], step: int) -> None:
    """NonFinite naming the first array holding NaN or infinity: such values are never
    checkpointed (one pass over memory, no temporary the size of an array)."""
    for name, value in arrays.items():
        a = np.asarray(value)
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(a.sum()) if a.dtype.kind == "f" else 0.0
        # a NaN or inf makes the sum (in the array's own dtype: the fastest pass) non-finite;
        # a sum that overflows on finite values is told apart by the exact check, chunked
        if not math.isfinite(total) and not all(
            np.isfinite(c).all() for c in np.array_split(a.reshape(-1), max(1, a.size >> 20))
        ):
            raise NonFinite(
                f"'{name}' holds NaN or infinite values at global_step {step}: not "
                f"checkpointed, training stopped (the inputs were checked finite when read: "
                f"the learning rate too high? lower optimizer.learning_rate or set "
                f"optimizer.clip_norm)"
            )


def check_writable(
    directory: str | Path,
    what: str = "checkpoint.dir",
    hint: str = "choose another with --ckpt-dir",
    files: str = "checkpoints",
) -> None:
    """Create ``directory`` if needed and prove a file can be written, fsynced and removed
    there: at start-up, by every rank that will write checkpoints (or summaries, ``what``),
    before any training."""
    d = Path(directory)
    probe = temporary_name(d / ".write-probe")
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"mpips")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"{what} {d}: cannot write {files} there ({e.strerror or e}); {hint}"
        ) from None


@dataclass(frozen=True)
class SparseTables:
    """What a PS knows to write its table partitions sparsely: each partition's rows by
    table name, the seed of their initial values, and how to compute those."""

    rows: dict[str, Rows]
    seed: int
    initial: InitialValues


@dataclass
class _Changed:
    """Rows of one array of a table partition found to differ from their initial values,
    gathered a chunk at a time while storing them sparsely still pays."""

    array: np.ndarray
    limit: int  # more changed rows than this: the whole array is smaller
    index_dtype: np.dtype[Any]
    found: list[np.ndarray] = field(default_factory=list)
    count: int = 0
    constant: np.ndarray | None = None  # the bits every initial row holds, if one value
    varies: bool = False  # the initial rows are not one value

    def add(self, lo: int, initial: np.ndarray) -> bool:
        """Compare rows [lo, lo + len(initial)) with their ``initial`` values, bit for bit
        (-0.0 is not 0.0: a restore must give the same bits); False once sparse no longer
        pays, or if ``initial`` is not rows of this array."""
        current = self.array[lo : lo + len(initial)]
        if initial.shape != current.shape or initial.dtype != current.dtype:
            return False
        old = _bits(initial)
        changed = np.flatnonzero((_bits(current) != old).any(axis=1))
        self.count += len(changed)
        if self.count > self.limit:
            return False
        if len(changed):
            self.found.append((changed + lo).astype(self.index_dtype))
        if old.dtype.itemsize != current.dtype.itemsize:
            self.varies = True  # compared as bytes: no one value to name
        if not self.varies and old.size:
            self.constant = old.flat[0] if self.constant is None else self.constant
            self.varies = bool((old != self.constant).any())
        return True

    def index(self) -> np.ndarray:
        """Positions of the changed rows in the partition, ascending."""
        return np.concatenate(self.found) if self.found else np.zeros(0, self.index_dtype)

    def base(self) -> np.ndarray | None:
        """The one value every untouched row holds (a 0-d array of the array's dtype), or
        None: they hold the model's initial rows."""
        if self.varies or self.constant is None:
            return None
        return np.asarray(self.constant).view(self.array.dtype).reshape(())


def _bits(a: np.ndarray) -> np.ndarray:
    """``a`` as rows of unsigned integers of the same bits, for exact comparison."""
    rows = a.reshape(len(a), -1)
    size = rows.dtype.itemsize
    return rows.view(f"u{size}") if size in (1, 2, 4, 8) else rows.view(np.uint8)


def _may_be_sparse(array: np.ndarray) -> bool:
    """Worth comparing with its initial rows: a numeric array with rows, large enough."""
    return (
        array.ndim >= 1
        and array.dtype.kind in _DTYPE_KINDS
        and array.size * array.dtype.itemsize >= SPARSE_MIN_BYTES
    )


def _changed_rows(
    table: str, rows: Rows, arrays: dict[str, np.ndarray], tables: SparseTables
) -> dict[str, _Changed]:
    """For each array of one table partition (the table itself as "", its slots by slot
    name) that pays to write sparsely: its rows that differ from their initial values. One
    pass over the partition, a chunk of rows at a time; the initial values of each chunk are
    computed once for the table and all its slots, and the pass stops early once no array
    pays."""
    part = range(*rows)
    pending: dict[str, _Changed] = {}
    for key, a in arrays.items():
        if _may_be_sparse(a) and len(a) == len(part):
            row_bytes = a[:1].nbytes
            index_dtype = np.dtype(np.uint32 if len(a) <= 1 << 32 else np.int64)
            limit = int(SPARSE_MAX_FRACTION * len(a) * row_bytes) // (
                row_bytes + index_dtype.itemsize
            )
            pending[key] = _Changed(a, limit, index_dtype)
    width = max((a[:1].size for a in arrays.values()), default=1)
    for lo, hi in row_chunks(len(part), width, tables.initial.chunk_elements):
        if not pending:
            break
        sub = part[lo:hi]
        initial = tables.initial.compute(table, (sub.start, sub.stop, sub.step), tables.seed)
        for key in list(pending):
            values = initial.get(key)
            if values is None or not pending[key].add(lo, np.asarray(values)):
                del pending[key]
    return pending


def _sparse_parts(
    variables: dict[str, np.ndarray], slots: dict[str, np.ndarray], tables: SparseTables | None
) -> dict[str, _Changed]:
    """The arrays of a shard that are written sparsely, by their path in it, with their
    changed rows: those of the table partitions (and their slots) where sparse pays."""
    out: dict[str, _Changed] = {}
    for table, rows in (tables.rows if tables else {}).items():
        assert tables is not None
        found = _changed_rows(table, rows, _table_arrays(table, variables, slots), tables)
        out.update({h5_path(f"{table}/{k}" if k else table, bool(k)): c for k, c in found.items()})
    return out


def _write_sparse(f: h5py.File, path: str, changed: _Changed, tables: SparseTables) -> None:
    """One array of a table partition as a group: ``index`` (positions of the rows that
    differ from their initial values, ascending), ``values`` (those rows), and attributes
    saying what the other rows hold: ``base`` "constant" (``value``) or "initial" (the
    model's initial rows of ``seed``)."""
    a, index = changed.array, changed.index()
    g = f.create_group(path)
    g.attrs["layout"] = SPARSE
    g.attrs["rows"] = len(a)
    base = changed.base()
    if base is not None:
        g.attrs["base"] = "constant"
        g.attrs["value"] = base
    else:
        g.attrs["base"] = "initial"
        g.attrs["seed"] = tables.seed
    g.create_dataset("index", data=index)
    values = g.create_dataset("values", (len(index),) + a.shape[1:], a.dtype)
    for lo, hi in row_chunks(len(index), a[:1].size, tables.initial.chunk_elements):
        values[lo:hi] = a[index[lo:hi]]


def _table_arrays(
    table: str, variables: dict[str, np.ndarray], slots: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """A table's partition ("") and its slots' (by slot name) among a shard's arrays."""
    out = {"": variables[table]} if table in variables else {}
    for name, a in slots.items():
        var, slot = name.rsplit("/", 1)
        if var == table:
            out[slot] = a
    return out


def write_shard(
    directory: str | Path,
    step: int,
    shard: int,
    num_shards: int,
    variables: dict[str, np.ndarray],
    slots: dict[str, np.ndarray] | None = None,
    tables: SparseTables | None = None,
    run: str | None = None,
) -> Path:
    """Write one shard atomically: ``variables`` (name -> array, or the part of it this
    shard holds) and ``slots`` (``<variable>/<slot>`` -> array), tagged with ``run`` (by
    default the run this process writes in ``directory``, see run_of). With ``tables``, the
    table partitions among them and their slots are written sparsely where that writes at
    most SPARSE_MAX_FRACTION of their bytes (see _write_sparse), else whole. NonFinite, and
    nothing written, if any value is NaN or infinite; WriteFailed (exit 1) if the file
    system refuses it (disk full, read-only)."""
    slots = slots or {}
    check_finite({**variables, **slots}, step)
    run = run or run_of(directory)

    def write(tmp: Path) -> None:
        sparse = _sparse_parts(variables, slots, tables)
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["global_step"] = step
            f.attrs["shard"] = shard
            if run:
                f.attrs[RUN] = run
            for is_slot, arrays in ((False, variables), (True, slots)):
                for name, value in arrays.items():
                    path = h5_path(name, is_slot)
                    if tables is not None and path in sparse:
                        _write_sparse(f, path, sparse[path], tables)
                    else:
                        f.create_dataset(path, data=value)

    return atomic_write(
        Path(directory) / shard_name(step, shard, num_shards),
        write,
        f"checkpoint at global_step {step} not committed; the ones before it are intact",
    )


def index_of(
    placement: Placement, slots: Placement | None = None
) -> tuple[dict[str, Entry], dict[str, Entry]]:
    """The variable and slot index of shards written one per PS task of ``placement``."""

    def entries(p: Placement | None) -> dict[str, Entry]:
        out: dict[str, Entry] = {}
        for e in p or ():
            whole = e.whole or e.spec
            parts = out[e.name].parts if e.name in out else ()
            out[e.name] = Entry(whole.shape, whole.dtype, parts + (Part(e.ps_task, e.rows),))
        return out

    return entries(placement), entries(slots)


def whole_index(arrays: dict[str, np.ndarray], shard: int = 0) -> dict[str, Entry]:
    """The index of whole arrays all held by one shard."""
    return {n: Entry(tuple(a.shape), str(a.dtype), (Part(shard),)) for n, a in arrays.items()}


def job_digest(job: Any) -> str:
    """sha256 of the job's effective settings (as JSON), to tell which job wrote a checkpoint."""
    from dataclasses import asdict

    settings = {k: v for k, v in asdict(job).items() if k != "source"}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def commit(
    directory: str | Path,
    step: int,
    num_shards: int,
    variables: dict[str, Entry],
    slots: dict[str, Entry],
    meta: dict[str, Any],
    max_to_keep: int = 3,
    run: str | None = None,
) -> Path:
    """After every shard of ``step`` is in place, each written by run ``run`` (by default
    the run this process writes in ``directory``, see run_of; None: not checked): write the
    manifest (the commit), then prune to the newest ``max_to_keep`` and delete what
    uncommitted writes left behind."""
    d = Path(directory)
    run = run or run_of(d)
    for k in range(num_shards):
        path = d / shard_name(step, k, num_shards)
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {d}: shard {k} of {num_shards} for global_step "
                f"{step} is missing; not committed"
            )
        if run:
            with open_plain(path, CheckpointError, f"checkpoint {d}: shard {path.name}") as f:
                wrote = _text(f.attrs.get(RUN))
            if wrote != run:
                raise ForeignShard(
                    f"checkpoint {d}: shard {path.name} was written by "
                    f"{f'run {wrote}' if wrote else 'a run with no id'}, not by this run "
                    f"({run}): not committed (another run writes into {d}?)"
                )

    def encode(index: dict[str, Entry]) -> dict[str, Any]:
        return {
            n: {
                "shape": list(e.shape),
                "dtype": e.dtype,
                "parts": [
                    {"shard": p.shard, "rows": list(p.rows) if p.rows else None} for p in e.parts
                ],
            }
            for n, e in index.items()
        }

    manifest = {
        "format": FORMAT,
        "global_step": step,
        "shards": num_shards,
        **meta,
        **({RUN: run} if run else {}),
        "variables": encode(variables),
        "slots": encode(slots),
    }

    text = json.dumps(manifest, indent=1)
    if len(text) > TEXT_LIMIT:  # a reader would refuse it: never commit what cannot load
        raise CheckpointError(
            f"checkpoint {d}: the manifest of global_step {step} would be {len(text)} bytes, "
            f"more than the {TEXT_LIMIT} a reader accepts (too many variables or parts); "
            f"not committed"
        )

    def write(tmp: Path) -> None:
        tmp.write_text(text)

    path = atomic_write(
        d / manifest_name(step),
        write,
        f"checkpoint at global_step {step} not committed; the ones before it are intact",
    )
    committed = list_checkpoints(d)
    for _, old in committed[:-max_to_keep]:
        old.unlink(missing_ok=True)  # uncommit first, then delete its shards below
    keep = {s for s, _ in committed[-max_to_keep:]}
    for p in d.iterdir():
        m = _SHARD.match(p.name)
        if (m and int(m.group(1)) not in keep) or _TEMPORARY.match(p.name):
            p.unlink(missing_ok=True)
    return path


def _covers_once(parts: list[Part], num_rows: int) -> bool:
    """Whether the parts' row ranges cover ``range(num_rows)`` exactly once: their lengths
    add up and no two overlap. The ranges share one step (every partition rule does), so
    two can only overlap within one residue class: sorting each class is enough (n log n,
    nothing allocated per row, however the manifest was crafted)."""
    if len(parts) == 1 and parts[0].rows is None:
        return True
    if any(p.rows is None for p in parts):
        return False
    ranges = [r for r in (range(*p.rows) for p in parts if p.rows is not None) if r]
    if len({r.step for r in ranges}) > 1:
        return False
    if sum(len(r) for r in ranges) != num_rows or any(
        r[0] < 0 or r[-1] >= num_rows for r in ranges
    ):
        return False
    ranges.sort(key=lambda r: (r.start % r.step, r.start))
    return all(
        a.start % a.step != b.start % b.step or a[-1] < b.start
        for a, b in zip(ranges, ranges[1:], strict=False)
    )


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} must be a list of non-negative integers")
    return value


def _parse_index(raw: Any, num_shards: int, what: str) -> dict[str, Entry]:
    if not isinstance(raw, dict):
        raise ValueError(f"'{what}' must be a table")
    out = {}
    for name, e in raw.items():
        if not isinstance(e, dict) or not {"shape", "dtype", "parts"} <= e.keys():
            raise ValueError(f"{what} '{name}' needs shape, dtype and parts")
        shape = tuple(_ints(e["shape"], f"{what} '{name}': shape"))
        if not isinstance(e["dtype"], str) or np.dtype(e["dtype"]).kind not in _DTYPE_KINDS:
            raise ValueError(f"{what} '{name}': dtype {e['dtype']!r} is not a number type")
        if not isinstance(e["parts"], list) or not e["parts"]:
            raise ValueError(f"{what} '{name}': parts must be a non-empty list")
        nbytes = math.prod(shape) * np.dtype(e["dtype"]).itemsize
        if nbytes > ABSURD_BYTES:
            raise ValueError(
                f"{what} '{name}' declares {human(nbytes)} ({e['dtype']}{list(shape)}): absurd"
            )
        parts = []
        for p in e["parts"]:
            if (
                not isinstance(p, dict)
                or type(p.get("shard")) is not int
                or not 0 <= p["shard"] < num_shards
            ):
                raise ValueError(f"{what} '{name}': a part names no shard of 0..{num_shards - 1}")
            rows = p.get("rows")
            if rows is not None:
                rows = tuple(_ints(rows, f"{what} '{name}': rows"))
                if len(rows) != 3 or rows[2] == 0 or not shape or rows[1] > shape[0]:
                    raise ValueError(f"{what} '{name}': rows {list(rows)} do not fit {list(shape)}")
                if rows[2] > MAX_SHARDS:
                    raise ValueError(f"{what} '{name}': rows {list(rows)} step past {MAX_SHARDS}")
            parts.append(Part(p["shard"], rows))
        if len({p.shard for p in parts}) != len(parts):
            raise ValueError(f"{what} '{name}': a shard holds two of its parts")
        if not _covers_once(parts, shape[0] if shape else 1):
            raise ValueError(f"{what} '{name}': its parts do not cover it exactly once")
        out[name] = Entry(shape, e["dtype"], tuple(parts))
    return out


class Checkpoint:
    """A committed checkpoint, read through its manifest."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.directory = self.path.parent
        m = _MANIFEST.match(self.path.name)
        if not m:
            raise CheckpointError(f"{path}: not a checkpoint manifest (ckpt-<step>.json)")
        try:
            text = read_text(self.path, CheckpointError, f"checkpoint {path}", TEXT_LIMIT)
            check_fits(8 * len(text), f"checkpoint {path}: parsing its manifest", CheckpointError)
            raw = json.loads(text)
            if not isinstance(raw, dict) or raw.get("format") != FORMAT:
                raise CheckpointError(f"checkpoint {path}: not an mpips checkpoint manifest")
            self.step = raw["global_step"]
            self.num_shards = raw["shards"]
            if type(self.step) is not int or self.step != int(m.group(1)):
                raise ValueError("global_step does not match the file name")
            if type(self.num_shards) is not int or not 1 <= self.num_shards <= MAX_SHARDS:
                raise ValueError(f"shards must be an integer in 1..{MAX_SHARDS}")
            self.variables = _parse_index(raw["variables"], self.num_shards, "variables")
            self.slots = _parse_index(raw.get("slots", {}), self.num_shards, "slots")
            clocks = raw.get("clocks")
            self.clocks = _ints(clocks, "clocks") if clocks is not None else None
            self.run: str | None = raw.get(RUN)
            if self.run is not None and not isinstance(self.run, str):
                raise ValueError(f"{RUN} must be a string")
        except CheckpointError:
            raise
        except RecursionError:
            raise CheckpointError(
                f"checkpoint {path}: corrupt (its JSON is nested too deeply to be a manifest)"
            ) from None
        except (OSError, KeyError, ValueError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint {path}: corrupt or unreadable ({e})") from None
        self.meta = {k: v for k, v in raw.items() if k not in ("variables", "slots")}
        self.stored_bytes = 0  # of the last read: bytes read from the shards
        self.regenerated_bytes = 0  # and bytes of rows not stored, computed again

    def shard_path(self, k: int) -> Path:
        return self.directory / shard_name(self.step, k, self.num_shards)

    def read(
        self,
        specs: Iterable[VariableSpec],
        slot_specs: Iterable[VariableSpec] = (),
        rows: dict[str, Rows] | None = None,
        initial: InitialValues | None = None,
    ) -> dict[str, np.ndarray]:
        """Arrays for ``specs`` (variables) and ``slot_specs``, reassembled from their parts:
        whole, or for a name in ``rows`` only ``range(*rows[name])`` of axis 0, read from the
        shards that hold them (a PS restoring its partition never holds the whole table).
        Rows that a sparse part does not store are computed again: a constant, or
        ``initial``'s rows (without it, NeedsModel: a checkpoint never makes mpips build the
        model it names). Every shard read must carry the manifest's run id. Anything missing
        or of another shape or dtype is an error naming it; ``stored_bytes`` and
        ``regenerated_bytes`` then say how much was read from the shards and how much
        computed."""
        rows = rows or {}
        wanted = [(s, False) for s in specs] + [(s, True) for s in slot_specs]
        out: dict[str, np.ndarray] = {}
        files: dict[int, h5py.File] = {}
        entries = [self._entry(spec, is_slot) for spec, is_slot in wanted]
        need = sum(
            _nbytes(e, rows.get(spec.name)) for e, (spec, _) in zip(entries, wanted, strict=True)
        )
        check_fits(need, f"reading checkpoint {self.path}", CheckpointError)
        self.stored_bytes = self.regenerated_bytes = 0
        try:
            for entry, (spec, is_slot) in zip(entries, wanted, strict=True):
                out[spec.name] = self._assemble(
                    _Wanted(spec.name, is_slot, entry, rows.get(spec.name), initial), files
                )
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {self.path}: corrupt or unreadable ({e})") from None
        finally:
            for f in files.values():
                f.close()
        return out

    def _entry(self, spec: VariableSpec, is_slot: bool) -> Entry:
        """The index entry of ``spec``, checked against it."""
        entry = (self.slots if is_slot else self.variables).get(spec.name)
        if entry is None:
            kind = "optimizer slot" if is_slot else "variable"
            raise CheckpointError(
                f"checkpoint {self.path}: has no {kind} '{spec.name}' (written for another "
                f"model or optimizer? start afresh with --no-restore or another --ckpt-dir)"
            )
        if entry.shape != tuple(spec.shape) or np.dtype(entry.dtype) != np.dtype(spec.dtype):
            raise CheckpointError(
                f"checkpoint {self.path}: variable '{spec.name}' is {entry.dtype}"
                f"{list(entry.shape)}, the model expects {spec.dtype}{list(spec.shape)}"
            )
        return entry

    def _assemble(self, w: _Wanted, files: dict[int, h5py.File]) -> np.ndarray:
        """The rows ``w`` wants, from every part that holds some of them."""
        full = (0, w.entry.shape[0] if w.entry.shape else 1, 1)
        target = range(*(w.rows or full))
        for part in w.entry.parts:  # the common cases: a whole array, or the same partition
            if range(*(part.rows or full)) == target:
                stored = self._stored(w, part, files)
                if isinstance(stored, h5py.Dataset):
                    self.stored_bytes += stored.nbytes
                    return stored[()]
                array = np.empty((len(target),) + w.entry.shape[1:], w.entry.dtype)
                everything = slice(0, len(target), 1)
                self._read_sparse(w, stored, array, everything, everything)
                return array
        array = np.empty((len(target),) + w.entry.shape[1:], w.entry.dtype)
        for part in w.entry.parts:
            both = _overlap(target, range(*(part.rows or full)))
            if both is None:
                continue
            stored = self._stored(w, part, files)
            if isinstance(stored, h5py.Dataset):  # one hyperslab on each side, straight in
                stored.read_direct(array, *both)
                self.stored_bytes += array[both[1]].nbytes
            else:
                self._read_sparse(w, stored, array, *both)
        return array

    def _stored(
        self, w: _Wanted, part: Part, files: dict[int, h5py.File]
    ) -> h5py.Dataset | _SparsePart:
        """What ``part`` is stored as (a dataset, or a sparse part), checked against the
        manifest."""
        if part.shard not in files:
            path = self.shard_path(part.shard)
            if not path.is_file():
                raise CheckpointError(f"checkpoint {self.path}: shard {path.name} is missing")
            f = open_plain(path, CheckpointError, f"checkpoint {self.path}: shard {path.name}")
            files[part.shard] = f
            wrote = _text(f.attrs.get(RUN))
            if self.run is not None and wrote != self.run:
                raise CheckpointError(
                    f"checkpoint {self.path}: shard {path.name} was written by "
                    f"{f'run {wrote}' if wrote else 'a run with no id'}, not by the run that "
                    f"committed this manifest ({self.run}): two runs wrote into "
                    f"{self.directory}; this checkpoint cannot be read"
                )
        entry = w.entry
        obj = files[part.shard].get(h5_path(w.name, w.is_slot))
        if isinstance(obj, h5py.Group) and entry.shape:
            return self._sparse(w, part, obj)
        shape = entry.shape if part.rows is None else (len(range(*part.rows)),) + entry.shape[1:]
        if (
            not isinstance(obj, h5py.Dataset)
            or obj.shape != shape
            or obj.dtype != np.dtype(entry.dtype)
        ):
            raise CheckpointError(
                f"checkpoint {self.path}: shard {part.shard} does not hold "
                f"'{w.name}' as the manifest says"
            )
        return obj

    def _sparse(self, w: _Wanted, part: Part, g: h5py.Group) -> _SparsePart:
        """A sparse part checked: its attributes, the shapes and dtypes of its index and
        values, and every index entry (in range, strictly ascending); a CheckpointError
        saying what is wrong otherwise."""
        entry, dtype = w.entry, np.dtype(w.entry.dtype)
        rows = range(*(part.rows or (0, entry.shape[0], 1)))

        def bad(problem: str) -> CheckpointError:
            return CheckpointError(
                f"checkpoint {self.path}: shard {part.shard} holds '{w.name}' sparsely, but "
                f"{problem}"
            )

        attrs = dict(g.attrs)
        if attrs.get("layout") != SPARSE:
            raise bad(f"its layout is {attrs.get('layout')!r}, not {SPARSE!r}")
        if _integer(attrs.get("rows")) != len(rows):
            raise bad(f"it says it has {attrs.get('rows')} rows, the manifest {len(rows)}")
        index, values = g.get("index"), g.get("values")
        if not isinstance(index, h5py.Dataset) or index.ndim != 1 or index.dtype.kind not in "iu":
            raise bad("its row index is not a 1-D array of integers")
        if not isinstance(values, h5py.Dataset):
            raise bad("it has no values")
        k = index.shape[0]
        if k > len(rows):
            raise bad(f"its row index has {k} entries for {len(rows)} rows")
        if values.shape != (k,) + entry.shape[1:] or values.dtype != dtype:
            raise bad(
                f"its values are {values.dtype}{list(values.shape)}, not "
                f"{dtype}{[k, *entry.shape[1:]]} (one row per index entry)"
            )
        constant, seed = self._sparse_base(attrs, dtype, bad)
        check_fits(8 * k, f"reading checkpoint {self.path}", CheckpointError)
        positions = index[()].astype(np.int64)
        if k and (positions.min() < 0 or positions.max() >= len(rows)):
            raise bad(f"its row index holds positions outside 0..{len(rows) - 1}")
        if k and bool((positions[1:] <= positions[:-1]).any()):
            raise bad("its row index is not strictly ascending (sorted, no repeats)")
        return _SparsePart(rows, positions, values, constant, seed)

    @staticmethod
    def _sparse_base(
        attrs: dict[str, Any], dtype: np.dtype[Any], bad: Callable[[str], CheckpointError]
    ) -> tuple[np.ndarray | None, int]:
        """(the constant the unstored rows hold, or None; the seed of their initial values)."""
        base = attrs.get("base")
        if base == "constant":
            value = attrs.get("value")
            if not isinstance(value, np.generic | np.ndarray) or value.dtype != dtype:
                raise bad(f"its constant is not one {dtype}")
            if np.size(value) != 1:
                raise bad(f"its constant is not one {dtype}")
            return np.asarray(value).reshape(()), 0
        if base == "initial":
            seed = _integer(attrs.get("seed"))
            if seed is None:
                raise bad("the seed of its initial values is not an integer")
            return None, seed
        raise bad(f"what its other rows hold is {base!r}, not 'constant' or 'initial'")

    def _read_sparse(
        self, w: _Wanted, part: _SparsePart, out: np.ndarray, held: slice, into: slice
    ) -> None:
        """Rows ``held`` (positions in the part) of a sparse part into ``out[into]``: their
        initial values first (a constant, or computed a chunk of rows at a time), then the
        rows the part stores, scattered over them (read a chunk at a time)."""
        view, chosen = out[into], range(len(part.rows))[held]
        if not len(chosen):
            return
        if part.constant is not None:
            view[...] = part.constant
        else:
            self._regenerate(w, part.rows[held], part.seed, view)
        index = part.index
        mine = (index >= chosen.start) & (index < chosen.stop)
        mine &= (index - chosen.start) % chosen.step == 0
        for lo, hi in row_chunks(len(index), view[:1].size, CHUNK_ELEMENTS):
            take = mine[lo:hi]
            if take.any():
                rows = part.values[lo:hi]
                self.stored_bytes += rows.nbytes + index[lo:hi].nbytes
                view[(index[lo:hi][take] - chosen.start) // chosen.step] = rows[take]
        self.regenerated_bytes += view.nbytes - int(mine.sum()) * view[:1].nbytes

    def _regenerate(self, w: _Wanted, rows: range, seed: int, view: np.ndarray) -> None:
        """The initial values of ``rows`` of ``w`` (a table, or a slot of one) into ``view``,
        a chunk of rows at a time, each checked for shape and dtype."""
        initial = w.initial
        if initial is None:
            raise NeedsModel(
                f"checkpoint {self.path}: '{w.name}' stores only its trained rows; the others "
                f"are the initial values of the model that wrote it, and mpips builds a "
                f"model only from a job you give, never from one a checkpoint names: pass "
                f"the job file that trained it (--job JOB)"
            )
        table, slot = w.name.rsplit("/", 1) if w.is_slot else (w.name, "")
        for lo, hi in row_chunks(len(rows), view[:1].size, initial.chunk_elements):
            sub = rows[lo:hi]
            try:
                got = initial.compute(table, (sub.start, sub.stop, sub.step), seed).get(slot)
            except Exception as e:  # the model's code: one message, no traceback
                raise CheckpointError(
                    f"checkpoint {self.path}: cannot compute the initial rows of '{w.name}' "
                    f"that it does not store ({type(e).__name__}: {e})"
                ) from None
            got = None if got is None else np.asarray(got)
            if got is None or got.shape != view[lo:hi].shape or got.dtype != view.dtype:
                raise CheckpointError(
                    f"checkpoint {self.path}: the model gives no {view.dtype}"
                    f"{list(view[lo:hi].shape)} initial rows for '{w.name}' (not the model "
                    f"that wrote the checkpoint?)"
                )
            view[lo:hi] = got

    def layouts(self, name: str, is_slot: bool = False) -> list[tuple[int, int | None]]:
        """How each part of a variable (or slot) is stored: (shard, rows stored) for a
        sparse part, (shard, None) for a dense one."""
        entry = (self.slots if is_slot else self.variables)[name]
        out = []
        for part in entry.parts:
            path = self.shard_path(part.shard)
            with open_plain(
                path, CheckpointError, f"checkpoint {self.path}: shard {path.name}"
            ) as f:
                obj = f.get(h5_path(name, is_slot))
                index = obj.get("index") if isinstance(obj, h5py.Group) else None
                stored = index.shape[0] if isinstance(index, h5py.Dataset) and index.ndim else None
                out.append((part.shard, stored))
        return out

    def read_all(
        self, initial: InitialValues | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every variable and slot, whole (``initial``: see read)."""

        def specs(index: dict[str, Entry]) -> list[VariableSpec]:
            return [VariableSpec(n, e.shape, e.dtype) for n, e in index.items()]

        both = self.read(specs(self.variables), specs(self.slots), initial=initial)
        return ({n: both[n] for n in self.variables}, {n: both[n] for n in self.slots})


@dataclass(frozen=True)
class _Wanted:
    """What a read wants of one variable or slot: its rows (None: all), and how to compute
    initial rows a sparse part does not store (None: the reader has no model)."""

    name: str
    is_slot: bool
    entry: Entry
    rows: Rows | None
    initial: InitialValues | None


@dataclass(frozen=True)
class _SparsePart:
    """A part stored sparsely, checked: its rows of the whole variable, the ascending
    positions (in the part) of the rows it stores, those rows, and what the other rows hold
    (``constant``, or the initial values of ``seed``)."""

    rows: range
    index: np.ndarray
    values: h5py.Dataset
    constant: np.ndarray | None
    seed: int


def _integer(value: Any) -> int | None:
    """``value`` as an int if it is an integer (a Python or numpy one, not a bool)."""
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value[()]
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        return None
    return int(value)


def _nbytes(entry: Entry, rows: Rows | None = None) -> int:
    """Bytes of an entry, or of ``rows`` of it."""
    count = (
        math.prod(entry.shape[1:]) * (len(range(*rows)) if rows else entry.shape[0])
        if entry.shape
        else 1
    )
    return count * np.dtype(entry.dtype).itemsize


def _overlap(want: range, held: range) -> tuple[slice, slice] | None:
    """The rows in both ``want`` and ``held`` (a progression of step lcm of theirs), as
    (their positions in ``held``, their positions in ``want``); None if they share none."""
    low, high = max(want.start, held.start), min(want.stop, held.stop)
    first = want.start + max(0, -(-(low - want.start) // want.step)) * want.step
    # the smallest k >= 0 with first + k * want.step = held.start (mod held.step)
    g = math.gcd(want.step, held.step)
    gap = held.start - first
    if gap % g:
        return None
    modulus = held.step // g
    k = (gap // g) * pow(want.step // g, -1, modulus) % modulus if modulus > 1 else 0
    first += k * want.step
    if first >= high:
        return None
    common = range(first, high, math.lcm(want.step, held.step))

    def positions(r: range) -> slice:
        step = common.step // r.step
        start = (first - r.start) // r.step
        return slice(start, start + (len(common) - 1) * step + 1, step)

    return positions(held), positions(want)


def resolve(path: str | Path) -> Checkpoint:
    """A checkpoint from its manifest, or the latest committed one in a directory."""
    p = Path(path)
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise CheckpointError(f"{p}: no checkpoint (ckpt-<step>.json) in this directory")
        return Checkpoint(latest)
    if not p.exists():
        raise CheckpointError(f"{p}: not found")
    if _SHARD.match(p.name):
        raise CheckpointError(
            f"{p}: one shard of a checkpoint; give its manifest "
            f"({p.name.split('.')[0]}.json) or the directory"
        )
    return Checkpoint(p)


def export(
    ckpt: Checkpoint,
    out: str | Path,
    with_slots: bool = False,
    initial: InitialValues | None = None,
) -> Path:
    """Write the full variables (and, optionally, slots) of a checkpoint to one plain HDF5
    file: one dataset per variable at its name, global_step as an attribute; atomically.
    Sparse parts are written whole (``initial``: see Checkpoint.read). WriteFailed (exit
    1) if the file system refuses ``out``."""
    variables, slots = ckpt.read_all(initial)
    out = Path(out)

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs["global_step"] = ckpt.step
            f.attrs["source"] = str(ckpt.path)
            for name, value in variables.items():
                f.create_dataset(name, data=value)
            for name, value in (slots if with_slots else {}).items():
                f.create_dataset(h5_path(name, True), data=value)

    return atomic_write(out, write, "nothing exported")

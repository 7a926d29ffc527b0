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
reads JSON and arrays only (no pickle, no eval); file names come from a fixed pattern and
never leave the checkpoint directory.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .errors import CheckpointError, NonFinite
from .files import atomic_write, temporary_name
from .hdf5 import open_plain
from .memory import ABSURD_BYTES, check_fits, human
from .placement import Placement, VariableSpec

FORMAT = "mpips-checkpoint-2"
_MANIFEST = re.compile(r"^ckpt-(\d+)\.json$")
_SHARD = re.compile(r"^ckpt-(\d+)\.shard-(\d+)-of-(\d+)\.h5$")
_TEMPORARY = re.compile(r"^\.ckpt-\d+\..*\.tmp-")
_DTYPE_KINDS = "biufc"  # numbers only: an object dtype would mean pickled data
MAX_SHARDS = 1 << 20  # one shard per PS task: more is a corrupt or hostile manifest

Rows = tuple[int, int, int]  # range(start, stop, step) of axis 0


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
                f"checkpointed, training stopped (the learning rate too high? "
                f"lower optimizer.learning_rate or set optimizer.clip_norm)"
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


def write_shard(
    directory: str | Path,
    step: int,
    shard: int,
    num_shards: int,
    variables: dict[str, np.ndarray],
    slots: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write one shard atomically: ``variables`` (name -> array, or the part of it this
    shard holds) and ``slots`` (``<variable>/<slot>`` -> array). NonFinite, and nothing
    written, if any value is NaN or infinite."""
    check_finite({**variables, **(slots or {})}, step)

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["global_step"] = step
            f.attrs["shard"] = shard
            for is_slot, arrays in ((False, variables), (True, slots or {})):
                for name, value in arrays.items():
                    f.create_dataset(h5_path(name, is_slot), data=value)

    return atomic_write(Path(directory) / shard_name(step, shard, num_shards), write)


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
) -> Path:
    """After every shard of ``step`` is in place: write the manifest (the commit), then prune
    to the newest ``max_to_keep`` and delete what uncommitted writes left behind."""
    d = Path(directory)
    for k in range(num_shards):
        if not (d / shard_name(step, k, num_shards)).is_file():
            raise CheckpointError(
                f"checkpoint {d}: shard {k} of {num_shards} for global_step "
                f"{step} is missing; not committed"
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
        "variables": encode(variables),
        "slots": encode(slots),
    }

    def write(tmp: Path) -> None:
        tmp.write_text(json.dumps(manifest, indent=1))

    path = atomic_write(d / manifest_name(step), write)
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
            size = self.path.stat().st_size
            check_fits(8 * size, f"checkpoint {path}: parsing its manifest", CheckpointError)
            raw = json.loads(self.path.read_text())
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
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, TypeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"checkpoint {path}: corrupt or unreadable ({e})") from None
        self.meta = {k: v for k, v in raw.items() if k not in ("variables", "slots")}

    def shard_path(self, k: int) -> Path:
        return self.directory / shard_name(self.step, k, self.num_shards)

    def read(
        self,
        specs: Iterable[VariableSpec],
        slot_specs: Iterable[VariableSpec] = (),
        rows: dict[str, Rows] | None = None,
    ) -> dict[str, np.ndarray]:
        """Arrays for ``specs`` (variables) and ``slot_specs``, reassembled from their parts:
        whole, or for a name in ``rows`` only ``range(*rows[name])`` of axis 0, read from the
        shards that hold them (a PS restoring its partition never holds the whole table).
        Anything missing or of another shape or dtype is an error naming it."""
        rows = rows or {}
        wanted = [(s, False) for s in specs] + [(s, True) for s in slot_specs]
        out: dict[str, np.ndarray] = {}
        files: dict[int, h5py.File] = {}
        entries = [self._entry(spec, is_slot) for spec, is_slot in wanted]
        need = sum(
            _nbytes(e, rows.get(spec.name)) for e, (spec, _) in zip(entries, wanted, strict=True)
        )
        check_fits(need, f"reading checkpoint {self.path}", CheckpointError)
        try:
            for entry, (spec, is_slot) in zip(entries, wanted, strict=True):
                out[spec.name] = self._assemble(
                    spec.name, is_slot, entry, files, rows.get(spec.name)
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

    def _assemble(
        self,
        name: str,
        is_slot: bool,
        entry: Entry,
        files: dict[int, h5py.File],
        want: Rows | None = None,
    ) -> np.ndarray:
        full = (0, entry.shape[0] if entry.shape else 1, 1)
        for part in entry.parts:  # the common cases: a whole array, or the same partition
            if range(*(part.rows or full)) == range(*(want or full)):
                return self._dataset(name, is_slot, entry, part, files)[()]
        target = range(*(want or full))
        array = np.empty((len(target),) + entry.shape[1:], entry.dtype)
        for part in entry.parts:
            both = _overlap(target, range(*(part.rows or full)))
            if both is not None:  # one hyperslab on each side, read straight into place
                self._dataset(name, is_slot, entry, part, files).read_direct(array, *both)
        return array

    def _dataset(
        self, name: str, is_slot: bool, entry: Entry, part: Part, files: dict[int, h5py.File]
    ) -> h5py.Dataset:
        """The dataset of ``part``, checked against the manifest."""
        if part.shard not in files:
            path = self.shard_path(part.shard)
            if not path.is_file():
                raise CheckpointError(f"checkpoint {self.path}: shard {path.name} is missing")
            files[part.shard] = open_plain(
                path, CheckpointError, f"checkpoint {self.path}: shard {path.name}"
            )
        ds = files[part.shard].get(h5_path(name, is_slot))
        shape = entry.shape if part.rows is None else (len(range(*part.rows)),) + entry.shape[1:]
        if (
            not isinstance(ds, h5py.Dataset)
            or ds.shape != shape
            or ds.dtype != np.dtype(entry.dtype)
        ):
            raise CheckpointError(
                f"checkpoint {self.path}: shard {part.shard} does not hold "
                f"'{name}' as the manifest says"
            )
        return ds

    def read_all(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Every variable and slot, whole."""

        def specs(index: dict[str, Entry]) -> list[VariableSpec]:
            return [VariableSpec(n, e.shape, e.dtype) for n, e in index.items()]

        both = self.read(specs(self.variables), specs(self.slots))
        return ({n: both[n] for n in self.variables}, {n: both[n] for n in self.slots})


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


def export(ckpt: Checkpoint, out: str | Path, with_slots: bool = False) -> Path:
    """Write the full variables (and, optionally, slots) of a checkpoint to one plain HDF5
    file: one dataset per variable at its name, global_step as an attribute; atomically."""
    variables, slots = ckpt.read_all()
    out = Path(out)

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as f:
            f.attrs["global_step"] = ckpt.step
            f.attrs["source"] = str(ckpt.path)
            for name, value in variables.items():
                f.create_dataset(name, data=value)
            for name, value in (slots if with_slots else {}).items():
                f.create_dataset(h5_path(name, True), data=value)

    return atomic_write(out, write)

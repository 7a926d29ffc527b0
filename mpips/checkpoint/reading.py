"""Reading a committed checkpoint through its manifest: arrays by variable name, whole or
only the rows a reader holds, reassembled from whatever parts the shards hold them in (so a
checkpoint loads on any number of PS tasks or workers). Rows a sparse part leaves out are
computed by the InitialValues the reader hands in; nothing here builds a model."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from ..errors import CheckpointError
from ..files import TEXT_LIMIT, read_text
from ..hdf5 import Damaged, h5py_errors, open_plain, plain_attrs
from ..initial import CHUNK_ELEMENTS, InitialValues, row_chunks
from ..memory import check_fits
from ..variables import VariableSpec
from .checks import count_non_finite
from .format import (
    FORMAT,
    MANIFEST_FILE,
    MAX_SHARDS,
    RUN,
    SHARD_FILE,
    Entry,
    Part,
    Rows,
    h5_path,
    latest_checkpoint,
    shard_name,
    text_attr,
)
from .manifest import MAX_INT, check_meta, parse_index, parse_ints
from .sparse import SparsePart, check_sparse


class NeedsModel(CheckpointError):
    """A sparse part's untouched rows are the initial values of the model that wrote it, and
    the reader was given no model to compute them (mpips never builds one the files name)."""


class Checkpoint:
    """A committed checkpoint, read through its manifest."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.directory = self.path.parent
        m = MANIFEST_FILE.match(self.path.name)
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
            if not 0 <= self.step <= MAX_INT:
                raise ValueError(f"global_step {self.step} is not in 0..2**62 - 1")
            if type(self.num_shards) is not int or not 1 <= self.num_shards <= MAX_SHARDS:
                raise ValueError(f"shards must be an integer in 1..{MAX_SHARDS}")
            self.variables = parse_index(raw["variables"], self.num_shards, "variables")
            self.slots = parse_index(raw.get("slots", {}), self.num_shards, "slots")
            clocks = raw.get("clocks")
            self.clocks = parse_ints(clocks, "clocks") if clocks is not None else None
            self.run: str | None = raw.get(RUN)
            if self.run is not None and not isinstance(self.run, str):
                raise ValueError(f"{RUN} must be a string")
            check_meta(raw)
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
        finite: str = "",
    ) -> dict[str, np.ndarray]:
        """Arrays for ``specs`` (variables) and ``slot_specs``, reassembled from their parts:
        whole, or for a name in ``rows`` only ``range(*rows[name])`` of axis 0, read from the
        shards that hold them (a PS restoring its partition never holds the whole table).
        Rows that a sparse part does not store are computed again: a constant, or
        ``initial``'s rows (without it, NeedsModel: a checkpoint never makes mpips build the
        model it names). Every shard read must carry the manifest's run id. Anything missing
        or of another shape or dtype is an error naming it; ``stored_bytes`` and
        ``regenerated_bytes`` then say how much was read from the shards and how much
        computed. ``finite`` (what NaN or infinity would spoil, and what to do instead):
        every array is checked as it is read, and one holding NaN or infinity is a
        CheckpointError naming it and saying ``finite``."""
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
                if finite:
                    self.refuse_non_finite(spec.name, out[spec.name], is_slot, finite)
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {self.path}: corrupt or unreadable ({e})") from None
        finally:
            for f in files.values():
                f.close()
        return out

    def refuse_non_finite(
        self, name: str, value: np.ndarray, is_slot: bool, consequence: str
    ) -> None:
        """CheckpointError if ``value`` (variable or slot ``name`` as read from this
        checkpoint) holds NaN or infinity: no mpips run writes such values, and whatever
        used them would be meaningless (``consequence`` says what, and what to do)."""
        bad = count_non_finite(value)
        if bad:
            kind = "optimizer slot" if is_slot else "variable"
            raise CheckpointError(
                f"checkpoint {self.path}: {kind} '{name}' holds {bad} NaN or infinite "
                f"value(s) of {np.size(value)}: {consequence}"
            )

    def _damaged(self, shard: int) -> Damaged:
        """The error for shard ``shard`` that h5py cannot read (damaged, truncated)."""
        name = self.shard_path(shard).name

        def damaged(why: str) -> CheckpointError:
            return CheckpointError(
                f"checkpoint {self.path}: corrupt or unreadable (shard {name}: {why})"
            )

        return damaged

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
                    with h5py_errors(self._damaged(part.shard)):
                        whole = stored[()]
                    self.stored_bytes += whole.nbytes
                    return whole
                array = np.empty((len(target),) + w.entry.shape[1:], w.entry.dtype)
                everything = slice(0, len(target), 1)
                self._read_sparse(w, part.shard, stored, array, everything, everything)
                return array
        array = np.empty((len(target),) + w.entry.shape[1:], w.entry.dtype)
        for part in w.entry.parts:
            both = _overlap(target, range(*(part.rows or full)))
            if both is None:
                continue
            stored = self._stored(w, part, files)
            if isinstance(stored, h5py.Dataset):  # one hyperslab on each side, straight in
                with h5py_errors(self._damaged(part.shard)):
                    stored.read_direct(array, *both)
                self.stored_bytes += array[both[1]].nbytes
            else:
                self._read_sparse(w, part.shard, stored, array, *both)
        return array

    def _stored(
        self, w: _Wanted, part: Part, files: dict[int, h5py.File]
    ) -> h5py.Dataset | SparsePart:
        """What ``part`` is stored as (a dataset, or a sparse part), checked against the
        manifest."""
        damaged = self._damaged(part.shard)
        if part.shard not in files:
            path = self.shard_path(part.shard)
            if not path.is_file():
                raise CheckpointError(f"checkpoint {self.path}: shard {path.name} is missing")
            f = open_plain(
                path, CheckpointError, f"checkpoint {self.path}: shard {path.name}", damaged
            )
            files[part.shard] = f
            with h5py_errors(damaged):
                wrote = text_attr(plain_attrs(f).get(RUN))
            if self.run is not None and wrote != self.run:
                raise CheckpointError(
                    f"checkpoint {self.path}: shard {path.name} was written by "
                    f"{f'run {wrote}' if wrote else 'a run with no id'}, not by the run that "
                    f"committed this manifest ({self.run}): two runs wrote into "
                    f"{self.directory}; this checkpoint cannot be read"
                )
        entry = w.entry
        with h5py_errors(damaged):
            obj = files[part.shard].get(h5_path(w.name, w.is_slot))
            if isinstance(obj, h5py.Group) and entry.shape:
                return check_sparse(self.path, w.name, entry, part, obj)
            held = (obj.shape, obj.dtype) if isinstance(obj, h5py.Dataset) else None
        shape = entry.shape if part.rows is None else (len(range(*part.rows)),) + entry.shape[1:]
        if held is None or held[0] != shape or held[1] != np.dtype(entry.dtype):
            raise CheckpointError(
                f"checkpoint {self.path}: shard {self.shard_path(part.shard).name} does not hold "
                f"'{w.name}' as the manifest says"
            )
        return obj

    def _read_sparse(
        self,
        w: _Wanted,
        shard: int,
        part: SparsePart,
        out: np.ndarray,
        held: slice,
        into: slice,
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
                with h5py_errors(self._damaged(shard)):
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
            path, damaged = self.shard_path(part.shard), self._damaged(part.shard)
            with (
                open_plain(
                    path, CheckpointError, f"checkpoint {self.path}: shard {path.name}", damaged
                ) as f,
                h5py_errors(damaged),
            ):
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
    if SHARD_FILE.match(p.name):
        raise CheckpointError(
            f"{p}: one shard of a checkpoint; give its manifest "
            f"({p.name.split('.')[0]}.json) or the directory"
        )
    return Checkpoint(p)

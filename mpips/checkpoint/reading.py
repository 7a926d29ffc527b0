"""Reading a committed checkpoint through its manifest: arrays by variable name, whole or
only the rows a reader holds, reassembled from whatever parts the shards hold them in (so a
checkpoint loads on any number of PS tasks or workers). Rows a sparse part leaves out are
computed by the InitialValues the reader hands in; nothing here builds a model."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from ..data.hdf5 import Damaged, h5py_errors, open_plain, plain_attrs
from ..errors import CheckpointError
from ..models.initial import CHUNK_ELEMENTS, InitialValues, row_chunks
from ..models.variables import VariableSpec
from ..process.files import TEXT_LIMIT, read_text
from ..process.memory import check_fits
from .checks import count_non_finite
from .checksum import CHECKSUM, CRC32, crc32, recorded
from .format import (
    FORMAT,
    MANIFEST_FILE,
    MAX_SHARDS,
    RUN,
    SHARD_FILE,
    SHARDS,
    Entry,
    Part,
    Rows,
    h5_path,
    latest_checkpoint,
    manifest_name,
    shard_name,
    text_attr,
)
from .increments import BASES, MAX_CHAIN
from .manifest import MAX_INT, check_meta, parse_index, parse_ints
from .sparse import SparsePart, check_sparse, integer

# the shard attributes that must equal the manifest's (format and run are checked apart),
# in words; SHARDS only where written (shards before it do not record their count)
READ_BLOCK_ELEMENTS = 4 * CHUNK_ELEMENTS  # a large part is read (and checksummed) in blocks
SHARD_NUMBERS = {"global_step": "global_step", "shard": "shard index", SHARDS: "shard count"}


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
            self.bases = parse_ints(raw.get(BASES, []), BASES)
            if any(b >= self.step for b in self.bases):
                raise ValueError(f"{BASES} must be steps before {self.step}")
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
        self.depth = 0  # checkpoints overlaid on the one first read (see increments)

    def shard_path(self, k: int) -> Path:
        return self.directory / shard_name(self.step, k, self.num_shards)

    def read(
        self,
        specs: Iterable[VariableSpec],
        slot_specs: Iterable[VariableSpec] = (),
        rows: dict[str, Rows] | None = None,
        initial: InitialValues | None = None,
        finite: str = "",
        into: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Arrays for ``specs`` (variables) and ``slot_specs``, reassembled from their parts:
        whole, or for a name in ``rows`` only ``range(*rows[name])`` of axis 0, read from the
        shards that hold them (a PS restoring its partition never holds the whole table).
        Rows that a sparse part does not store are computed again: a constant, or
        ``initial``'s rows (without it, NeedsModel: a checkpoint never makes mpips build the
        model it names). Every shard read must carry the manifest's run id, format, global
        step, its own shard index and (where recorded) count; every dataset read whole is
        checked against the crc32 its shard records (see _verify). Anything missing, of
        another shape or dtype, or damaged is an error naming it; ``stored_bytes`` and
        ``regenerated_bytes`` then say how much was read from the shards and how much
        computed. ``finite`` (what NaN or infinity would spoil, and what to do instead):
        every array is checked as it is read, and one holding NaN or infinity is a
        CheckpointError naming it and saying ``finite``. ``into``: arrays (C-contiguous, of
        the rows wanted) to read some of them into, by name, instead of new ones."""
        rows, into = rows or {}, into or {}
        wanted = [(s, False) for s in specs] + [(s, True) for s in slot_specs]
        out: dict[str, np.ndarray] = {}
        files: dict[int, _Shard] = {}
        entries = [self._entry(spec, is_slot) for spec, is_slot in wanted]
        need = sum(
            _nbytes(e, rows.get(spec.name))
            for e, (spec, _) in zip(entries, wanted, strict=True)
            if spec.name not in into
        )
        check_fits(need, f"reading checkpoint {self.path}", CheckpointError)
        self.stored_bytes = self.regenerated_bytes = 0
        self._checks: list[tuple[_Wanted, int, int, Future[int]]] = []
        self._crcs = ThreadPoolExecutor(1, thread_name_prefix="mpips-crc32")
        try:
            for entry, (spec, is_slot) in zip(entries, wanted, strict=True):
                w = _Wanted(spec.name, is_slot, entry, rows.get(spec.name), initial)
                out[spec.name] = self._assemble(w, files, into.get(spec.name))
            for w, k, expected, got in self._checks:  # (damage first: it explains a NaN)
                self._verify(w, k, expected, got.result())
            for spec, is_slot in wanted if finite else ():
                self.refuse_non_finite(spec.name, out[spec.name], is_slot, finite)
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise CheckpointError(f"checkpoint {self.path}: corrupt or unreadable ({e})") from None
        finally:
            self._crcs.shutdown(cancel_futures=True)
            self._checks = []  # (a Checkpoint read again, or kept, holds nothing of this read)
            for shard in files.values():
                shard.file.close()
        return out

    def _verify_later(self, w: _Wanted, shard: int, expected: int | None, data: np.ndarray) -> None:
        """The crc32 of ``data`` (rows of ``w`` read from ``shard``, not written to again)
        computed in a thread while the next array is read (zlib gives the GIL up), and
        checked against ``expected`` (None: nothing to check) before read() returns."""
        if expected is not None:
            self._checks.append((w, shard, expected, self._crcs.submit(crc32, data)))

    def _read_whole(
        self, w: _Wanted, shard: int, stored: _Dense, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Every row of a dense part (into ``out``, if given); a large one read a block of
        rows at a time, each block's crc32 taken in the thread while the next is read (a
        checksum after the read made a restore from the page cache 2.5x slower; now it
        overlaps)."""
        ds = stored.dataset
        with h5py_errors(self._damaged(shard)):
            if stored.crc is None or ds.ndim == 0 or ds.size <= 2 * READ_BLOCK_ELEMENTS:
                if out is None:
                    whole = ds[()]
                else:
                    ds.read_direct(out)
                    whole = out
                self._verify_later(w, shard, stored.crc, whole)
                return whole
            whole = np.empty(ds.shape, ds.dtype) if out is None else out
            crc: Future[int] | None = None
            for lo, hi in row_chunks(len(whole), whole[:1].size, READ_BLOCK_ELEMENTS):
                ds.read_direct(whole, np.s_[lo:hi], np.s_[lo:hi])
                crc = self._crcs.submit(_crc_after, whole[lo:hi], crc)
        assert crc is not None
        self._checks.append((w, shard, stored.crc, crc))
        return whole

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

    def _assemble(
        self, w: _Wanted, files: dict[int, _Shard], into: np.ndarray | None = None
    ) -> np.ndarray:
        """The rows ``w`` wants (in ``into``, if given), from every part that holds some."""
        full = (0, w.entry.shape[0] if w.entry.shape else 1, 1)
        target = range(*(w.rows or full))
        shape = (len(target),) + w.entry.shape[1:]
        if into is not None and (into.shape != shape or not into.flags.c_contiguous):
            raise ValueError(f"{w.name}: read into an array that is not {list(shape)}")
        for part in w.entry.parts:  # the common cases: a whole array, or the same partition
            if range(*(part.rows or full)) == target:
                stored = self._stored(w, part, files)
                if isinstance(stored, _Dense):
                    whole = self._read_whole(w, part.shard, stored, into)
                    self.stored_bytes += whole.nbytes
                    return whole
                array = np.empty(shape, w.entry.dtype) if into is None else into
                everything = slice(0, len(target), 1)
                self._read_sparse(w, part.shard, stored, array, everything, everything)
                return array
        array = np.empty(shape, w.entry.dtype) if into is None else into
        for part in w.entry.parts:
            both = _overlap(target, range(*(part.rows or full)))
            if both is None:
                continue
            stored = self._stored(w, part, files)
            if isinstance(stored, _Dense):  # one hyperslab on each side, straight in
                with h5py_errors(self._damaged(part.shard)):
                    stored.dataset.read_direct(array, *both)
                if _is_all(both[0], len(range(*(part.rows or full)))):
                    self._verify_later(w, part.shard, stored.crc, array[both[1]])
                self.stored_bytes += array[both[1]].nbytes
            else:
                self._read_sparse(w, part.shard, stored, array, *both)
        return array

    def _stored(self, w: _Wanted, part: Part, files: dict[int, _Shard]) -> _Dense | SparsePart:
        """What ``part`` is stored as (a dataset, or a sparse part), checked against the
        manifest."""
        if part.shard not in files:
            files[part.shard] = self._open_shard(part.shard)
        shard, entry = files[part.shard], w.entry
        with h5py_errors(self._damaged(part.shard)):
            obj = shard.file.get(h5_path(w.name, w.is_slot))
            if isinstance(obj, h5py.Group) and entry.shape:
                return check_sparse(self.path, w.name, entry, part, obj, shard.checksummed)
            shape = (
                entry.shape if part.rows is None else (len(range(*part.rows)),) + entry.shape[1:]
            )
            problem = _held_mismatch(obj, shape, np.dtype(entry.dtype))
            if problem is None:
                assert isinstance(obj, h5py.Dataset)
                return _Dense(obj, recorded(obj, shard.checksummed, self._no_crc(w, part.shard)))
        name = self.shard_path(part.shard).name
        raise CheckpointError(
            f"checkpoint {self.path}: shard {name} {problem.format(name=w.name)}, the manifest "
            f"says {entry.dtype}{list(shape)}"
        )

    def _open_shard(self, k: int) -> _Shard:
        """Shard ``k`` opened as plain data, after checking that it is this checkpoint's:
        its run, format, global step, index and count are the manifest's (a shard copied
        or renamed from another checkpoint would mix two steps in one restore)."""
        path = self.shard_path(k)
        if not path.exists():  # (a FIFO, a directory, a device: open_plain says which)
            raise CheckpointError(f"checkpoint {self.path}: shard {path.name} is missing")
        damaged = self._damaged(k)
        f = open_plain(path, CheckpointError, f"checkpoint {self.path}: shard {path.name}", damaged)
        try:
            with h5py_errors(damaged):
                attrs = plain_attrs(f)
            self._check_run(path.name, text_attr(attrs.get(RUN)))
            problem = self._shard_mismatch(k, attrs)
        except BaseException:
            f.close()
            raise
        if problem is not None:
            f.close()
            raise CheckpointError(
                f"checkpoint {self.path}: shard {path.name} is not this checkpoint's: "
                f"{problem}; this checkpoint cannot be read"
            )
        return _Shard(f, attrs.get(CHECKSUM) == CRC32)

    def _check_run(self, name: str, wrote: str | None) -> None:
        """CheckpointError unless shard ``name`` was written by the run (``wrote``) that
        committed the manifest (if it names one)."""
        if self.run is not None and wrote != self.run:
            raise CheckpointError(
                f"checkpoint {self.path}: shard {name} was written by "
                f"{f'run {wrote}' if wrote else 'a run with no id'}, not by the run that "
                f"committed this manifest ({self.run}): two runs wrote into "
                f"{self.directory}; this checkpoint cannot be read"
            )

    def _shard_mismatch(self, k: int, attrs: dict[str, Any]) -> str | None:
        """How shard ``k``'s attributes disagree with the manifest, in words; None if its
        format, global step, index and count (where recorded) and checksum kind agree (a
        shard that records its count, as every shard with checksums does, must name one)."""
        fmt = attrs.get("format")
        if fmt != FORMAT:
            return "it has no format attribute" if fmt is None else f"its format is {fmt!r}"
        want = {"global_step": self.step, "shard": k, SHARDS: self.num_shards}
        for key, words in SHARD_NUMBERS.items():
            if key == SHARDS and key not in attrs:
                continue
            if key not in attrs:
                return f"it has no {key} attribute"
            if integer(attrs[key]) != want[key]:
                return (
                    f"its {words} is {_shown(attrs[key])}, not {want[key]} (a shard of "
                    f"another checkpoint, copied or renamed?)"
                )
        kind = attrs.get(CHECKSUM)
        if kind is None and SHARDS in attrs:  # (written together: one without the other
            return "it has no checksum attribute"  # would be read unchecked)
        if kind not in (None, CRC32):
            return f"its checksum is {kind!r}, not {CRC32!r}"
        return None

    def _no_crc(self, w: _Wanted, shard: int) -> Callable[[str], CheckpointError]:
        """The error for a dataset of ``w`` whose checksum is absent or not a crc32."""
        name = self.shard_path(shard).name

        def no_crc(dataset: str) -> CheckpointError:
            return CheckpointError(
                f"checkpoint {self.path}: shard {name} records crc32 checksums, but its "
                f"dataset {dataset} ({_kind(w.is_slot)} '{w.name}') carries none (or one "
                f"that is no crc32): damaged; this checkpoint cannot be read"
            )

        return no_crc

    def _verify(self, w: _Wanted, shard: int, expected: int | None, got: int) -> None:
        """CheckpointError naming the shard and ``w`` if the crc32 of the bytes read
        (``got``) is not the one written (None: the shard records none)."""
        if expected is not None and got != expected:
            raise CheckpointError(
                f"checkpoint {self.path}: shard {self.shard_path(shard).name} is damaged: "
                f"the values of {_kind(w.is_slot)} '{w.name}' do not match the checksum "
                f"written with them (crc32 {got:08x}, written {expected:08x}); this "
                f"checkpoint cannot be read (an earlier one, or a copy, may be intact)"
            )

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
        rows the part stores, scattered over them (read a chunk at a time; when every row
        is wanted, every stored row is read, and checked against its crc32)."""
        view, chosen = out[into], range(len(part.rows))[held]
        if not len(chosen):
            return
        whole, crc = len(chosen) == len(part.rows), 0
        if part.on_step is not None:
            self._from_base(w, shard, part, held, view)
        elif part.constant is not None:
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
                crc = crc32(rows, crc) if whole else crc
                self.stored_bytes += rows.nbytes + index[lo:hi].nbytes
                view[(index[lo:hi][take] - chosen.start) // chosen.step] = rows[take]
        if part.on_step is None:
            self.regenerated_bytes += view.nbytes - int(mine.sum()) * view[:1].nbytes
        if whole:
            self._verify(w, shard, part.crc, crc)

    def _from_base(
        self, w: _Wanted, shard: int, part: SparsePart, held: slice, view: np.ndarray
    ) -> None:
        """Rows ``held`` of an increment's ``part`` as the checkpoint it overlays holds them,
        read into ``view`` (the rows the increment does not store: theirs). That checkpoint
        was written on the same layout (a writer overlays its own last shard): one part of
        it holds these rows, so a chain reads one part a level, into the same array."""
        step, name = part.on_step, self.shard_path(shard).name
        assert step is not None
        if step not in self.bases:
            raise CheckpointError(
                f"checkpoint {self.path}: shard {name} holds '{w.name}' as the rows changed "
                f"since global_step {step}, a checkpoint its manifest does not name: damaged"
            )
        base = self._base(step)
        spec = VariableSpec(w.name, w.entry.shape, w.entry.dtype)
        entry = base._entry(spec, w.is_slot)
        full = (0, entry.shape[0] if entry.shape else 1, 1)
        if not any(range(*(p.rows or full)) == part.rows for p in entry.parts):
            raise CheckpointError(
                f"checkpoint {self.path}: shard {name} overlays the checkpoint of global_step "
                f"{step}, written on another layout: damaged; this checkpoint cannot be read"
            )
        rows = part.rows[held]
        target = view if view.flags.c_contiguous else np.empty_like(view)
        base.read(
            [] if w.is_slot else [spec],
            [spec] if w.is_slot else [],
            rows={w.name: (rows.start, rows.stop, rows.step)},
            initial=w.initial,
            into={w.name: target},
        )
        if target is not view:
            view[...] = target
        self.stored_bytes += base.stored_bytes
        self.regenerated_bytes += base.regenerated_bytes

    def _base(self, step: int) -> Checkpoint:
        """The committed checkpoint of ``step`` this one overlays, checked: there, of the
        same run, and not past the chain's length."""
        path = self.directory / manifest_name(step)
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {self.path}: holds only the table rows changed since the "
                f"checkpoint of global_step {step}, and that one is gone ({path.name} is "
                f"missing): this checkpoint cannot be read (a checkpoint is copied with the "
                f"ones it overlays: its manifest's {BASES}, and theirs)"
            )
        if self.depth >= MAX_CHAIN:
            raise CheckpointError(
                f"checkpoint {self.path}: overlays more than {MAX_CHAIN} checkpoints: damaged"
            )
        base = Checkpoint(path)
        base.depth = self.depth + 1
        if self.run is not None and base.run != self.run:
            raise CheckpointError(
                f"checkpoint {self.path}: overlays {path.name}, written by another run "
                f"({base.run}): this checkpoint cannot be read"
            )
        return base

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
            shard = self._open_shard(part.shard)
            with shard.file as f, h5py_errors(self._damaged(part.shard)):
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
class _Shard:
    """An open shard, checked to be its checkpoint's; ``checksummed``: its datasets carry
    crc32s (a shard written before checksums carries none)."""

    file: h5py.File
    checksummed: bool


@dataclass(frozen=True)
class _Dense:
    """A part stored whole, as a dataset checked against the manifest, and the crc32 it
    was written with (None: its shard records none)."""

    dataset: h5py.Dataset
    crc: int | None


def _held_mismatch(obj: object, shape: tuple[int, ...], dtype: np.dtype[Any]) -> str | None:
    """How ``obj`` (what a shard holds at a part's path) is not a ``dtype`` dataset of
    ``shape``, in words with ``{name}`` for the variable's; None if it is."""
    if obj is None:
        return "holds no '{name}'"
    if not isinstance(obj, h5py.Dataset):
        return "holds '{name}' as a group, not an array"
    if obj.shape != shape or obj.dtype != dtype:
        return f"holds '{{name}}' as {obj.dtype}{list(obj.shape)}"
    return None


def _crc_after(block: np.ndarray, before: Future[int] | None) -> int:
    """The crc32 of the rows before ``block`` (done: one thread takes the blocks in order)
    continued over ``block``."""
    return crc32(block, before.result() if before is not None else 0)


def _is_all(positions: slice, length: int) -> bool:
    """Whether ``positions`` (from _overlap) are every row of ``range(length)``."""
    return len(range(length)[positions]) == length


def _shown(value: Any) -> str:
    """An attribute's value in a message: an integer as a number, anything else as repr."""
    number = integer(value)
    return repr(value) if number is None else str(number)


def _kind(is_slot: bool) -> str:
    return "optimizer slot" if is_slot else "variable"


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

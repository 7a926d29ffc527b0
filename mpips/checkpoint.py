"""HDF5 checkpoints keyed by variable name, with global_step.

``ckpt-<step>.h5`` files are written under a temporary name, fsynced, then renamed into
place: a crash at any moment leaves every earlier checkpoint intact and loadable. Old ones
are pruned only after the new one is committed. Loading reads arrays only (no pickle).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from .errors import CheckpointError
from .placement import VariableSpec

_NAME = re.compile(r"^ckpt-(\d+)\.h5$")
_TEMPORARY = re.compile(r"^\.ckpt-\d+\.h5\.tmp-(\d+)$")
FORMAT = "mpips-checkpoint-1"


def list_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """Committed checkpoints in ``directory`` as (global_step, path), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), d / p.name) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def _h5_path(name: str, slot: bool) -> str:
    """Variables live at ``variables/<name>``, slot ``<var>/<slot>`` at ``slots/<slot>/<var>``."""
    if not slot:
        return f"variables/{name}"
    var, slot_name = name.rsplit("/", 1)
    return f"slots/{slot_name}/{var}"


def save(directory: str | Path, step: int, values: dict[str, np.ndarray],
         max_to_keep: int = 3, meta: dict[str, Any] | None = None,
         slots: dict[str, np.ndarray] | None = None) -> Path:
    """Commit ``ckpt-<step>.h5`` atomically, then prune to the newest ``max_to_keep``.

    ``slots`` maps ``<variable>/<slot>`` to optimizer state arrays.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(d)
    final = d / f"ckpt-{step}.h5"
    tmp = d / f".ckpt-{step}.h5.tmp-{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["global_step"] = step
            for k, v in (meta or {}).items():
                f.attrs[k] = v
            for name, value in values.items():
                f.create_dataset(_h5_path(name, False), data=value)
            for name, value in (slots or {}).items():
                f.create_dataset(_h5_path(name, True), data=value)
            f.flush()
            os.fsync(f.id.get_vfd_handle())
        os.replace(tmp, final)
        dir_fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)
    for _, old in list_checkpoints(d)[:-max_to_keep]:
        old.unlink(missing_ok=True)
    return final


def _writer_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a killed, unreaped zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _remove_stale_temporaries(d: Path) -> None:
    """Delete half-written files left by a writer that was killed."""
    for p in d.iterdir():
        m = _TEMPORARY.match(p.name)
        if m and not _writer_alive(int(m.group(1))):
            p.unlink(missing_ok=True)


def restore(path: str | Path, specs: list[VariableSpec], slot_specs: list[VariableSpec] = ()
            ) -> tuple[int, dict[str, np.ndarray], list[int] | None]:
    """Load (global_step, values, worker clocks) for exactly ``specs`` and ``slot_specs``.

    Any mismatch names the variable; ``clocks`` (each worker's updates, i.e. its data
    position) is None when the checkpoint has none.
    """
    out = {}
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"checkpoint {path}: not an mpips checkpoint")
            step = int(f.attrs["global_step"])
            clocks = [int(c) for c in f.attrs["clocks"]] if "clocks" in f.attrs else None
            for spec, slot in [(s, False) for s in specs] + [(s, True) for s in slot_specs]:
                ds = f.get(_h5_path(spec.name, slot))  # one lookup per name
                if ds is None:
                    raise CheckpointError(
                        f"checkpoint {path}: has no variable '{spec.name}' (written for another "
                        f"model or optimizer? start afresh with --no-restore or another --ckpt-dir)")
                if not isinstance(ds, h5py.Dataset):
                    raise CheckpointError(f"checkpoint {path}: '{spec.name}' is not an array")
                if tuple(ds.shape) != spec.shape or ds.dtype != np.dtype(spec.dtype):
                    raise CheckpointError(
                        f"checkpoint {path}: variable '{spec.name}' is {ds.dtype}{list(ds.shape)}"
                        f", the model expects {spec.dtype}{list(spec.shape)}")
                array = np.empty(spec.shape, spec.dtype)
                if array.size:
                    ds.read_direct(array)
                out[spec.name] = array
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: corrupt or unreadable ({e})") from None
    return step, out, clocks


def resolve(path: str | Path) -> Path:
    """A checkpoint file, or the latest committed one in a directory."""
    p = Path(path)
    if p.is_dir():
        latest = latest_checkpoint(p)
        if latest is None:
            raise CheckpointError(f"{p}: no checkpoint (ckpt-<step>.h5) in this directory")
        return latest
    if not p.exists():
        raise CheckpointError(f"{p}: not found")
    return p


def read_all(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray],
                                        dict[str, np.ndarray]]:
    """(attributes, variables, slots ``<variable>/<slot>``) of a checkpoint file, arrays only."""
    variables: dict[str, np.ndarray] = {}
    slots: dict[str, np.ndarray] = {}
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"checkpoint {path}: not an mpips checkpoint")
            attrs = {k: (v.tolist() if isinstance(v, np.ndarray) else v)
                     for k, v in f.attrs.items()}

            def visit(group: str, out: dict[str, np.ndarray], name_of) -> None:
                if group in f:
                    f[group].visititems(lambda n, d: out.__setitem__(name_of(n), d[()])
                                        if isinstance(d, h5py.Dataset) else None)

            visit("variables", variables, lambda n: n)
            visit("slots", slots, lambda n: "{1}/{0}".format(*n.split("/", 1)))
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path}: corrupt or unreadable ({e})") from None
    return attrs, variables, slots


def export(path: str | Path, out: str | Path, with_slots: bool = False) -> Path:
    """Write the full variables (and, optionally, slots) of a checkpoint to one plain HDF5
    file: one dataset per variable at its name, global_step as an attribute; atomically."""
    attrs, variables, slots = read_all(path)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["global_step"] = attrs["global_step"]
            f.attrs["source"] = str(path)
            for name, value in variables.items():
                f.create_dataset(name, data=value)
            for name, value in (slots if with_slots else {}).items():
                var, slot = name.rsplit("/", 1)
                f.create_dataset(f"slots/{slot}/{var}", data=value)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out

"""A checkpoint as a PyTorch state_dict file: ``module.load_state_dict(torch.load(path))``."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import Checkpoint
from ..checkpoint.dynamic import IDS
from ..errors import CheckpointError
from ..models.initial import InitialValues
from ..process.files import atomic_write
from .model import plain_name

SUFFIXES = (".pt", ".pth")


def export_state_dict(
    ckpt: Checkpoint,
    out: str | Path,
    initial: InitialValues | None,
    replace: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write the checkpoint's variables (tables whole) as a state_dict of CPU tensors keyed
    by the module's own names (a ``torch.compile``d module's too: no ``_orig_mod.``
    prefix, so it loads into the plain module), atomically; ``torch.load`` reads it with
    its default ``weights_only=True`` (tensors only: nothing is unpickled that could run
    code). ``replace``: values written instead of the checkpoint's, by name (statistics
    recomputed for the export)."""
    variables, _ = ckpt.read_all(initial)
    values: dict[str, np.ndarray] = {}
    for held, value in variables.items():
        name = plain_name(held)
        if name in values:
            raise CheckpointError(
                f"{ckpt.path}: {held!r} and {name!r} both hold values (with and without "
                f"torch.compile's '_orig_mod.' prefix); export to .h5 instead"
            )
        values[name] = value
    values.update(replace or {})
    ids = {n.removesuffix(IDS): values.pop(n) for n in list(values) if n.endswith(IDS)}
    if ids:  # dynamic tables: row i of a weight is the row of id ids[i]
        write_tensors(ids_path(Path(out)), ids)
    return write_tensors(Path(out), values)


def ids_path(out: Path) -> Path:
    """Where an export of dynamic tables puts their ids, beside the state_dict: by the
    weight's name, the id of each of its rows (``model.pt`` -> ``model.ids.pt``)."""
    return out.with_suffix(".ids" + out.suffix)


def write_tensors(out: Path, values: dict[str, np.ndarray]) -> Path:
    """``values`` as a dict of CPU tensors that ``torch.load`` reads, atomically."""
    state = OrderedDict(
        (name, torch.from_numpy(np.ascontiguousarray(value))) for name, value in values.items()
    )
    return atomic_write(out, lambda tmp: torch.save(state, tmp), "nothing exported")

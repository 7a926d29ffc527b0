"""Exporting a checkpoint: its full variables (and slots) in one plain HDF5 file."""

from __future__ import annotations

from pathlib import Path

import h5py

from ..data.hdf5 import fixed_text
from ..models.initial import InitialValues
from ..process.files import atomic_write
from .format import h5_path
from .reading import Checkpoint


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
            f.attrs["source"] = fixed_text(str(ckpt.path))
            for name, value in variables.items():
                f.create_dataset(name, data=value)
            for name, value in (slots if with_slots else {}).items():
                f.create_dataset(h5_path(name, True), data=value)

    return atomic_write(out, write, "nothing exported")

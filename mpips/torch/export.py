"""A checkpoint as a PyTorch state_dict file: ``module.load_state_dict(torch.load(path))``."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import Checkpoint
from ..models.initial import InitialValues
from ..process.files import atomic_write

SUFFIXES = (".pt", ".pth")


def export_state_dict(ckpt: Checkpoint, out: str | Path, initial: InitialValues | None) -> Path:
    """Write the checkpoint's variables (tables whole) as a state_dict of CPU tensors keyed
    by the module's own names, atomically; ``torch.load`` reads it with its default
    ``weights_only=True`` (tensors only: nothing is unpickled that could run code)."""
    variables, _ = ckpt.read_all(initial)
    state = OrderedDict(
        (name, torch.from_numpy(np.ascontiguousarray(value))) for name, value in variables.items()
    )
    return atomic_write(Path(out), lambda tmp: torch.save(state, tmp), "nothing exported")

"""Variables as a model declares them: a name, a shape and a dtype (the public
``mpips.Variable``). Where one lives on the PS tasks is placement's business, not the model's."""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np


@dataclass(frozen=True)
class VariableSpec:
    """A named, shaped, typed parameter, as the model creates it."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * np.dtype(self.dtype).itemsize

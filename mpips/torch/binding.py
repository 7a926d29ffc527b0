"""Parameters and gradients of a torch module that alias mpips's own buffers.

A pull lands in the module: each trainable parameter's ``.data`` is a ``torch.from_numpy``
view of the array mpips hands the model (the worker's pull buffer, the PS memory itself with
zero copy, or a sync replica's bucket). Backward lands in the push: each ``.grad`` is a view
of the gradient buffer mpips pushes from, zeroed before backward, into which autograd
accumulates in place (it adds to a ``.grad`` that exists instead of making a new tensor). So
a step copies no parameter or gradient; it only rebinds a view when mpips hands over another
array (an evaluation's copy, a table's rows of the step).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError


def numpy_dtype(p: torch.Tensor, name: str) -> str:
    """The numpy dtype name of a parameter (float16/32/64: what mpips sums and updates)."""
    names = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16"}
    if p.dtype not in names:
        raise ConfigError(
            f"mpips.torch.Model: parameter {name!r} is {p.dtype}; mpips trains float16, "
            f"float32 and float64 parameters (freeze it with requires_grad_(False), or "
            f"convert the module, e.g. module.float())"
        )
    return names[p.dtype]


def as_tensor(a: Any) -> torch.Tensor:
    """A tensor sharing ``a``'s memory: a numpy array (read-only ones too: a memory-mapped
    input is never written), or a cupy array through DLPack (a GPU worker's)."""
    if isinstance(a, torch.Tensor):
        return a
    if isinstance(a, np.ndarray):
        if a.flags.writeable:
            return torch.from_numpy(a)
        with warnings.catch_warnings():  # "not writable": mpips never writes through it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(a)
    if hasattr(a, "__dlpack__"):
        return torch.from_dlpack(a)
    return torch.as_tensor(a)


def same_memory(t: torch.Tensor, a: Any) -> bool:
    """Whether tensor ``t`` is a view of all of array ``a`` (same start and shape), for the
    arrays whose address is known here (numpy's, cupy's); False for others."""
    if isinstance(a, np.ndarray):
        start = a.__array_interface__["data"][0]
    elif hasattr(a, "data") and hasattr(a.data, "ptr"):  # cupy
        start = int(a.data.ptr)
    else:
        return False
    return t.data_ptr() == start and tuple(t.shape) == tuple(a.shape)


class Views:
    """Tensors viewing arrays mpips hands over, by name: made anew only when the array is
    another one (not the same object, nor the same memory), and counted."""

    def __init__(self) -> None:
        self.arrays: dict[str, Any] = {}

    def of(self, name: str, a: Any, current: torch.Tensor | None) -> torch.Tensor | None:
        """A new view of ``a`` if ``current`` is not one already (else None)."""
        if current is not None and (self.arrays.get(name) is a or same_memory(current, a)):
            return None
        self.arrays[name] = a
        return as_tensor(a)


@dataclass
class Traffic:
    """What binding cost in a step: views made (cheap, no bytes move), bytes copied (none on
    the CPU path: a test pins that), gradient bytes zeroed before backward."""

    views: int = 0
    copied_bytes: int = 0
    zeroed_bytes: int = 0

    def reset(self) -> None:
        self.views = self.copied_bytes = self.zeroed_bytes = 0


class Binding:
    """The module's trainable parameters, by mpips variable name, bound to mpips's arrays."""

    def __init__(self, params: dict[str, torch.nn.Parameter], traffic: Traffic):
        self.params, self.traffic = params, traffic
        self.fired: set[str] = set()  # gradients accumulated in this backward
        self.ready: Callable[..., None] | None = None  # mpips's ready(name), in a backward
        self._values, self._grads = Views(), Views()
        self._bound: dict[str, torch.Tensor] = {}  # each .grad as bound before backward
        for name, p in params.items():
            p.register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def accumulated(_: torch.Tensor) -> None:
            # called once per backward, after every contribution to this parameter is in
            # its .grad: the gradient is final and no later node reads the parameter
            self.fired.add(name)
            if self.ready is not None:
                self.ready(name)

        return accumulated

    def values(self, arrays: dict[str, Any]) -> None:
        """Each parameter's data a view of ``arrays[name]`` (rebinding only what changed)."""
        for name, p in self.params.items():
            t = self._values.of(name, arrays[name], p.data)
            if t is not None:
                p.data = t
                self.traffic.views += 1

    def gradients(self, arrays: dict[str, Any]) -> None:
        """Each parameter's .grad a zeroed view of ``arrays[name]``: backward adds into it."""
        for name, p in self.params.items():
            t = self._grads.of(name, arrays[name], p.grad)
            if t is not None:
                p.grad = t
                self.traffic.views += 1
            g = p.grad
            assert g is not None
            self._bound[name] = g
            g.zero_()
            self.traffic.zeroed_bytes += g.nbytes
        self.fired.clear()

    def collect(self) -> None:
        """A .grad that torch replaced with a tensor of its own (it does not when one
        exists: it accumulates in place) is copied into the push buffer, and counted."""
        for name, p in self.params.items():
            g = p.grad
            if g is not None and g is not self._bound[name]:
                self._bound[name].copy_(g)
                self.traffic.copied_bytes += g.nbytes
                p.grad = None

    def unbind_gradients(self) -> None:
        """Drop the gradient views (an evaluation's forward must not hold the push buffers)."""
        for p in self.params.values():
            p.grad = None

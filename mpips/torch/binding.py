"""Parameters and gradients of a torch module that alias mpips's own buffers.

A pull lands in the module: each trainable parameter's ``.data`` is a ``torch.from_numpy``
view of the array mpips hands the model (the worker's pull buffer, the PS memory itself with
zero copy, or a sync replica's bucket). Backward lands in the push: as autograd hands over a
parameter's gradient (a tensor hook, every contribution summed), it is written into the
gradient buffer mpips pushes from, and autograd takes a view of that buffer as the ``.grad``
(it is None until then). So no parameter is copied, and each gradient is written once into
its buffer where autograd made it: the one pass over its bytes that a ``.grad`` bound to the
buffer beforehand cost too (zeroed, then added into), which made the reference MLP's step
~4% slower (issue 50; docs/performance.md). A step rebinds a view only when mpips hands over
another array (an evaluation's copy, a table's rows of the step); a parameter whose gradient
never arrives pushes zeros.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.hooks import RemovableHandle

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


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def same_memory(t: torch.Tensor, a: Any) -> bool:
    """Whether tensor ``t`` is a view of all of array ``a`` (same start and shape), for the
    arrays whose address is known here (numpy's, cupy's); False for others."""
    if isinstance(a, np.ndarray):
        start = _address(a)
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


class RowViews:
    """Tensors viewing a table's rows in the buffers mpips keeps them in from step to step,
    by name, made anew only when the rows are in another buffer. A step's rows are the
    first ``n`` of such a buffer (``n`` changes every step), so the tensor views every row
    the buffer holds: the module's table is bound once per buffer, not once a step, and
    indexes only its first ``n`` rows (the batch's ids)."""

    def __init__(self) -> None:
        self.bound: dict[str, tuple[Any, int, torch.Tensor]] = {}  # (buffer, address, view)

    def of(self, name: str, a: Any, before: int = 0) -> torch.Tensor | None:
        """A tensor whose rows from ``before`` on are ``a``'s memory and the rest of its
        buffer (row 0 is ``before`` rows ahead of ``a``); None where ``a``'s buffer is not
        a numpy array that holds them (a GPU's array, a copy)."""
        base = getattr(a, "base", None)
        if not isinstance(base, np.ndarray) or not isinstance(a, np.ndarray) or a.ndim < 1:
            return None
        row = a.strides[0]  # (C-contiguous rows: _to_buffer_end checks)
        at = _address(a) - before * row
        kept = self.bound.get(name)
        if kept is not None and kept[0] is base and kept[1] == at:
            return kept[2]
        view = _to_buffer_end(a, base, at, row)
        if view is not None:
            self.bound[name] = (base, at, view)
        return view


def _to_buffer_end(a: np.ndarray, base: np.ndarray, at: int, row: int) -> torch.Tensor | None:
    """The rows of ``a``'s shape from address ``at`` to the end of ``base`` (contiguous, and
    holding ``a``), as a tensor; None where that is not so."""
    whole_row = a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
    if not a.flags.c_contiguous or not base.flags.c_contiguous or row != whole_row or not row:
        return None
    start = at - _address(base)
    if start < 0 or at + a.nbytes > _address(base) + base.nbytes:
        return None
    rows = (base.nbytes - start) // row
    flat = base.reshape(-1).view(np.uint8)[start : start + rows * row]
    return as_tensor(flat.view(a.dtype).reshape(rows, *a.shape[1:]))


def cut_to_both(
    cut: dict[str, tuple[torch.Tensor, ...]], name: str, data: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and its .grad (RowViews of two buffers, whose ends differ) cut to the rows
    both hold (a .grad has its weight's shape); kept in ``cut`` while the views are."""
    kept = cut.get(name)
    if kept is None or kept[0] is not data or kept[1] is not grad:
        m = min(data.shape[0], grad.shape[0])
        kept = cut[name] = (data, grad, data[:m], grad[:m])
    return kept[2], kept[3]


@dataclass
class Traffic:
    """What binding cost in a step: views made (cheap, no bytes move), bytes copied beyond
    the landing (none on the CPU path: a test pins that), gradient bytes landed (written
    into the push buffers as autograd hands them over: each gradient's bytes once), bytes
    zeroed (the buffers of parameters the loss did not use)."""

    views: int = 0
    copied_bytes: int = 0
    landed_bytes: int = 0
    zeroed_bytes: int = 0

    def reset(self) -> None:
        self.views = self.copied_bytes = self.landed_bytes = self.zeroed_bytes = 0


class Binding:
    """The module's trainable parameters, by mpips variable name, bound to mpips's arrays."""

    def __init__(self, params: dict[str, torch.nn.Parameter], traffic: Traffic):
        self.params, self.traffic = params, traffic
        self.fired: set[str] = set()  # gradients that arrived in this backward
        self._ready: Callable[..., None] | None = None  # mpips's ready(name), in a backward
        self._saying: list[RemovableHandle] = []  # post-accumulate hooks, once ready is given
        self._values, self._grads = Views(), Views()
        self._bound: dict[str, torch.Tensor] = {}  # each push buffer, viewed as a tensor
        for name, p in params.items():
            p.register_hook(self._arriving(name))

    def _arriving(self, name: str) -> Callable[[torch.Tensor], torch.Tensor | None]:
        def arriving(grad: torch.Tensor) -> torch.Tensor | None:
            # autograd's gradient of this parameter, before AccumulateGrad: written into
            # the push buffer, and a new view of the buffer handed on in its place, which
            # AccumulateGrad takes as .grad (None: gradients()) without adding anything. A
            # second arrival in a backward (a reentrant checkpoint's) autograd adds into
            # that .grad; none comes before the first step binds the buffers
            b = self._bound.get(name)
            if name in self.fired or b is None:
                self.fired.add(name)
                return None
            self.fired.add(name)
            if grad.layout == torch.strided:
                b.copy_(grad)
            else:  # (a sparse gradient of a dense parameter)
                b.zero_().add_(grad)
            self.traffic.landed_bytes += b.nbytes
            return b.view_as(b)

        return arriving

    def _saying_ready(self, name: str) -> Callable[[torch.Tensor], None]:
        def accumulated(_: torch.Tensor) -> None:
            # called once per backward, after every contribution to this parameter is in
            # its .grad: the gradient is final and no later node reads the parameter
            if self._ready is not None:
                self._ready(name)

        return accumulated

    @property
    def ready(self) -> Callable[..., None] | None:
        """mpips's ``ready(name)`` during a backward (sync mode's), else None."""
        return self._ready

    @ready.setter
    def ready(self, ready: Callable[..., None] | None) -> None:
        # the post-accumulate hooks are registered the first time there is a ready to call:
        # a mode that never passes one (async) makes no Python call per gradient for it
        self._ready = ready
        if ready is not None and not self._saying:
            self._saying = [
                p.register_post_accumulate_grad_hook(self._saying_ready(name))
                for name, p in self.params.items()
            ]

    def values(self, arrays: dict[str, Any]) -> None:
        """Each parameter's data a view of ``arrays[name]`` (rebinding only what changed)."""
        for name, p in self.params.items():
            t = self._values.of(name, arrays[name], p.data)
            if t is not None:
                p.data = t
                self.traffic.views += 1

    def gradients(self, arrays: dict[str, Any]) -> None:
        """Each parameter's push buffer a view of ``arrays[name]``, its .grad None until
        its gradient arrives (``_arriving``: then a view of the buffer)."""
        for name, p in self.params.items():
            t = self._grads.of(name, arrays[name], self._bound.get(name))
            if t is not None:
                self._bound[name] = t
                self.traffic.views += 1
            p.grad = None
        self.fired.clear()

    def collect(self) -> None:
        """A .grad that is not the push buffer (a tensor of the user's that autograd added
        into) is copied into it, and counted; the buffer of a parameter whose gradient never
        arrived is zeroed."""
        everyone = len(self.fired) == len(self.params)
        for name, p in self.params.items():
            g, bound = p.grad, self._bound[name]
            if g is not None and g.data_ptr() != bound.data_ptr():
                bound.copy_(g)
                self.traffic.copied_bytes += g.nbytes
                p.grad = None
            elif not everyone and name not in self.fired:
                bound.zero_()
                self.traffic.zeroed_bytes += bound.nbytes

    def unbind_gradients(self) -> None:
        """Drop the gradient views (an evaluation's forward must not hold the push buffers)."""
        for p in self.params.values():
            p.grad = None

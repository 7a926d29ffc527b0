"""A strict stand-in for cupy on machines without a GPU: GPU code paths run (and fail) in CI.

Its device arrays are a type of their own whose values happen to live in host memory. Like
cupy's, they refuse numpy's company: any operation that mixes a device array with a numpy
array raises TypeError, as does an implicit conversion to numpy (``np.asarray``, a numpy
ufunc). Values cross only explicitly, through ``asarray``/``array`` of a host array,
``ndarray.set`` (host to device) and ``ndarray.get``/``asnumpy`` (device to host), and each
crossing is counted in ``traffic`` so tests can assert "one copy in, one copy out". A copy
to the host that does not block lands, as on a stream, only when the host next waits for
the device (counted too): until then its destination holds NaN.
Reductions give 0-d device arrays, as cupy's do. It is stricter than cupy in one place: a
numpy array as an index raises here (cupy converts it), so index arrays must be moved first.

``MPIPS_GPU_STANDIN=1`` makes ``train.device = "gpu"`` compute on this module instead of
cupy (see mpips.device.backend.get_xp): a user model, or mpips itself, is checked for host/device
mix-ups without a GPU. It is slow (every operation is wrapped) and is not a GPU.
"""

from __future__ import annotations

import operator
import os as _os
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as _np

ENV = "MPIPS_GPU_STANDIN"


@dataclass
class Traffic:
    """Host/device crossings since the last reset: copies and bytes each way."""

    h2d_copies: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    allocations: int = 0  # device buffers made on purpose (empty, zeros, ..., asarray)
    h2d_pageable: int = 0  # of the bytes copied in, those from host memory not page-locked
    d2h_pageable: int = 0  # of the bytes copied out, those into host memory not page-locked
    # the host waited for the device's queue to drain: a synchronize, or a device value
    # read as a Python scalar (float(loss)); on a GPU each one stalls the launch pipeline
    waits: int = 0
    # operations that would each be a kernel launch on cupy (its host time, ~10-65 us, is
    # what a GPU step is made of), by name: arithmetic, functions that compute, gathers,
    # assignments and filled allocations; not views (reshape, T, slices), copies between
    # host and device, nor ``empty``
    launches: Counter[str] = field(default_factory=Counter)

    def reset(self) -> None:
        self.h2d_copies = self.h2d_bytes = self.d2h_copies = self.d2h_bytes = 0
        self.allocations = self.h2d_pageable = self.d2h_pageable = self.waits = 0
        self.launches.clear()

    def to_device(self, host: _np.ndarray, new: bool) -> None:
        """A host-to-device copy: into a ``new`` device array, or into an existing one."""
        _check_range(host)
        self.h2d_copies += 1
        self.h2d_bytes += host.nbytes
        self.allocations += new
        self.h2d_pageable += 0 if _pinned(host) else host.nbytes

    def to_host(self, host: _np.ndarray) -> None:
        _check_range(host)
        self.d2h_copies += 1
        self.d2h_bytes += host.nbytes
        self.d2h_pageable += 0 if _pinned(host) else host.nbytes


traffic = Traffic()
# copies to the host queued (get without blocking): their destination and values, written
# when the host next waits for the device
_queued: list[tuple[_np.ndarray, _np.ndarray]] = []


def _wait() -> None:
    """The host waits for the device: counted, and the queued copies land."""
    traffic.waits += 1
    for out, values in _queued:
        out[...] = values
    _queued.clear()


_locked: dict[int, int] = {}  # page-locked host ranges: address -> bytes
_PAGE = _os.sysconf("SC_PAGE_SIZE") if hasattr(_os, "sysconf") else 4096  # (as backend.PAGE)


def _pinned(host: _np.ndarray) -> bool:
    """Whether ``host``'s memory lies in a range registered with cuda.runtime.hostRegister."""
    at = host.__array_interface__["data"][0]
    return any(start <= at and at + host.nbytes <= start + n for start, n in _locked.items())


def _check_range(host: _np.ndarray) -> None:
    """Refuse a copy from or to host memory that begins in a page-locked range and runs past
    its end, as CUDA does (cudaErrorInvalidValue): the driver takes the whole copy for
    pinned from where it begins. cupy's asarray copies straight from any array that begins
    in a locked range, so a locked page that also holds others' heap memory fails this way
    for them (seen on an H100: an epoch's batch order, made next to a locked buffer)."""
    at = host.__array_interface__["data"][0]
    for start, n in _locked.items():
        if start <= at < start + n < at + host.nbytes:
            raise RuntimeError(
                f"cudaErrorInvalidValue: invalid argument (a copy of {host.nbytes} bytes "
                f"that begins in a page-locked range and runs {at + host.nbytes - start - n} "
                "bytes past it)"
            )


class _Runtime:
    """cupy.cuda.runtime's page-locking of host memory (recorded: copies from and to it
    count as pinned), as CUDA does it, by whole pages: a range that shares a page with one
    registered already is refused; and one device."""

    @staticmethod
    def hostRegister(ptr: int, size: int, flags: int) -> None:  # noqa: N802 (CUDA's name)
        page = _PAGE
        lo, hi = ptr // page * page, -(-(ptr + size) // page) * page
        for start, n in _locked.items():
            if lo < -(-(start + n) // page) * page and start // page * page < hi:
                raise RuntimeError(
                    "cudaErrorHostMemoryAlreadyRegistered: part or all of the requested "
                    "memory range is already mapped"
                )
        _locked[ptr] = size

    @staticmethod
    def hostUnregister(ptr: int) -> None:  # noqa: N802
        if _locked.pop(ptr, None) is None:
            raise RuntimeError("cudaErrorHostMemoryNotRegistered")

    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802
        return 1

    @staticmethod
    def memGetInfo() -> tuple[int, int]:  # noqa: N802
        """(free, total) bytes of the device: the stand-in's is host memory."""
        from ..process.memory import available_bytes

        free = available_bytes()
        return free, free

    @staticmethod
    def deviceSynchronize() -> None:  # noqa: N802
        _wait()  # (the stand-in's work is done when a call returns, but queued copies)


class cuda:  # noqa: N801 (cupy.cuda)
    runtime = _Runtime


def _refuse(value: Any) -> TypeError:
    return TypeError(
        f"Unsupported type {type(value)} (the mpips GPU stand-in, like cupy, does not mix "
        f"host (numpy) and device arrays: move it with xp.asarray first)"
    )


def _unwrap(value: Any) -> Any:
    """The numpy array behind a device array; a host array raises as cupy would."""
    if isinstance(value, ndarray):
        return value._a
    if isinstance(value, _np.ndarray):
        raise _refuse(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    return value


def _wrap(value: Any) -> Any:
    """numpy results as device arrays (numpy scalars as 0-d arrays, as cupy's reductions)."""
    if isinstance(value, _np.ndarray):
        return ndarray(value)
    if isinstance(value, _np.generic):
        return ndarray(_np.asarray(value))
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


# functions and methods that make a view or read metadata (no launch on cupy; a reshape or
# ravel that must copy counts as one)
VIEWS = {
    "reshape",
    "ravel",
    "view",
    "transpose",
    "swapaxes",
    "squeeze",
    "expand_dims",
    "broadcast_to",
    "sliding_window_view",
    "empty",
    "empty_like",
    "get_array_module",
    "shape",
    "result_type",
    "may_share_memory",
    "shares_memory",
}


def _device_call(fn: Any, name: str) -> Any:
    """``fn`` (a numpy function or method) taking and giving device arrays only."""
    launch = name not in VIEWS

    def call(*args: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        result = fn(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()})
        base = getattr(fn, "__self__", None)
        if launch and not (name == "astype" and result is base):
            traffic.launches[name] += 1  # (astype(copy=False) to its own dtype: no copy)
        elif name in ("reshape", "ravel") and isinstance(base, _np.ndarray):
            if isinstance(result, _np.ndarray) and not _np.may_share_memory(result, base):
                traffic.launches["copy"] += 1  # (of an array that was not contiguous)
        return out if isinstance(out, ndarray) else _wrap(result)

    call.__name__ = call.__qualname__ = name
    return call


class ndarray:  # noqa: N801 (cupy's name)
    """A device array: numpy values behind a wall that only get/set/asarray cross."""

    __slots__ = ("_a",)
    __array_ufunc__ = None  # numpy ufuncs and numpy operands defer to (and fail in) us

    def __init__(self, values: _np.ndarray):
        self._a = values

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    T = property(lambda self: ndarray(self._a.T))

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to "
            "construct a NumPy array explicitly. (the mpips GPU stand-in, as cupy)"
        )

    def get(
        self, stream: Any = None, order: str = "C", out: Any = None, blocking: bool = True
    ) -> _np.ndarray:
        """The values in host memory (into ``out``, a numpy array, when given). ``blocking``
        (cupy's default) waits for the device's queue, as cupy does: a wait. Not blocking
        (into ``out`` only), the copy is queued as on a stream: ``out`` holds garbage (NaN)
        until the host next waits for the device, so code that reads it sooner fails."""
        if not blocking and out is not None:
            self._check_out(out)
            traffic.to_host(out)
            _queued.append((out, self._a.copy()))
            if out.dtype.kind in "fc":
                out[...] = _np.nan
            elif out.dtype.kind in "iu":
                out[...] = _np.iinfo(out.dtype).max
            return out
        _wait()
        if out is None:
            out = self._a.copy()
            traffic.to_host(out)
            return out
        self._check_out(out)
        traffic.to_host(out)
        out[...] = self._a
        return out

    def _check_out(self, out: Any) -> None:
        if not isinstance(out, _np.ndarray):
            raise TypeError(f"get(out=...): a numpy array, not {type(out)}")
        if out.shape != self._a.shape or out.dtype != self._a.dtype:
            raise ValueError("get(out=...): a numpy array of the same shape and dtype")
        if not out.flags.c_contiguous:
            raise RuntimeError("get(out=...): a C-contiguous array (cupy copies into no other)")

    def set(self, arr: _np.ndarray, stream: Any = None) -> None:
        """Copy the host array ``arr`` (same shape and dtype) into this device array."""
        if not isinstance(arr, _np.ndarray):
            raise TypeError(f"set(): a numpy array, not {type(arr)}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError(
                f"set(): shape/dtype {arr.shape}/{arr.dtype} != {self._a.shape}/{self._a.dtype}"
            )
        if not self._a.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array (as cupy)")
        traffic.to_device(arr, new=False)
        self._a[...] = arr

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        """This device memory handed to another framework (``torch.from_dlpack``), shared,
        as cupy shares its arrays: no copy and no crossing (the stand-in's device memory is
        host memory, so the tensor is a CPU one)."""
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        return self._a.__dlpack_device__()

    def item(self) -> Any:
        """The one value as a Python scalar: a device-to-host read (the host waits)."""
        _wait()
        return self._a.item()

    def tolist(self) -> Any:
        """The values as Python lists: a device-to-host read (the host waits)."""
        _wait()
        return self._a.tolist()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # (__array_interface__ and the like would let numpy in)
            raise AttributeError(name)
        attr = getattr(self._a, name)
        return _device_call(attr, name) if callable(attr) else _wrap(attr)

    def __getitem__(self, key: Any) -> Any:
        if _gathers(key):
            traffic.launches["gather"] += 1
        for listed in _listed(key):  # cupy copies a list index in first (pageable, a new array)
            traffic.to_device(_np.asarray(listed), new=True)
        return _wrap(self._a[_unwrap(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        traffic.launches["setitem"] += 1  # (a fill or a copy kernel)
        self._a[_unwrap(key)] = _unwrap(value)

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        return (_wrap(row) for row in self._a)

    def __float__(self) -> float:
        _wait()
        return float(self._a)

    def __int__(self) -> int:
        _wait()
        return int(self._a)

    def __bool__(self) -> bool:
        _wait()
        return bool(self._a)

    def __format__(self, spec: str) -> str:
        return format(self._a.item() if self._a.ndim == 0 else self._a, spec)

    def __repr__(self) -> str:
        return f"standin.{self._a!r}"

    __hash__ = None  # type: ignore[assignment]


def _gathers(key: Any) -> bool:
    """An index with a device array or a list in it (a gather kernel), not basic slicing (a
    view)."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (ndarray, list)) for k in keys)


def _listed(key: Any) -> list[list[Any]]:
    """The Python lists in an index: cupy makes each a device array (a copy in) to gather."""
    keys = key if isinstance(key, tuple) else (key,)
    return [k for k in keys if isinstance(k, list)]


def _operand(value: Any) -> Any:
    """An operator's other operand: a device array or a scalar (cupy takes no list)."""
    if isinstance(value, (list, tuple)):
        raise _refuse(value)
    return _unwrap(value)


def _binary(op: Any, reflected: bool = False) -> Any:
    def method(self: ndarray, other: Any) -> Any:
        other = _operand(other)
        traffic.launches[op.__name__] += 1
        return _wrap(op(other, self._a) if reflected else op(self._a, other))

    return method


def _inplace(op: Any) -> Any:
    def method(self: ndarray, other: Any) -> ndarray:
        self._a = op(self._a, _operand(other))
        traffic.launches[op.__name__] += 1
        return self

    return method


for _name in "add sub mul truediv floordiv mod pow matmul and or xor lshift rshift".split():
    _op = getattr(operator, f"{_name}_" if _name in ("and", "or") else _name)
    setattr(ndarray, f"__{_name}__", _binary(_op))
    setattr(ndarray, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(ndarray, f"__i{_name}__", _inplace(getattr(operator, f"i{_name}")))
for _name in "lt le eq ne gt ge".split():
    setattr(ndarray, f"__{_name}__", _binary(getattr(operator, _name)))


def _unary(op: Any) -> Any:
    def method(self: ndarray) -> Any:
        traffic.launches[op.__name__] += 1
        return _wrap(op(self._a))

    return method


for _name in "neg pos abs invert".split():
    setattr(ndarray, f"__{_name}__", _unary(getattr(operator, _name)))


def asarray(a: Any, dtype: Any = None) -> ndarray:
    """A device array of ``a``: copied to the device when ``a`` is on the host."""
    if isinstance(a, ndarray):
        return a if dtype is None or a.dtype == dtype else a.astype(dtype)
    host = _np.asarray(a, dtype=dtype)  # (cupy copies from the host array where it lies)
    traffic.to_device(host, new=True)
    return ndarray(host.copy())


def array(a: Any, dtype: Any = None, copy: bool = True) -> ndarray:
    """A new device array of ``a`` (a copy, from the host or the device)."""
    if isinstance(a, ndarray):
        traffic.launches["copy"] += 1
        return ndarray(_np.array(a._a, dtype=dtype, copy=copy))
    return asarray(a, dtype)


def asnumpy(a: Any, out: Any = None) -> _np.ndarray:
    """The values of a device array in host memory (a host array as it is)."""
    return a.get(out=out) if isinstance(a, ndarray) else _np.asarray(a)


def get_array_module(*args: Any) -> ModuleType:
    """This module when any argument is a device array, else numpy (as cupy's)."""
    import sys

    return sys.modules[__name__] if any(isinstance(a, ndarray) for a in args) else _np


def scatter_add(target: ndarray, index: Any, values: Any) -> None:
    """``target[index] += values`` with repeated indices summed (cupyx.scatter_add)."""
    traffic.launches["scatter_add"] += 1
    _np.add.at(_unwrap(target), _unwrap(index), _unwrap(values))


class _Namespace:
    """A numpy submodule (``lib``, ``linalg``) whose functions take device arrays only."""

    def __init__(self, module: Any):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return _lookup(self._module, name)


ALLOCATING = {
    "empty",
    "zeros",
    "ones",
    "full",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
}


def _lookup(module: Any, name: str) -> Any:
    attr = getattr(module, name)
    if isinstance(attr, type) or not callable(attr):
        return _Namespace(attr) if isinstance(attr, ModuleType) else attr
    call = _device_call(attr, name)
    if module is not _np or name not in ALLOCATING:
        return call

    def allocate(*args: Any, **kwargs: Any) -> Any:
        traffic.allocations += 1
        return call(*args, **kwargs)

    return allocate


def __getattr__(name: str) -> Any:
    """Every other numpy name: types and constants as they are, functions on device arrays
    (a host array given to one raises)."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _lookup(_np, name)

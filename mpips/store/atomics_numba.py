"""The atomics of atomics.py compiled by numba, where libatomic is missing (or
MPIPS_ATOMICS=numba): LLVM's ``cmpxchg`` and ``atomicrmw``, sequentially consistent, emitted
through numba intrinsics. Imported only then: numba's import and the cached functions' load
cost ~0.8 s of CPU a process."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


def _address(context: Any, builder: Any, array_type: Any, array: Any, index: Any) -> Any:
    view = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, view, [index])


@intrinsic
def _cas(typingctx: Any, words: Any, index: Any, expected: Any, new: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        address = _address(context, builder, signature.args[0], args[0], args[1])
        pair = builder.cmpxchg(address, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return types.int64(words, index, expected, new), codegen


def _rmw(op: str) -> Any:
    """An intrinsic ``(words, index, value) -> old`` doing LLVM's ``atomicrmw op``."""

    def typer(typingctx: Any, words: Any, index: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            address = _address(context, builder, signature.args[0], args[0], args[1])
            return builder.atomic_rmw(op, address, args[2], "seq_cst")

        return types.int64(words, index, value), codegen

    return intrinsic(typer)


_swap, _add = _rmw("xchg"), _rmw("add")


def _compiled(function: Callable[..., Any]) -> Any:
    """``function`` compiled, cached on disk where numba finds a writable place."""
    try:
        return njit(cache=True, nogil=True)(function)
    except RuntimeError:  # no writable cache directory: compile in each process
        return njit(nogil=True)(function)


@_compiled
def _compare_and_swap(words, index, expected, new):
    return _cas(words, index, expected, new)


@_compiled
def _exchange(words, index, value):
    return _swap(words, index, value)


@_compiled
def _fetch_add(words, index, value):
    return _add(words, index, value)


@_compiled
def _load(words, start, out):
    for i in range(out.size):
        out[i] = _add(words, start + i, 0)


@_compiled
def _add_then_load(words, index, value, at, out):
    old = _add(words, index, value)
    for i in range(out.size):
        out[i] = _add(words, at[i], 0)
    return old


# the jitted functions, as atomics._Numba calls them (it checks the indices)
compare_and_swap, exchange, fetch_add = _compare_and_swap, _exchange, _fetch_add
load, add_then_load = _load, _add_then_load


def warm() -> None:
    """Compile (or load from numba's cache) every function now."""
    words, out = np.zeros(2, np.int64), np.empty(2, np.int64)
    compare_and_swap(words, 0, 0, 1)
    exchange(words, 0, 0)
    fetch_add(words, 1, 1)
    load(words, 0, out)
    add_then_load(words, 0, 0, np.arange(2, dtype=np.int64), out)

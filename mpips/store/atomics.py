"""Hardware atomics on int64 words in shared memory: the control counters of a job on one
node (control.py) and zero copy's stripe locks (stripes.py).

Why not MPI's atomics: MPICH makes the atomics of a shared-memory window atomic with one
inter-process mutex per window. On an oversubscribed node a process descheduled while
holding that mutex stalls every other atomic of the window for a time slice (an atomic then
costs 20-80 us, and some ms at the tail; docs/performance.md). A CPU's own atomic takes
~0.25 us and holds nothing. The words these functions touch must be touched by nothing else
(MPI's atomics included), and every process using them must share the node.

The instructions are emitted through numba (a dependency already, for the optimizers' fused
kernels): LLVM's ``cmpxchg`` and ``atomicrmw``, sequentially consistent, so taking a lock
word is an acquire and giving it back a release for the stores made under it.
"""

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


def compare_and_swap(words: np.ndarray, index: int, expected: int, new: int) -> int:
    """Atomically: if ``words[index] == expected``, set it to ``new``. Returns the old value
    (``expected`` when the swap happened)."""
    return int(_compare_and_swap(words, index, expected, new))


def exchange(words: np.ndarray, index: int, value: int) -> int:
    """Atomically set ``words[index]`` to ``value``; returns the old value."""
    return int(_exchange(words, index, value))


def fetch_add(words: np.ndarray, index: int, value: int) -> int:
    """Atomically add ``value`` to ``words[index]``; returns the old value."""
    return int(_fetch_add(words, index, value))


def load(words: np.ndarray, start: int, count: int) -> np.ndarray:
    """``words[start:start + count]``, each read atomically (not all at one instant)."""
    out = np.empty(count, np.int64)
    _load(words, start, out)
    return out


def add_then_load(
    words: np.ndarray, index: int, value: int, at: np.ndarray, out: np.ndarray
) -> int:
    """Atomically add ``value`` to ``words[index]``, then read ``words[at]`` into ``out``
    (each word atomically), in one call: a worker's step claim. Returns the old value."""
    return int(_add_then_load(words, index, value, at, out))


def warm() -> None:
    """Compile (or load from numba's cache) every function now, at start-up: not on a first
    call made while holding a lock."""
    words = np.zeros(2, np.int64)
    compare_and_swap(words, 0, 0, 1)
    exchange(words, 0, 0)
    fetch_add(words, 1, 1)
    load(words, 0, 2)
    at = np.arange(2, dtype=np.int64)
    add_then_load(words, 0, 0, at, np.empty(2, np.int64))

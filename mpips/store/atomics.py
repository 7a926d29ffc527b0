"""Hardware atomics on int64 words in shared memory: the control counters of a job on one
node (control.py) and zero copy's stripe locks (stripes.py).

Why not MPI's atomics: MPICH makes the atomics of a shared-memory window atomic with one
inter-process mutex per window. On an oversubscribed node a process descheduled while
holding that mutex stalls every other atomic of the window for a time slice (an atomic then
costs 20-80 us, and some ms at the tail; docs/performance.md). A CPU's own atomic takes
~0.5-0.8 us from Python and holds nothing. The words these functions touch must be touched by
nothing else (MPI's atomics included), and every process using them must share the node.

The instructions come from libatomic, GCC's library for atomics (``libatomic.so.1``,
installed with gcc; ``libatomic1`` on Debian): its ``__atomic_*_8`` entry points, sequentially
consistent, called through ctypes with the GIL held (the call is shorter than giving the GIL
up). Taking a lock word is then an acquire and giving it back a release for the stores made
under it. For 8-byte words these are the CPU's own instructions (``lock cmpxchg``, ``lock
xadd`` on x86-64), no lock of libatomic's own. Without libatomic the same instructions come
from numba (LLVM's ``cmpxchg`` and ``atomicrmw``): numba's import and loading the compiled
functions cost ~0.8 s of CPU a process, most of a small job's start-up, so numba is the
fallback. Processes on either path may share words: both are the CPU's atomics.
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any

import numpy as np

from ..process import settings

SEQ_CST = 5  # __ATOMIC_SEQ_CST
ENV = "MPIPS_ATOMICS"  # "numba": the fallback, even where libatomic is (tests compare both)


class Words:
    """Aligned int64 words (a view of node-shared memory), touched only through these
    methods; an index out of range raises IndexError rather than touch other memory."""

    def __init__(self, array: np.ndarray, backend: str | None = None):
        if array.dtype != np.int64 or array.ndim != 1 or not array.flags.c_contiguous:
            raise ValueError("atomics.Words: a flat C-contiguous int64 array")
        if array.ctypes.data % 8:
            raise ValueError("atomics.Words: the CPU's atomics need 8-byte aligned words")
        self.array, self.size = array, array.size
        self.base = array.ctypes.data
        self._ops = _backend(backend)

    def _check(self, index: int) -> int:
        """``index`` as an int, if it is one of these words (else IndexError)."""
        index = operator.index(index)
        if not 0 <= index < self.size:
            raise IndexError(f"atomics.Words: word {index} of {self.size}")
        return index

    def compare_and_swap(self, index: int, expected: int, new: int) -> int:
        """Atomically: if word ``index`` is ``expected``, set it to ``new``. Returns the old
        value (``expected`` when the swap happened)."""
        return self._ops.compare_and_swap(self, self._check(index), expected, new)

    def exchange(self, index: int, value: int) -> int:
        """Atomically set word ``index`` to ``value``; returns the old value."""
        return self._ops.exchange(self, self._check(index), value)

    def fetch_add(self, index: int, value: int) -> int:
        """Atomically add ``value`` to word ``index``; returns the old value."""
        return self._ops.fetch_add(self, self._check(index), value)

    def load(self, start: int, count: int) -> np.ndarray:
        """Words ``start`` to ``start + count``, each read atomically (not all at one
        instant)."""
        out = np.empty(count, np.int64)
        if count:
            self._check(start + count - 1)
            self._ops.load(self, self._check(start), out)
        return out

    def add_then_load(self, index: int, value: int, at: np.ndarray, out: np.ndarray) -> int:
        """Atomically add ``value`` to word ``index``, then read the words ``at`` into
        ``out`` (each atomically): a worker's step claim. Returns the old value. Everything
        is checked before the add (a call that raises has added nothing)."""
        if at.dtype != np.int64 or at.ndim != 1 or not at.size or out.shape != at.shape:
            raise ValueError("atomics.Words.add_then_load: int64 indices, an out of their size")
        if out.dtype != np.int64:
            raise ValueError("atomics.Words.add_then_load: an int64 out")
        ks = at.tolist()  # (min and max of a few Python ints: faster than numpy's)
        self._check(min(ks)), self._check(max(ks))
        return self._ops.add_then_load(self, self._check(index), value, at, ks, out)


class _LibAtomic:
    """libatomic's entry points, through ctypes (PyDLL: the GIL is kept for the call)."""

    def __init__(self, lib: ctypes.PyDLL):
        i64, ptr, order = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

        def entry(name: str, restype: Any, *args: Any) -> Any:
            f = getattr(lib, name)
            f.restype, f.argtypes = restype, list(args)
            return f

        self._cas = entry(
            "__atomic_compare_exchange_8",
            ctypes.c_bool,
            ptr,
            ctypes.POINTER(i64),
            i64,
            order,
            order,
        )
        self._swap = entry("__atomic_exchange_8", i64, ptr, i64, order)
        self._add = entry("__atomic_fetch_add_8", i64, ptr, i64, order)
        self._load = entry("__atomic_load_8", i64, ptr, order)
        self._lock_free = entry("__atomic_is_lock_free", ctypes.c_bool, ctypes.c_size_t, ptr)

    def lock_free(self) -> bool:
        """Whether 8-byte atomics are the CPU's own here (else libatomic takes locks of its
        own, in each process: no use between processes)."""
        word = np.zeros(1, np.int64)
        return bool(self._lock_free(8, word.ctypes.data))

    def compare_and_swap(self, words: Words, index: int, expected: int, new: int) -> int:
        seen = ctypes.c_int64(expected)  # (one a call: threads may share the words)
        self._cas(words.base + 8 * index, ctypes.byref(seen), new, SEQ_CST, SEQ_CST)
        return seen.value  # expected if swapped, else the value found

    def exchange(self, words: Words, index: int, value: int) -> int:
        return self._swap(words.base + 8 * index, value, SEQ_CST)

    def fetch_add(self, words: Words, index: int, value: int) -> int:
        return self._add(words.base + 8 * index, value, SEQ_CST)

    def load(self, words: Words, start: int, out: np.ndarray) -> None:
        base, load = words.base, self._load
        out[:] = [load(base + 8 * k, SEQ_CST) for k in range(start, start + out.size)]

    def add_then_load(
        self, words: Words, index: int, value: int, at: np.ndarray, ks: list[int], out: np.ndarray
    ) -> int:
        base, load = words.base, self._load
        old = self._add(base + 8 * index, value, SEQ_CST)
        out[:] = [load(base + 8 * k, SEQ_CST) for k in ks]
        return old


class _Numba:
    """The same atomics compiled by numba (its intrinsics emit LLVM's instructions)."""

    def __init__(self) -> None:
        from . import atomics_numba

        self._f = atomics_numba
        atomics_numba.warm()  # compiled or loaded now, not on a first call under a lock

    def compare_and_swap(self, words: Words, index: int, expected: int, new: int) -> int:
        return int(self._f.compare_and_swap(words.array, index, expected, new))

    def exchange(self, words: Words, index: int, value: int) -> int:
        return int(self._f.exchange(words.array, index, value))

    def fetch_add(self, words: Words, index: int, value: int) -> int:
        return int(self._f.fetch_add(words.array, index, value))

    def load(self, words: Words, start: int, out: np.ndarray) -> None:
        self._f.load(words.array, start, out)

    def add_then_load(
        self, words: Words, index: int, value: int, at: np.ndarray, ks: list[int], out: np.ndarray
    ) -> int:
        return int(self._f.add_then_load(words.array, index, value, at, out))


_backends: dict[str, Any] = {}


def _backend(name: str | None = None) -> Any:
    """The atomics of this process: libatomic where it loads, else numba (``name``, or
    MPIPS_ATOMICS=numba, asks for numba)."""
    name = name or settings.current().atomics
    if name not in _backends:
        lib = _libatomic() if name == "libatomic" else None
        ops = _LibAtomic(lib) if lib is not None else None
        _backends[name] = ops if ops is not None and ops.lock_free() else _Numba()
    return _backends[name]


def _libatomic() -> ctypes.PyDLL | None:
    """libatomic, from the dynamic loader's usual places (no search beyond: that runs
    ldconfig in a subprocess, after MPI_Init)."""
    try:
        return ctypes.PyDLL("libatomic.so.1")
    except OSError:
        return None


def backend_name() -> str:
    """Which atomics this process uses: "libatomic" or "numba"."""
    return "libatomic" if isinstance(_backend(), _LibAtomic) else "numba"


def warm() -> None:
    """Load this process's atomics now, at start-up (numba's compile, where it is the path,
    takes ~1 s on a cold cache): not on a first call made while holding a lock."""
    _backend()

"""The rules' fused forms (rules.py) at work: each rule's loop compiled by numba for float32
numpy arrays on the CPU, its cupy kernel for float32 cupy arrays on a GPU, and when either
runs instead of the rule's array form. All give the same bits.

CPU: numba compiles a loop with ``error_model="numpy"`` (no division-by-zero check, which
keeps LLVM from vectorising) and no fast-math, serial (the PS shares its cores with the
workers), once the array forms have cost a process COMPILE_AFTER s, or at a run's start-up
where its updates pay for it (optimizer.plan_kernel); it caches the kernel on disk where it
can write (beside rules.py). Without numba, or for arrays that are not C-contiguous float32
numpy arrays (float64, strided views), the array form runs. (numexpr was measured too:
slower than numpy here; docs/performance.md.)

GPU: a rule's cupy ElementwiseKernel is compiled by NVRTC at its first call (cupy caches the
binary on disk) without fused multiply-add contraction (``--fmad=false``; IEEE division and
square root are NVRTC's default), so it gives the array form's bits in one pass over the
GPU's memory where the array form makes ~10 with temporaries (Adam).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable

import numpy as np

from ..device.kernels import elementwise, is_cupy
from ..process import settings
from .rules import BY_NAME, RULES, Array, Hyper, Rule, find_rule

_F32 = np.dtype(np.float32)
# Loading numba costs a process ~0.8 s of CPU (on 2 busy cores, half a small job's start-up).
# A process starts compiling a kernel only once the array forms, applying updates that
# kernel could apply, have cost it this many seconds (about what loading numba costs): a
# small model never loads it, a big one has its kernel after a few updates, and neither
# pays more than about twice the cheaper choice. The bits are the same either way.
COMPILE_AFTER = 0.3
# A run decides at start-up instead (plan_kernel), so that no compile lands among its steps:
# the kernel is loaded before the first step where an update costs the array form at least
# PAYS_PER_UPDATE seconds (the kernel saves ~half of that, or more: numba's ~0.5-0.8 s of
# CPU to load is back within ~2000 updates), else never in that run. Each rule's
# ``numpy_seconds`` is the array form's CPU time per float32 element (1M-element arrays, the
# 2-vCPU VM, docs/performance.md):
NUMPY_SECONDS_PER_ELEMENT: dict[str, float] = {r.name: r.numpy_seconds for r in RULES}
PAYS_PER_UPDATE = 2e-4


class FusedKernels:
    """This process's fused CPU kernels: which are compiled, loading or failed, the CPU time
    the array forms took meanwhile, and whether fused forms are used at all."""

    def __init__(self) -> None:
        self.enabled: bool | None = None  # set_fused_kernels's word; None: MPIPS_FUSED_KERNELS's
        self.ready: dict[str, Callable[..., None]] = {}  # compiled for float32 and run once
        self.loaders: dict[str, threading.Thread] = {}  # the thread that compiles each kernel
        self.failed: set[str] = set()  # could not be had (numba missing, a failed compile)
        self.rule_seconds = 0.0  # CPU time in array forms a kernel fits (each thread's, summed)
        self.lock = threading.Lock()


KERNELS = FusedKernels()  # (tests put a fresh one in its place)


def set_fused_kernels(enabled: bool) -> bool:
    """Use the fused kernels (True, the default unless ``MPIPS_FUSED_KERNELS=0``) or always
    the numpy rules (False) in this process; returns the previous setting."""
    previous = fused_kernels_on()
    KERNELS.enabled = enabled
    return previous


def fused_kernels_on() -> bool:
    """Whether the fused kernels are used in this process: set_fused_kernels's word, else
    MPIPS_FUSED_KERNELS (default 1)."""
    enabled = KERNELS.enabled
    return settings.cached().fused_kernels if enabled is None else enabled


def fused_kernel(name: str, wait: bool = True) -> Callable[..., None] | None:
    """The compiled kernel of rule ``name`` (sgd, momentum, nesterov, adagrad, adam, ftrl),
    or None: numba missing, the compile failed, or (``wait=False``) not ready yet.

    The first request starts a thread that imports numba and compiles the kernel for
    float32 arrays, or loads it from numba's cache on disk: ~0.7-0.8 s of CPU on a 2-vCPU
    VM, mostly numba's own start-up. ``wait=False`` returns at once, so a caller runs the
    array form until the kernel is ready rather than stalling an update.
    """
    state = KERNELS
    kernel = state.ready.get(name)
    if kernel is not None:
        return kernel
    with state.lock:
        loader = state.loaders.get(name)
        if loader is None:  # not a daemon: an exit waits for it rather than kill a compile
            loader = threading.Thread(
                target=_compile, args=(state, BY_NAME[name]), name=f"mpips-{name}-kernel"
            )
            state.loaders[name] = loader
            loader.start()
    if wait:
        loader.join()
    return state.ready.get(name)


def await_kernel(name: str | None, timeout: float) -> bool:
    """Wait up to ``timeout`` s for plan_kernel's kernel ``name`` (None: none planned) to be
    loaded; whether it is. A compile slower than that goes on in the background, the array
    form running meanwhile (never a hang)."""
    if name is None:
        return True
    loader = KERNELS.loaders.get(name)
    if loader is not None:
        loader.join(timeout)
    return name in KERNELS.ready


def _compile(state: FusedKernels, rule: Rule) -> None:
    try:
        import numba
    except Exception as e:  # not installed, or built for another numpy
        warnings.warn(f"mpips: numba is not available ({e}); using the numpy rules", stacklevel=1)
        state.failed.add(rule.name)
        return
    try:  # compiled once per machine, then loaded from numba's cache beside rules.py
        kernel = numba.njit(rule.loop, cache=True, nogil=True, error_model="numpy")
    except RuntimeError:  # no writable cache directory: compile in every process
        kernel = numba.njit(rule.loop, nogil=True, error_model="numpy")
    arrays = 2 + len(rule.slots)  # var, grad, the slots; then the float32 scalars
    scalars = rule.loop.__code__.co_argcount - arrays
    try:  # for 1-D C-contiguous float32 arrays and float32 scalars, as apply_fused calls it
        kernel(*[np.zeros(1, np.float32) for _ in range(arrays)], *[np.float32(1)] * scalars)
    except Exception as e:
        warnings.warn(
            f"mpips: fused {rule.name} kernel failed ({e}); using the numpy rule", stacklevel=1
        )
        state.failed.add(rule.name)
        return
    state.ready[rule.name] = kernel


def _fits(var: Array, grad: Array, slots: list[Array]) -> bool:
    """numpy arrays of one shape, float32, C-contiguous, aligned and writable: the one array
    type the kernels are compiled for (another would be compiled here, on the caller's
    time)."""
    shape = var.shape
    for a in (var, grad, *slots):
        if type(a) is not np.ndarray or a.dtype != _F32 or a.shape != shape:
            return False
        flags = a.flags
        if not (flags.c_contiguous and flags.writeable and flags.aligned):
            return False
    return True


def fused_apply(
    kind: str,
    hyper: Hyper,
    var: Array,
    grad: Array,
    slots: dict[str, Array],
    lr: float,
    t: int,
    wait: bool = True,
    load: bool = True,
) -> bool | None:
    """apply_fused with the rule of optimizer ``kind`` (False: no such kind)."""
    rule = find_rule(kind, hyper)
    if rule is None:
        return False
    return apply_fused(rule, hyper, var, grad, slots, lr, t, wait, load)


def apply_fused(
    rule: Rule,
    hyper: Hyper,
    var: Array,
    grad: Array,
    slots: dict[str, Array],
    lr: float,
    t: int,
    wait: bool = True,
    load: bool = True,
) -> bool | None:
    """``rule`` by its fused CPU kernel, in place, where one fits: True. False (nothing done)
    where the array form must run instead: kernels off or unavailable, arrays that are not
    C-contiguous float32 numpy arrays of one shape, or (``load=False``) a kernel not loaded
    yet. None (nothing done, the array form runs) where the kernel fits but is not compiled
    yet (``wait=False``): its compile starts once the array forms have taken COMPILE_AFTER
    seconds (timed_array_form counts them). The result is the array form's, bit for bit."""
    if not fused_kernels_on():
        return False
    arrays = [slots[s] for s in rule.slots]
    if not _fits(var, grad, arrays):
        return False
    state = KERNELS
    kernel = state.ready.get(rule.name)
    if kernel is None:
        if rule.name in state.failed or not load:
            return False
        if not (wait or state.rule_seconds >= COMPILE_AFTER):
            return None  # not worth loading numba yet
        kernel = fused_kernel(rule.name, wait)
        if kernel is None:  # compiling (None), or it failed
            return False if rule.name in state.failed else None
    # ravel: views of C-contiguous arrays, so the kernel writes into var and slots
    kernel(var.ravel(), grad.ravel(), *[a.ravel() for a in arrays], *rule.scalars(hyper, lr, t))
    return True


def timed_array_form(
    rule: Rule, hyper: Hyper, var: Array, grad: Array, slots: dict[str, Array], lr: float, t: int
) -> None:
    """``rule``'s array form, its CPU time (not the time others ran meanwhile) counted
    towards compiling its kernel (apply_fused)."""
    start = time.thread_time()
    rule.array(var, grad, slots, lr, t, hyper)
    KERNELS.rule_seconds += time.thread_time() - start


def cupy_apply(
    rule: Rule, hyper: Hyper, var: Array, grad: Array, slots: dict[str, Array], lr: float, t: int
) -> bool:
    """``rule`` by its cupy kernel, in place, for float32 cupy arrays of one shape: True.
    False (nothing done; the array form runs) for anything else, or with the fused kernels
    off."""
    if not fused_kernels_on():
        return False
    arrays = (var, grad, *[slots[s] for s in rule.slots])
    if not all(is_cupy(a) and a.dtype == np.float32 and a.shape == var.shape for a in arrays):
        return False
    scalars, outputs, body = rule.cuda
    kernel = elementwise(
        rule.name,
        f"float32 g, {scalars}",
        ", ".join(p for p in ("float32 var", outputs) if p),
        body,
        options=("--fmad=false",),
        no_return=True,
    )
    kernel(grad, *rule.scalars(hyper, lr, t), var, *arrays[2:])
    return True

"""The environment as mpips reads it: every ``MPIPS_*`` variable, checked in one place.

Nothing is read at import. ``current()`` reads the environment at its first use and checks
every variable; ``mpips train`` calls ``check()`` as its first start-up step, on every rank,
so a bad value is one line naming the variable, the values it takes and its default (exit 2),
before anything waits on it. Also read here: the thread counts a user set for the BLAS and
OpenMP libraries (they win over the share mpips would give a rank) and whether this process
runs under Slurm (the hints then say ``--ntasks``, not ``mpirun -n``).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

ON, OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# the thread counts the BLAS and OpenMP libraries read from the environment when they load
THREAD_VARIABLES = (
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "FLEXIBLAS_NUM_THREADS",
)
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_NTASKS")
# set by python -m mpips.launch for its ranks (MPIPS_SURVIVE=0 before it turns survive mode
# off), and by a rank's supervisor (process/supervise.py): read where they are used
INTERNAL_VARIABLES = ("MPIPS_OUTCOME_DIR", "MPIPS_SUPERVISOR_FD", "MPIPS_SURVIVE")
# read by the scripts that ship beside the package (slurm/, tests/, benchmarks/), not by it
SCRIPT_VARIABLES = (
    "MPIPS_CRASH_TEST",
    "MPIPS_GPU_VENV",
    "MPIPS_LAUNCHER",
    "MPIPS_NETEM_INSIDE",
    "MPIPS_REQUEUE",
    "MPIPS_SLURM_CPUS",
    "MPIPS_SLURM_DIR",
    "MPIPS_TEST_PS",
    "MPIPS_TEST_TIMEOUT",
)


@dataclass(frozen=True)
class Settings:
    """Every knob mpips takes from the environment, checked (see VARIABLES for each)."""

    start_timeout: float = 300.0
    stall_timeout: float = 600.0
    blas_threads: int | None = None  # None: each rank's share of its node's cores
    verbose: bool = False
    shared_memory: bool = True
    sparse_checkpoints: bool = True
    fused_kernels: bool = True
    atomics: str = "libatomic"
    gpu_standin: bool = False
    # the user's own thread counts, by variable (set and not empty)
    thread_variables: Mapping[str, str] = field(default_factory=dict)
    slurm: bool = False  # SLURM_JOB_ID is set: this process runs in a Slurm allocation
    slurm_tasks: int | None = None  # SLURM_NTASKS, where it is a number


def _text(name: str, env: Mapping[str, str]) -> str:
    return env.get(name, "").strip()


def _seconds(default: float) -> Callable[[str, str], float]:
    """A limit in seconds: a number >= 1 (there is no 'no limit': every wait has a deadline)."""

    def parse(name: str, text: str) -> float:
        if not text:
            return default
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 1):
            raise ConfigError(
                f"{name} must be a number of seconds >= 1, got {text!r} (unset or empty: "
                f"{default:g}; there is no 'no limit', every wait has a deadline: set a "
                f"large number, e.g. 86400 for a day)"
            )
        return value

    return parse


def _threads(name: str, text: str) -> int | None:
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"{name} must be a whole number >= 1, got {text!r} (unset or empty: each rank "
            f"gets its share of its node's cores, or the count OMP_NUM_THREADS / "
            f"OPENBLAS_NUM_THREADS / MKL_NUM_THREADS sets)"
        )
    return int(text)


def _switch(default: bool) -> Callable[[str, str], bool]:
    def parse(name: str, text: str) -> bool:
        if not text:
            return default
        if text.lower() in ON + OFF:
            return text.lower() in ON
        raise ConfigError(
            f"{name} must be 1 or 0 (or true/false, yes/no, on/off), got {text!r} "
            f"(unset or empty: {int(default)})"
        )

    return parse


def _choice(*choices: str) -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        if not text:
            return choices[0]
        if text.lower() in choices:
            return text.lower()
        raise ConfigError(
            f"{name} must be {' or '.join(choices)}, got {text!r} (unset or empty: {choices[0]})"
        )

    return parse


# variable: (Settings field, parser of its stripped text; empty text is the default)
VARIABLES: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "MPIPS_START_TIMEOUT": ("start_timeout", _seconds(Settings.start_timeout)),
    "MPIPS_STALL_TIMEOUT": ("stall_timeout", _seconds(Settings.stall_timeout)),
    "MPIPS_BLAS_THREADS": ("blas_threads", _threads),
    "MPIPS_VERBOSE": ("verbose", _switch(False)),
    "MPIPS_SHARED_MEMORY": ("shared_memory", _switch(True)),
    "MPIPS_SPARSE_CHECKPOINTS": ("sparse_checkpoints", _switch(True)),
    "MPIPS_FUSED_KERNELS": ("fused_kernels", _switch(True)),
    "MPIPS_ATOMICS": ("atomics", _choice("libatomic", "numba")),
    "MPIPS_GPU_STANDIN": ("gpu_standin", _switch(False)),
}
NAMES = (*VARIABLES, *THREAD_VARIABLES, *SLURM_VARIABLES)


def read(env: Mapping[str, str]) -> Settings:
    """The settings ``env`` gives, checked: ConfigError (exit 2) naming the first variable
    whose value is not one it takes, with the values it takes."""
    values = {attr: parse(name, _text(name, env)) for name, (attr, parse) in VARIABLES.items()}
    tasks = _text("SLURM_NTASKS", env)
    return Settings(
        **values,
        thread_variables={n: _text(n, env) for n in THREAD_VARIABLES if _text(n, env)},
        slurm=bool(_text("SLURM_JOB_ID", env)),
        slurm_tasks=int(tasks) if tasks.isdigit() else None,
    )


class Cache:
    """The settings as last read (``settings``; None: never read), and the values of NAMES
    they were read from (``key``)."""

    def __init__(self) -> None:
        self.key: tuple[str | None, ...] = ()
        self.settings: Settings | None = None

    def reset(self) -> None:
        """Forget them: the next use reads the environment again (for tests)."""
        self.key, self.settings = (), None


CACHE = Cache()  # this process's: never rebound


def current() -> Settings:
    """This process's settings: read at first use, again only where the environment's
    values changed since (a test's monkeypatch); ConfigError for a bad value. Looking the
    variables up takes ~70 us: for start-up and once-a-run paths (a step's use cached())."""
    key = tuple(map(os.environ.get, NAMES))
    if CACHE.settings is None or CACHE.key != key:
        settings = read(os.environ)
        CACHE.key, CACHE.settings = key, settings
        return settings
    return CACHE.settings


def cached() -> Settings:
    """The settings as last read (read now if never; the defaults where a value is bad, as
    lenient()), without looking at the environment again: for paths taken every step, after
    start-up has read and checked them."""
    return lenient() if CACHE.settings is None else CACHE.settings


def check() -> None:
    """The start-up check: ConfigError (exit 2) for the first bad value, said on every rank
    as one line (``mpips train`` runs it as an agreed start-up step)."""
    current()


def lenient() -> Settings:
    """current(), or the defaults where a value is bad: for the start-up exchange that
    reports it (it needs a deadline before the bad value has been said)."""
    try:
        return current()
    except ConfigError:
        return Settings()


def unknown(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each MPIPS_* variable that nothing reads (a typo is otherwise silently
    ignored), naming the variable it is closest to, if any."""
    env = os.environ if env is None else env
    known = set(VARIABLES) | set(SCRIPT_VARIABLES) | set(INTERNAL_VARIABLES)
    out = []
    for name in sorted(n for n in env if n.startswith("MPIPS_") and n not in known):
        near = difflib.get_close_matches(name, VARIABLES, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        out.append(f"{name} is set, but mpips reads no such variable{hint}")
    return out


def launcher() -> str:
    """The launcher a user runs here: ``srun`` in a Slurm allocation (SLURM_JOB_ID set),
    else ``mpirun``."""
    return "srun" if lenient().slurm else "mpirun"


def launch_hint(ranks: int | str) -> str:
    """How to start ``ranks`` processes here: ``mpirun -n N``, or in a Slurm allocation
    ``srun --ntasks=N`` (``--ntasks=N`` is sbatch's option too)."""
    return f"srun --ntasks={ranks}" if launcher() == "srun" else f"mpirun -n {ranks}"

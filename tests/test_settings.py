"""Every MPIPS_* variable is read and checked in one place (mpips.process.settings), at start-up: a
bad value is one line naming the variable, the values it takes and its default, exit 2 on
every rank, no traceback (issue 43, item 4: ``float()`` at import printed a traceback on
every rank, -1 aborted a healthy job after ~2 s, NaN was taken silently)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import clean_env

from mpips.errors import ConfigError
from mpips.process import settings


def read(**env: str) -> settings.Settings:
    return settings.read(env)


def test_unset_or_empty_is_the_default():
    assert read() == settings.Settings()
    assert read(MPIPS_START_TIMEOUT="", MPIPS_VERBOSE=" ", MPIPS_ATOMICS="") == read()
    s = read()
    assert (s.start_timeout, s.stall_timeout, s.blas_threads) == (300, 600, None)
    assert s.shared_memory and s.sparse_checkpoints and s.fused_kernels and not s.verbose
    assert s.atomics == "libatomic" and not s.gpu_standin and not s.slurm


def test_good_values_are_read():
    s = read(
        MPIPS_START_TIMEOUT="20",
        MPIPS_STALL_TIMEOUT=" 2.5 ",
        MPIPS_BLAS_THREADS="3",
        MPIPS_VERBOSE="yes",
        MPIPS_SHARED_MEMORY="0",
        MPIPS_SPARSE_CHECKPOINTS="off",
        MPIPS_FUSED_KERNELS="False",
        MPIPS_ATOMICS="numba",
        MPIPS_GPU_STANDIN="1",
        OMP_NUM_THREADS="1",
        SLURM_JOB_ID="77",
        SLURM_NTASKS="3",
    )
    assert (s.start_timeout, s.stall_timeout, s.blas_threads, s.verbose) == (20, 2.5, 3, True)
    assert not (s.shared_memory or s.sparse_checkpoints or s.fused_kernels)
    assert s.atomics == "numba" and s.gpu_standin
    assert dict(s.thread_variables) == {"OMP_NUM_THREADS": "1"}
    assert s.slurm and s.slurm_tasks == 3


@pytest.mark.parametrize("name", ["MPIPS_START_TIMEOUT", "MPIPS_STALL_TIMEOUT"])
@pytest.mark.parametrize("value", ["abc", "-1", "0", "0.5", "nan", "inf", "-inf", "1e400"])
def test_a_limit_is_a_finite_number_of_seconds(name, value):
    with pytest.raises(ConfigError) as e:
        read(**{name: value})
    said = str(e.value)
    assert said.startswith(f"{name} must be a number of seconds >= 1, got {value!r}")
    assert "there is no 'no limit'" in said and "\n" not in said


@pytest.mark.parametrize(
    "name,value,said",
    [
        ("MPIPS_BLAS_THREADS", "0", "MPIPS_BLAS_THREADS must be a whole number >= 1, got '0'"),
        ("MPIPS_BLAS_THREADS", "two", "must be a whole number >= 1"),
        ("MPIPS_VERBOSE", "2", "MPIPS_VERBOSE must be 1 or 0 (or true/false, yes/no, on/off)"),
        ("MPIPS_SHARED_MEMORY", "maybe", "MPIPS_SHARED_MEMORY must be 1 or 0"),
        ("MPIPS_SPARSE_CHECKPOINTS", "x", "(unset or empty: 1)"),
        ("MPIPS_FUSED_KERNELS", "auto", "MPIPS_FUSED_KERNELS must be 1 or 0"),
        ("MPIPS_GPU_STANDIN", "gpu", "(unset or empty: 0)"),
        ("MPIPS_ATOMICS", "gcc", "MPIPS_ATOMICS must be libatomic or numba, got 'gcc'"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_it_takes(name, value, said):
    with pytest.raises(ConfigError) as e:
        read(**{name: value})
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.launcher
def test_nothing_is_read_at_import():
    """Importing mpips (and the modules that used to read at import) reads no variable: a
    bad value cannot fail an import, only the start-up check."""
    code = (
        "import mpips, mpips.training, mpips.process.log, mpips.optim, mpips.store\n"
        "from mpips.process import settings\n"
        "assert settings.CACHE.settings is None, settings.CACHE.settings\n"
        "print('ok')\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        env=clean_env(MPIPS_START_TIMEOUT="abc", MPIPS_VERBOSE="loud"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr


def test_current_follows_the_environment_and_cached_does_not_look(monkeypatch):
    monkeypatch.setenv("MPIPS_STALL_TIMEOUT", "7")
    assert settings.current().stall_timeout == 7
    monkeypatch.setenv("MPIPS_STALL_TIMEOUT", "8")
    assert settings.cached().stall_timeout == 7  # (a step's path: as start-up read it)
    assert settings.current().stall_timeout == 8 == settings.cached().stall_timeout
    monkeypatch.setenv("MPIPS_STALL_TIMEOUT", "nan")
    with pytest.raises(ConfigError):
        settings.check()
    assert settings.lenient() == settings.Settings()  # the start-up exchange's deadline
    monkeypatch.delenv("MPIPS_STALL_TIMEOUT")
    assert settings.current().stall_timeout == 600


def test_an_unknown_variable_is_named_with_the_one_it_is_closest_to():
    env = {"MPIPS_STAL_TIMEOUT": "3", "MPIPS_REQUEUE": "1", "MPIPS_COLOUR": "red", "HOME": "/"}
    said = settings.unknown(env)
    assert said == [
        "MPIPS_COLOUR is set, but mpips reads no such variable",
        "MPIPS_STAL_TIMEOUT is set, but mpips reads no such variable (did you mean "
        "MPIPS_STALL_TIMEOUT?)",
    ]


def test_the_launch_hint_says_ntasks_under_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert settings.launch_hint(3) == "mpirun -n 3" and settings.launcher() == "mpirun"
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    assert settings.launch_hint(3) == "srun --ntasks=3" and settings.launcher() == "srun"

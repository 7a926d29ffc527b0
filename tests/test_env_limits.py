"""The environment knobs end to end (issue 43, item 4): a bad MPIPS_* value stops ``python
-m mpips train``, in one process or under ``mpiexec -n 3``, with one line from rank 0 naming
the variable and the values it takes, exit 2, no traceback, before anything trains. Before,
``MPIPS_START_TIMEOUT=abc`` printed a traceback on every rank (exit 1), ``-1`` aborted a
healthy job after ~2 s naming "stuck" ranks, and ``MPIPS_STALL_TIMEOUT=nan`` was taken."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import clean_env, mpiexec_path

pytestmark = pytest.mark.launcher


def run_train_env(n: int | None, tmp_path, **env: str) -> subprocess.CompletedProcess:
    """``python -m mpips train`` (the built-in job, 30 steps, no checkpoints) under
    ``mpiexec -n N`` (None: one process) with ``env`` added."""
    argv = [sys.executable, "-m", "mpips", "train", "--no-progress", "--steps", "30"]
    argv += ["--ckpt-dir", ""]
    cmd = argv if n is None else [mpiexec_path(), "-n", str(n), *argv]
    return subprocess.run(
        cmd,
        cwd=tmp_path,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line(r: subprocess.CompletedProcess, said: str) -> None:
    """Exit 2, ``said`` once on stderr as its only line, no traceback, nothing trained."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stderr.count(said) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().count("\n") == 0, r.stderr[-3000:]
    assert "step " not in r.stdout and "final:" not in r.stdout, r.stdout[-2000:]


@pytest.mark.parametrize(
    "name,value",
    [("MPIPS_START_TIMEOUT", "abc"), ("MPIPS_START_TIMEOUT", "-1"), ("MPIPS_STALL_TIMEOUT", "nan")],
)
def test_a_bad_limit_stops_every_rank_at_start_up_in_one_line(tmp_path, name, value):
    """The issue's three: a traceback on every rank (exit 1), a healthy job aborted after ~2
    s naming "stuck" ranks, and NaN taken silently. Now one line from rank 0, exit 2."""
    r = run_train_env(3, tmp_path, **{name: value})
    assert_one_line(r, f"mpips: error: {name} must be a number of seconds >= 1, got {value!r}")


@pytest.mark.launcher
def test_a_bad_value_stops_a_one_process_run_in_one_line(tmp_path):
    r = run_train_env(None, tmp_path, MPIPS_VERBOSE="loud")
    assert_one_line(r, "mpips: error: MPIPS_VERBOSE must be 1 or 0")


@pytest.mark.launcher
def test_a_good_limit_is_obeyed_and_a_typo_is_warned_of(tmp_path):
    r = run_train_env(None, tmp_path, MPIPS_START_TIMEOUT="30", MPIPS_STAL_TIMEOUT="5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        "warning: MPIPS_STAL_TIMEOUT is set, but mpips reads no such variable "
        "(did you mean MPIPS_STALL_TIMEOUT?)" in r.stdout
    ), r.stdout[-3000:]


@pytest.mark.parametrize("command", [["layout", "-n", "3"], ["ckpt", "list", "."]])
def test_the_other_commands_check_the_environment_too(tmp_path, command):
    """eval, predict, layout, ckpt and data read the same knobs: a bad one is their one line."""
    r = subprocess.run(
        [sys.executable, "-m", "mpips", *command],
        cwd=tmp_path,
        env=clean_env(MPIPS_STALL_TIMEOUT="abc"),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 2 and "MPIPS_STALL_TIMEOUT" in r.stderr, (r.stdout, r.stderr)
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr, r.stderr

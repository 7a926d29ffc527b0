"""The built wheel carries what a fresh `pip install .` needs (the tests run from source)."""

import shutil
import subprocess
import sys
import zipfile

import pytest
from conftest import ROOT


@pytest.mark.launcher  # a subprocess build: once, under plain pytest (not once per MPI rank)
def test_wheel_ships_the_default_job_and_digits(tmp_path):
    src = tmp_path / "src"  # a clean copy: setuptools writes build/ into the source tree
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "runs", "data", "__pycache__", ".pytest_cache"
        ),
    )
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("mpips-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "mpips/builtin/default.toml",
        "mpips/builtin/digits.h5",
        "mpips/__main__.py",
        "mpips/store/client.py",
    ):
        assert needed in names, needed


@pytest.mark.parametrize(
    "value,strict",
    [
        ("true", True),
        ("1", True),
        ("TRUE ", True),
        ("yes", True),
        ("false", False),
        ("0", False),
        ("", False),
        ("no", False),
        (None, False),
    ],
)
def test_ci_is_read_as_true_or_false_not_as_set(monkeypatch, value, strict):
    """Under CI=true a missing Slurm or dataset fails its tests; CI=false (set, but false)
    lets them skip, like no CI at all."""
    from conftest import under_ci

    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert under_ci() is strict

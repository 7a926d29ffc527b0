"""The one-process debug run with a layout (issue 43, item 3): ``python -m mpips train JOB``
without mpirun trains as one synchronous replica whatever the job's [layout] (or a
``--layout`` file) says: its ps, world_size, pins and partitions are for a launch with
several ranks, and the run says how to make that launch. Before, a layout's world_size
stopped it with "world_size = 3, but the job runs on 1 ranks". Under Slurm (SLURM_JOB_ID
set) the hints say ``srun --ntasks=3`` where they said ``mpirun -n 3``."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import clean_env

from mpips.errors import ConfigError
from mpips.placement.layout import make_layout

LAYOUT = "ps = 1\nworld_size = 3\n"
JOB = """
[model]
kind = "mlp"
hidden = [16]
[data]
builtin = "digits"
[train]
steps = 20
progress = false
[checkpoint]
dir = ""
[layout]
ps = 2
world_size = 5
pin = { "dense_0/kernel" = 1 }
partition = ["dense_1/kernel"]
"""
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "3"}


def mpips(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """``python -m mpips ARGS`` in one process (no launcher), ``env`` added."""
    full = clean_env(**env)
    for name in SLURM:
        if name not in env:
            full.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "mpips", *args],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.launcher
def test_one_process_trains_with_a_layout_file_that_has_a_world_size(tmp_path):
    (tmp_path / "layout.toml").write_text(LAYOUT)
    args = ("train", "--no-progress", "--steps", "20", "--ckpt-dir", "")
    r = mpips(tmp_path, *args, "--layout", "layout.toml")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "training as a single synchronous replica" in r.stdout, r.stdout
    assert "the job's [layout] (world_size = 3) applies under mpirun -n 3" in r.stdout
    assert "final: global_step 20" in r.stdout, r.stdout[-2000:]
    # --ps with it: the same (one process has no PS task to give the ranks to)
    r = mpips(tmp_path, *args, "--layout", "layout.toml", "--ps", "2")
    assert r.returncode == 0 and "final: global_step 20" in r.stdout, r.stderr[-3000:]


@pytest.mark.launcher
def test_one_process_trains_a_job_whose_layout_pins_and_partitions(tmp_path):
    """ps = 2, world_size = 5, a pin to ps task 1 and a partitioned variable: all for the
    launch with 5 ranks; the one-process run trains the same model."""
    (tmp_path / "job.toml").write_text(JOB)
    r = mpips(tmp_path, "train", "job.toml")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(world_size = 5) applies under mpirun -n 5" in r.stdout, r.stdout
    assert "final: global_step 20" in r.stdout, r.stdout[-2000:]
    r = mpips(tmp_path, "layout", "job.toml", "-n", "1")  # `mpips layout` says the same
    assert r.returncode == 0 and "0 ps, 1 worker" in r.stdout, r.stderr[-3000:]


@pytest.mark.launcher
def test_under_slurm_the_hints_say_ntasks(tmp_path):
    """In an sbatch script (SLURM_JOB_ID, SLURM_NTASKS set) the one-process run names srun
    and the allocation's tasks; a world size that does not match says --ntasks."""
    (tmp_path / "layout.toml").write_text(LAYOUT)
    r = mpips(tmp_path, "train", "--no-progress", "--steps", "5", "--ckpt-dir", "", **SLURM)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "one process (no srun)" in r.stdout and "mpirun" not in r.stdout, r.stdout
    assert "run under srun --ntasks=N for ps/worker training" in r.stdout, r.stdout
    assert "this Slurm allocation has 3 tasks" in r.stdout, r.stdout
    r = mpips(tmp_path, "layout", "--layout", "layout.toml", "-n", "2", **SLURM)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "world_size = 3, but the job runs on 2 ranks (srun --ntasks=3?)" in r.stderr
    assert "mpirun" not in r.stderr, r.stderr


def test_the_world_size_hint_names_the_launcher(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match=r"runs on 2 ranks \(mpirun -n 3\?\)"):
        make_layout(2, 1, 3)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(ConfigError, match=r"runs on 2 ranks \(srun --ntasks=3\?\)"):
        make_layout(2, 1, 3)

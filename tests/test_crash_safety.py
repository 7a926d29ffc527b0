"""kill -9 of the whole job at random moments, 14 times: every time, the latest committed
checkpoint loads, and the next run resumes from it (plain pytest; launches mpiexec)."""

import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import clean_env, mpiexec_path

from mpips import checkpoint

pytestmark = pytest.mark.launcher

JOB = """
[model]
hidden = [512, 512]      # ~1.2 MB checkpoints, written every 5 steps: kills land mid-write
[data]
builtin = "digits"
[optimizer]
kind = "adam"
learning_rate = 0.001
[train]
steps = 1000000000
batch_size = 16
log_every = 0
progress = false
[checkpoint]
dir = "runs/crash"
every_steps = 5
max_to_keep = 2
"""


def kill_job(marker: str) -> None:
    """SIGKILL every process of this job (the launcher and all ranks), found by its marker."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if f"MPIPS_CRASH_TEST={marker}".encode() in env:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_kill_9_at_random_moments_never_loses_the_last_checkpoint(tmp_path):
    rng = random.Random(1234)
    marker = uuid.uuid4().hex
    last_seen = 0
    for attempt in range(14):
        # 1 or 2 PS tasks in turn: shards written in parallel, restored onto another layout
        (tmp_path / "job.toml").write_text(JOB + f"[layout]\nps = {1 + attempt % 2}\n")
        log = tmp_path / f"run{attempt}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [mpiexec_path(), "-n", "3", sys.executable, "-m", "mpips", "train", "job.toml"],
                cwd=tmp_path,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(MPIPS_CRASH_TEST=marker),
            )
            # kill once training runs (a loaded machine may take seconds to start the
            # ranks), at a random moment: mid-step, mid-write or mid-commit
            deadline = time.monotonic() + 60
            while "train rows [" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.2, 1.5))
            kill_job(marker)
            proc.wait(timeout=30)
        text = log.read_text()
        if last_seen:  # the previous kill left a committed checkpoint: this run resumed from it
            m = re.search(r"restored global_step (\d+)", text)
            assert m and int(m.group(1)) >= last_seen, text[-2000:]
        latest = checkpoint.latest_checkpoint(tmp_path / "runs/crash")
        if latest is not None:
            ckpt = checkpoint.Checkpoint(latest)
            variables, slots = ckpt.read_all()  # loads, whole, from its shards
            assert len(variables) == 6 and len(slots) == 12
            last_seen = ckpt.step
    assert last_seen > 0
    # a last, clean run removes what killed writers left half-written
    (tmp_path / "job.toml").write_text(
        JOB.replace("steps = 1000000000", f"steps = {last_seen + 5}")
    )
    r = subprocess.run(
        [mpiexec_path(), "-n", "3", sys.executable, "-m", "mpips", "train", "job.toml"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    # the files of checkpoints (the summaries' worker-K folders live beside them; the lock
    # file stays: removing it would let two runs lock two different files)
    here = (tmp_path / "runs/crash").iterdir()
    left = sorted(p.name for p in here if p.is_file() and p.name != checkpoint.LOCK_FILE)
    assert not [n for n in left if n.startswith(".")], f"stale temporaries remain: {left}"
    committed = {f"ckpt-{s}" for s, _ in checkpoint.list_checkpoints(tmp_path / "runs/crash")}
    assert {n.split(".")[0] for n in left} == committed, f"orphan shards remain: {left}"

"""The project's own sbatch script on a real (one-node) Slurm: a job completes with a
checkpoint; `scancel --signal=USR1` makes it checkpoint and exit 3; with MPIPS_REQUEUE=1 the
job is requeued and resumes with the global step continuing.

.ci/run starts the cluster (slurm/one-node-slurm.sh up) and exports SLURM_CONF; elsewhere
these tests skip unless a Slurm controller answers (under CI=true they fail instead)."""

import os
import re
import shutil
import subprocess
import time

import pytest
from conftest import ROOT, clean_env, under_ci

pytestmark = pytest.mark.launcher


def slurm_up() -> bool:
    if not shutil.which("sbatch"):
        return False
    r = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=20)
    return r.returncode == 0 and "UP" in r.stdout


@pytest.fixture(scope="module")
def slurm():
    if not slurm_up():
        if under_ci():
            pytest.fail("no Slurm controller: .ci/run must start slurm/one-node-slurm.sh up")
        pytest.skip(
            "no Slurm controller (start one: slurm/one-node-slurm.sh up, then export SLURM_CONF)"
        )


def sbatch(tmp_path, *args, script="train.sbatch", options=(), **env):
    r = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--chdir={tmp_path}",
            *options,
            str(ROOT / "slurm" / script),
            *args,
        ],
        capture_output=True,
        text=True,
        env=clean_env(**env),
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def job_field(job, field):
    r = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=20)
    m = re.search(rf"\b{field}=(\S+)", r.stdout)
    return m.group(1) if m else ""


def node_state():
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return r.stdout.strip()


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def output(tmp_path, job):
    path = tmp_path / f"mpips-{job}.out"
    return path.read_text() if path.exists() else ""


def wait_end(job, timeout=180):
    return wait_for(
        lambda: (
            job_field(job, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")
            and job_field(job, "JobState")
        ),
        timeout,
        f"job {job} to end",
    )


def test_training_job_completes_with_a_checkpoint(slurm, tmp_path):
    job = sbatch(tmp_path, "--steps", "300")
    state = wait_end(job)
    assert state == "COMPLETED", output(tmp_path, job)
    assert job_field(job, "ExitCode") == "0:0"
    text = output(tmp_path, job)
    assert "final: global_step 300 test_accuracy" in text, text
    assert (tmp_path / "runs/default/ckpt-300.json").exists()
    assert "ckpt-300.shard-1-of-2.h5" in os.listdir(tmp_path / "runs/default")  # 2 PS tasks


def test_multinode_script_puts_one_ps_on_each_node(slurm, tmp_path):
    """The several-node script, on the one node this cluster has: one PS (rank 0), the other
    ranks workers; its layout flag can be overridden after the job file."""
    job = sbatch(
        tmp_path,
        "--steps",
        "200",
        script="train-multinode.sbatch",
        options=("--nodes=1", "--ntasks-per-node=3"),
    )
    assert wait_end(job) == "COMPLETED", output(tmp_path, job)
    text = output(tmp_path, job)
    assert "[/job:ps/task:0] rank 0," in text and "[/job:worker/task:1] rank 2," in text, text
    assert "final: global_step 200" in text and "on 2 workers" in text, text
    job = sbatch(
        tmp_path,
        "--steps",
        "250",
        "--ps",
        "2",
        script="train-multinode.sbatch",
        options=("--nodes=1", "--ntasks-per-node=3"),
    )
    assert wait_end(job) == "COMPLETED", output(tmp_path, job)
    text = output(tmp_path, job)
    assert "[/job:ps/task:1] rank 1," in text and "on 1 workers" in text, text
    assert "restored global_step 200" in text, text


def test_usr1_checkpoints_exits_3_and_requeue_resumes(slurm, tmp_path):
    job = sbatch(tmp_path, "--steps", str(10**9), MPIPS_REQUEUE="1")
    try:
        wait_for(
            lambda: (
                "update" in output(tmp_path, job) or "saved checkpoint" in output(tmp_path, job)
            ),
            120,
            "training to start",
        )
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=20)
        first = wait_for(
            lambda: re.search(
                r"stopped early by SIGUSR1: checkpoint at "
                r"global_step (\d+)",
                output(tmp_path, job),
            ),
            60,
            "the preemption checkpoint",
        )
        step = int(first.group(1))
        assert (tmp_path / f"runs/default/ckpt-{step}.json").exists()
        wait_for(lambda: job_field(job, "Restarts") == "1", 60, "the requeue")
        wait_for(lambda: job_field(job, "JobState") == "PENDING", 60, "the requeued job to wait")
        # starting it at once raced slurmd's cleanup of the first run ("Job credential
        # revoked": the requeued job failed without running): wait until the node is idle,
        # then past the second in which the old credential was revoked
        wait_for(lambda: node_state() == "idle", 60, "the node to finish the first run")
        time.sleep(5)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], timeout=20)
        resumed = wait_for(
            lambda: re.search(r"restored global_step (\d+)", output(tmp_path, job)),
            120,
            "the resumed run",
        )
        assert int(resumed.group(1)) == step
        assert "preempted with a checkpoint; requeueing job" in output(tmp_path, job)
    finally:
        subprocess.run(["scancel", job], timeout=20)

"""The project's own sbatch scripts on a real Slurm on this machine: a job completes with a
checkpoint; `scancel --signal=USR1` makes it checkpoint and exit 3; with MPIPS_REQUEUE=1 the
job is requeued and resumes with the global step continuing; the several-node script runs
over two Slurm nodes (two slurmd) with one PS on each.

.ci/run starts the cluster (slurm/one-node-slurm.sh up --nodes 2) and exports SLURM_CONF;
elsewhere these tests skip unless a Slurm controller answers, and the two-node ones unless it
has two nodes (under CI=true they fail instead)."""

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


@pytest.fixture(scope="module")
def two_nodes(slurm):
    r = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=20
    )
    if len(set(r.stdout.split())) < 2:
        if under_ci():
            pytest.fail("the Slurm cluster has one node: .ci/run must start it with --nodes 2")
        pytest.skip("the Slurm cluster has one node (slurm/one-node-slurm.sh up --nodes 2)")


def sbatch(tmp_path, *args, script="train.sbatch", options=(), **env):
    """Submit a job once the cluster is quiet: an earlier test's cancelled job still being
    cleaned up made a new job on that node fail at launch ("Job credential revoked")."""
    wait_for(cluster_quiet, 120, "the earlier tests' jobs to leave the nodes")
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


def cluster_quiet() -> bool:
    """No job in the queue and every node idle, for a second past the last cleanup."""
    r = subprocess.run(["squeue", "-h"], capture_output=True, text=True, timeout=20)
    if r.stdout.strip() or node_state() != "idle":
        return False
    time.sleep(2)
    return node_state() == "idle"


def node_state():
    r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    return r.stdout.strip()


# a worker's step line: training has started (not any line with "update" in it: the chief's
# start-up detail says the workers "read and update the PS memory in place")
STEP_LINE = re.compile(r"step \d+ loss \S+ epoch \d+ \(update \d+ of this worker")


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    r = subprocess.run(["squeue", "-o", "%i %T %R %N"], capture_output=True, text=True, timeout=20)
    pytest.fail(f"timed out after {timeout} s waiting for {what}; the queue:\n{r.stdout}")


def output(tmp_path, job):
    path = tmp_path / f"mpips-{job}.out"
    return path.read_text() if path.exists() else ""


def started(tmp_path, job):
    """Whether the job's workers print step lines; a job that ended before fails the test
    at once, with its state and output (not a timeout that says nothing)."""
    if found := STEP_LINE.search(output(tmp_path, job)):
        return found
    state = job_field(job, "JobState")
    if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
        reason = job_field(job, "Reason")
        pytest.fail(f"job {job} ended {state} ({reason}) before training:\n{output(tmp_path, job)}")
    return None


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
    assert "[/job:ps/task:1] rank 1," in text and "on 1 worker in" in text, text
    assert "restored global_step 200" in text, text


def job_nodes(job):
    """The nodes Slurm gave the job, in its order (task blocks fill them in this order)."""
    r = subprocess.run(
        ["scontrol", "show", "hostnames", job_field(job, "NodeList")],
        capture_output=True,
        text=True,
        timeout=20,
    )
    return r.stdout.split()


def placement(text):
    """{rank: (task, host)} from the "[/job:ps/task:0] rank 0, pid 123 on node1" lines."""
    lines = re.findall(
        r"^\[/job:(\w+/task:\d+)\] rank (\d+), pid \d+ on (\S+), node \d+ of \d+$", text, re.M
    )
    return {int(rank): (task, host) for task, rank, host in lines}


def assert_one_ps_per_node(text, nodes, per_node):
    """Rank r ran on Slurm's node r // per_node (block distribution), and each node's PS
    is its lowest rank (ps = per_node): the ranks' host names are their slurmd's node name."""
    seen = placement(text)
    expected = {
        rank: (
            f"ps/task:{rank // per_node}" if rank % per_node == 0 else "",
            nodes[rank // per_node],
        )
        for rank in range(per_node * len(nodes))
    }
    assert {r: (t if t.startswith("ps/") else "", h) for r, (t, h) in seen.items()} == expected, (
        text
    )


def test_multinode_script_runs_over_two_slurm_nodes(two_nodes, tmp_path):
    """--nodes=2 --ntasks-per-node=2 under two slurmd: mpiexec inside the allocation starts
    each node's ranks under that node's slurmd (srun), so per_node makes 2 PS + 2 workers."""
    job = sbatch(
        tmp_path,
        "--steps",
        "100",
        script="train-multinode.sbatch",
        options=("--nodes=2", "--ntasks-per-node=2"),
    )
    assert wait_end(job) == "COMPLETED", output(tmp_path, job)
    assert job_field(job, "ExitCode") == "0:0"
    nodes = job_nodes(job)
    assert len(nodes) == 2, nodes
    text = output(tmp_path, job)
    assert_one_ps_per_node(text, nodes, 2)
    assert "final: global_step 100" in text and "on 2 workers" in text, text
    assert "ckpt-100.shard-1-of-2.h5" in os.listdir(tmp_path / "runs/default")


def test_usr1_checkpoints_exits_3_and_requeue_resumes(slurm, tmp_path):
    job = sbatch(tmp_path, "--steps", str(10**9), MPIPS_REQUEUE="1")
    try:
        wait_for(
            lambda: started(tmp_path, job) or "saved checkpoint" in output(tmp_path, job),
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


def test_two_node_job_over_srun_is_preempted_requeued_and_completes(two_nodes, tmp_path):
    """MPIPS_LAUNCHER=srun over two nodes: USR1 reaches the ranks on both nodes, each node's
    PS writes its shard, the requeued job resumes there and (its step target lowered in the
    job file meanwhile) ends with exit 0."""
    job_file = tmp_path / "job.toml"
    default = (ROOT / "jobs/default.toml").read_text()
    assert "\nsteps = 600 " in default
    job_file.write_text(default.replace("\nsteps = 600 ", f"\nsteps = {10**9} "))
    job = sbatch(
        tmp_path,
        str(job_file),
        script="train-multinode.sbatch",
        options=("--nodes=2", "--ntasks-per-node=2"),
        MPIPS_REQUEUE="1",
        MPIPS_LAUNCHER="srun",
    )
    try:
        wait_for(lambda: started(tmp_path, job), 120, "training to start")
        nodes = job_nodes(job)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=20)
        first = wait_for(
            lambda: re.search(
                r"stopped early by SIGUSR1: checkpoint at global_step (\d+)",
                output(tmp_path, job),
            ),
            60,
            "the preemption checkpoint",
        )
        step = int(first.group(1))
        files = os.listdir(tmp_path / "runs/default")
        assert {f"ckpt-{step}.shard-{k}-of-2.h5" for k in (0, 1)} <= set(files), files
        wait_for(lambda: job_field(job, "Restarts") == "1", 60, "the requeue")
        wait_for(lambda: job_field(job, "JobState") == "PENDING", 60, "the requeued job to wait")
        assert_one_ps_per_node(output(tmp_path, job), nodes, 2)  # the first run's ranks
        job_file.write_text(default.replace("\nsteps = 600 ", f"\nsteps = {step + 50} "))
        # as in the one-node test: start it once the nodes are idle and the old credential
        # is past its revocation second
        wait_for(lambda: node_state() == "idle", 60, "the nodes to finish the first run")
        time.sleep(5)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], timeout=20)
        assert wait_end(job) == "COMPLETED", output(tmp_path, job)
        assert job_field(job, "ExitCode") == "0:0"
        text = output(tmp_path, job)
        assert "preempted with a checkpoint; requeueing job" in text
        resumed = text.split("requeueing job", 1)[1]
        assert f"restored global_step {step}" in resumed, resumed
        assert f"final: global_step {step + 50}" in resumed, resumed
        assert_one_ps_per_node(resumed, job_nodes(job), 2)
    finally:
        subprocess.run(["scancel", job], timeout=20)


def pid_of(tmp_path, job, task):
    """The pid of ``task``'s rank, from the job's start-up lines (once they are there)."""
    found = wait_for(
        lambda: re.search(rf"\[{task}\] rank \d+, pid (\d+) on ", output(tmp_path, job)),
        120,
        f"{task}'s start-up line",
    )
    return int(found.group(1))


def killed_in_sbatch(tmp_path, task, options, **env):
    """slurm/train.sbatch on the digits job (80000 steps, a checkpoint a second), ``task``'s
    rank killed with SIGKILL after the first checkpoint; checks the job then COMPLETED with
    exit 0. Returns (the job id, its output)."""
    job_file = tmp_path / "job.toml"
    job_file.write_text(
        '[data]\nbuiltin = "digits"\n[train]\nsteps = 80000\n'
        '[checkpoint]\ndir = "runs/default"\nevery_secs = 1.0\n'
    )
    job = sbatch(tmp_path, str(job_file), options=options, **env)
    try:
        pid = pid_of(tmp_path, job, task)
        wait_for(lambda: "saved checkpoint" in output(tmp_path, job), 120, "a checkpoint")
        os.kill(pid, 9)
        assert wait_end(job) == "COMPLETED", output(tmp_path, job)
        assert job_field(job, "ExitCode") == "0:0"
    except BaseException:
        subprocess.run(["scancel", job], timeout=20)
        raise
    return job, output(tmp_path, job)


def test_a_worker_killed_in_an_sbatch_job_costs_its_step_not_the_job(slurm, tmp_path):
    """slurm/train.sbatch runs under python -m mpips.launch: kill -9 of a worker on the
    node mid-run; the job ends COMPLETED (exit 0) at its target, the lost rank named."""
    _, text = killed_in_sbatch(tmp_path, "/job:worker/task:2", ("--ntasks=4",))
    assert re.search(r"lost: rank 3 \(/job:worker/task:2, pid \d+ on \S+, last step", text)
    assert "final: global_step 80000" in text and "with 1 rank(s) lost" in text, text


def test_a_ps_killed_in_an_sbatch_job_is_restarted_with_mpips_restarts(slurm, tmp_path):
    """MPIPS_RESTARTS=1: the PS killed mid-run, the run is launched again in the same
    allocation from its latest checkpoint and completes (exit 0)."""
    _, text = killed_in_sbatch(tmp_path, "/job:ps/task:0", ("--ntasks=3",), MPIPS_RESTARTS="1")
    assert "mpips.launch: restart 1 of 1" in text, text
    resumed = text.split("mpips.launch: restart 1 of 1", 1)[1]
    assert re.search(r"restored global_step [1-9]\d*", resumed), resumed
    assert "final: global_step 80000" in resumed, resumed

"""End-to-end runs of `python -m mpips train` under mpiexec (plain pytest only)."""

import re
import time
from pathlib import Path

import pytest
from conftest import (
    RESULT,
    ROOT,
    BackgroundJob,
    need,
    read_result,
    run_mpi,
    run_train,
)
from shared_runs import place_fashion_mnist

from mpips import checkpoint

pytestmark = pytest.mark.launcher

STEP = re.compile(r"^\[/job:worker/task:(\d+)\] step (\d+) ", re.M)
# "the job ends promptly": well before any default deadline (300 s, 600 s), with room for a
# slow start of 3-4 ranks on a loaded 2-core machine
PROMPT = 60


def test_async_digits_converges_with_unique_steps(tmp_path):
    r = run_train(tmp_path, 3, "--log-every", "1")
    assert r.returncode == 0, r.stderr
    res = r.result
    assert res["global_step"] == 600 and res["test_accuracy"] >= 0.90
    steps = [int(s) for _, s in STEP.findall(r.stdout)]
    assert sorted(steps) == list(range(1, 601)), "every global step printed exactly once"
    assert {t for t, _ in STEP.findall(r.stdout)} == {"0", "1"}
    assert "[/job:worker/task:1] train rows [719, 1437) of 1437" in r.stdout
    assert (tmp_path / "runs/default/ckpt-600.json").exists()


def test_resume_continues_the_step_on_another_layout(tmp_path):
    layout = tmp_path / "two_ps.toml"
    layout.write_text("ps = [0, 3]\n")
    first = run_train(tmp_path, 4, "--steps", "150", "--layout", str(layout), "--log-every", "1")
    assert first.returncode == 0, first.stderr
    assert first.result["global_step"] == 150
    second = run_train(tmp_path, 3, "--steps", "300", "--log-every", "1")
    assert second.returncode == 0, second.stderr
    assert "restored global_step 150 from runs/default/ckpt-150.json" in second.stdout
    steps = sorted(int(s) for _, s in STEP.findall(second.stdout))
    assert steps == list(range(151, 301))
    assert second.result["global_step"] == 300
    third = run_train(tmp_path, 3, "--steps", "300")
    assert "already reached train.steps = 300: nothing to train" in third.stdout
    assert third.result["global_step"] == 300 and third.result["updates"] == 0
    fresh = run_train(tmp_path, 3, "--steps", "20", "--no-restore", "--ckpt-dir", "runs/fresh")
    assert "restored" not in fresh.stdout and fresh.result["global_step"] == 20


def assert_clean_error(r, message, code=2):
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert r.stderr.count(message) == 1, r.stderr  # said once, not once per rank
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "layout,message",
    [
        ("ps = [0, 9]\n", "ps rank 9 is out of range for 3 ranks"),
        ("ps = [1, 1]\n", "ps rank 1 is listed more than once"),
        ("ps = [0, 1, 2]\n", "at least one worker"),
        ("ps = 1\nworld_size = 8\n", "world_size = 8, but the job runs on 3 ranks"),
        ("ps = 1\nranks = 3\n", "unknown key 'ranks'"),
        ("ps = [0,\n", "invalid TOML"),
    ],
)
def test_bad_layout_fails_fast_on_every_rank(tmp_path, layout, message):
    (tmp_path / "layout.toml").write_text(layout)
    t0 = time.monotonic()
    r = run_train(tmp_path, 3, "--layout", "layout.toml", timeout=120)
    assert_clean_error(r, message)
    assert time.monotonic() - t0 < PROMPT


def test_bad_job_and_missing_data(tmp_path):
    (tmp_path / "job.toml").write_text(
        '[data]\npath = "nope.h5"\n[train]\nsteps = 5\nbach_size = 3\n'
    )
    assert_clean_error(
        run_train(tmp_path, 3, "job.toml", timeout=90),
        "unknown key 'bach_size' (did you mean 'batch_size'?)",
    )
    (tmp_path / "job.toml").write_text('[data]\npath = "nope.h5"\n[train]\nsteps = 5\n')
    assert_clean_error(
        run_train(tmp_path, 3, "job.toml", timeout=90), "data file nope.h5: not found"
    )
    assert_clean_error(
        run_train(tmp_path, 3, "missing.toml", timeout=90), "job file missing.toml: not found"
    )


def test_corrupt_checkpoint_is_a_clear_error_and_left_alone(tmp_path):
    d = tmp_path / "runs/default"
    assert run_train(tmp_path, 3, "--steps", "50", timeout=60).returncode == 0
    shard = d / "ckpt-50.shard-0-of-1.h5"
    shard.write_bytes(shard.read_bytes()[:3000])  # truncated
    r = run_train(tmp_path, 3, "--steps", "60", timeout=90)
    assert_clean_error(r, "checkpoint runs/default/ckpt-50.json: corrupt or unreadable")
    assert len(shard.read_bytes()) == 3000
    assert checkpoint.latest_checkpoint(d).name == "ckpt-50.json"
    manifest = d / "ckpt-50.json"
    manifest.write_text(manifest.read_text()[:100])  # truncated
    r = run_train(tmp_path, 3, "--steps", "60", timeout=90)
    assert_clean_error(r, "checkpoint runs/default/ckpt-50.json: corrupt or unreadable")
    assert len(manifest.read_text()) == 100


def test_single_process_trains_as_one_replica_and_says_how_to_launch(tmp_path):
    r = run_train(tmp_path, None, "--steps", "50")
    assert r.returncode == 0, r.stderr
    assert "one process (no mpirun): training as a single synchronous replica" in r.stdout
    assert "run under mpirun -n N" in r.stdout
    assert r.result["global_step"] == 50 and r.result["test_accuracy"] is not None


BOOM = """
import sys, mpips
class Boom(mpips.Hook):
    def after_step(self, run, info):
        if run.role.task == 1 and info.local_updates == 5:
            shm = {l.split()[-1] for l in open("/proc/self/maps") if "/dev/shm/mpich_shm_" in l}
            print("runtime shm:", *sorted(shm - {"(deleted)"}), flush=True)
            raise RuntimeError("injected failure")
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.checkpoint.dir, job.train.steps = False, "", 10**9
    mpips.train(job, hooks=[Boom()])
"""


def test_exception_on_one_worker_ends_the_job(tmp_path):
    (tmp_path / "boom.py").write_text(BOOM)
    t0 = time.monotonic()
    r = run_mpi(4, ["boom.py"], cwd=tmp_path, timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert "rank 2 (/job:worker/task:1) failed with RuntimeError: injected failure" in r.stderr
    assert elapsed < PROMPT, elapsed
    # MPICH's node segment (5.x keeps it named until MPI_Finalize) is not left in /dev/shm
    shm = re.search(r"runtime shm:(.*)", r.stdout)
    assert shm, r.stdout[-2000:]
    assert not [p for p in shm[1].split() if Path(p).exists()], shm[1]


@pytest.mark.parametrize(
    "job,target,steps",
    [
        # runs on the 2-core VM, 2026-12-06 (docs/guide/testing.md):
        # the MLP (async, 12 epochs, 11304 steps, 11-16 s): to 5000 steps (9-11 s), where
        # it reached 0.866-0.871 in 6 runs, 0.016 or more above its bar (0.8755 at its end)
        ("fashion_mnist.toml", 0.85, 5000),
        # the MLP in sync mode, deterministic, to the end of its 5 epochs (1170 steps, ~12 s):
        # 0.877 there
        ("fashion_mnist_sync.toml", 0.85, None),
        # the CNN (a model of your own: jobs/cnn.py; ~7500 steps): 0.865-0.883 at 2000 (5
        # runs; as noisy at 2500), 0.875-0.898 at 3500 (where it was held to 0.86), 0.90 at
        # the end (docs/guide/models.md)
        ("cnn_fashion_mnist.toml", 0.85, 2000),
        # PyTorch's MNIST network as it is (jobs/torch_mnist.py; 4000 steps): 0.807-0.822 at
        # 400 (too close), 0.835-0.840 at 500, 0.82-0.84 at 600, 0.91 at the end
        # (docs/performance.md)
        ("torch_fashion_mnist.toml", 0.80, 500),
    ],
)
def test_fashion_mnist_job_reaches_its_target(tmp_path, fashion_mnist, job, target, steps):
    """The shipped jobs, as a user runs them (on the data converted once a session): the
    sync MLP to the end of its epochs, the others to part of their run where their bar
    holds with a margin. The CNN's bar was lowered from 0.86 at 3500 steps to 0.85 at 2000
    (4/7 of the run it had): there it reached 0.865-0.883 in 5 runs, as little as 0.005
    above 0.86, and 0.85 keeps the margin (0.015+) that 0.86 had at 3500 (0.875-0.898)."""
    if job.startswith("torch_"):
        need("torch")
    place_fashion_mnist(fashion_mnist, tmp_path)
    more = ["--steps", str(steps)] if steps else []
    r = run_train(tmp_path, 8, str(ROOT / "jobs" / job), *more, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.result["test_accuracy"] >= target, r.stdout[-3000:]
    assert r.result["global_step"] == (steps or 1170), r.stdout[-3000:]


def test_run_ends_when_every_worker_has_exhausted_its_epochs(tmp_path):
    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nepochs = 2\nbatch_size = 100\nlog_every = 1\n'
    )
    r = run_train(tmp_path, 3, "job.toml")
    assert r.returncode == 0, r.stderr
    # parts of 719 and 718 rows: 8 batches an epoch each (the last one short), 2 epochs
    res = r.result
    assert res["task"] == "/job:worker/task:0" and res["examples"] == 1438
    assert res["total_examples"] == 1438 + 1436
    assert res["global_step"] == 32 and [s["updates"] for s in res["staleness"]] == [16, 16]
    assert sorted(int(s) for _, s in STEP.findall(r.stdout)) == list(range(1, 33))


@pytest.mark.parametrize("mode, ranks, target", [("async", 3, 32), ("sync", 2, 14)])
def test_an_epochs_only_run_knows_its_last_step(tmp_path, mode, ranks, target):
    """The progress total (and ETA) of a run given only train.epochs: async, the workers'
    batches of 719 and 718 rows (8 an epoch each, the last short) x 2; sync, the replicas'
    common full batches (7) x 2. The run ends exactly there."""
    (tmp_path / "job.toml").write_text(
        f'[data]\nbuiltin = "digits"\n[train]\nmode = "{mode}"\nepochs = 2\n'
        "batch_size = 100\nlog_every = 0\n"
    )
    r = run_mpi(ranks, ["-m", "mpips", "train", "--result", "result.json", "job.toml"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    said = r.stdout + r.stderr
    assert f"progress: from global_step 0 of {target}, a line every 30 s" in said, said[-2000:]
    assert read_result(tmp_path)["global_step"] == target


def under_way(tmp_path, ranks, *args):
    """A background job with a periodic checkpoint behind it: training is under way."""
    job = BackgroundJob(tmp_path, ranks, *args)
    job.wait_for("saved checkpoint")
    return job


def signal_and_wait(job, task, sig, within=PROMPT):
    """Send ``sig`` to ``task``; the launcher's exit code, which must come within ``within`` s."""
    import os

    pid = job.pid_of(task)
    t0 = time.monotonic()
    os.kill(pid, sig)
    rc = job.end(within)
    assert time.monotonic() - t0 < within
    return rc


DIED = re.compile(r"mpips: rank (\d+) \(([^,]+), pid (\d+) on \S+\) died without a word")


@pytest.mark.parametrize(
    "victim,args",
    [("/job:worker/task:1", ()), ("/job:ps/task:0", ()), ("/job:ps/task:1", ("--ps", "2"))],
)
def test_kill_9_of_a_worker_or_ps_ends_the_job_naming_it(tmp_path, victim, args):
    """MPICH's launcher SIGKILLs the other ranks and names a PID of its choosing (often rank
    0's or 1's); the node's watcher names the rank that died, its task and pid, once."""
    import signal

    # one checkpoint line every 2 s: MPICH's proxy ends the job at the first output line
    # after a rank's death, so with the default's line every few dozen ms the watcher (woken
    # first) could still lose that race on 2 busy cores (docs/guide/failures.md)
    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nsteps = 1000000000\n'
        '[checkpoint]\ndir = "ckpt"\nevery_secs = 2.0\n'
    )
    job = under_way(tmp_path, 4, "job.toml", *args)
    rank, pid = job.rank_and_pid(victim)
    rc = signal_and_wait(job, victim, signal.SIGKILL)
    assert rc != 0
    text = job.text()
    assert "signal 9" in text  # said by the launcher
    assert DIED.findall(text) == [(str(rank), victim, str(pid))], text[-3000:]


@pytest.mark.parametrize(
    "victim,sig", [("/job:worker/task:1", "SIGUSR1"), ("/job:ps/task:0", "SIGTERM")]
)
def test_preemption_signal_checkpoints_and_resume_continues(tmp_path, victim, sig):
    import signal

    job = under_way(tmp_path, 4, "--steps", str(10**9), "--result", RESULT)
    assert signal_and_wait(job, victim, getattr(signal, sig)) == 3
    res = read_result(tmp_path)
    assert res and res["stopped_by"] == sig, job.text()[-3000:]
    step = res["global_step"]
    assert f"stopped early by {sig}: checkpoint at global_step {step} in runs/default" in job.text()
    assert (tmp_path / f"runs/default/ckpt-{step}.json").exists()
    again = run_train(tmp_path, 3, "--steps", str(step + 50))
    assert again.returncode == 0, again.stderr
    assert f"restored global_step {step}" in again.stdout
    assert again.result["global_step"] == step + 50 and again.result["stopped_by"] is None


def test_preemption_in_sync_mode(tmp_path):
    import signal

    (tmp_path / "sync.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nmode = "sync"\nsteps = 1000000000\n'
        '[checkpoint]\ndir = "runs/sync"\nevery_steps = 100\n'
    )
    job = under_way(tmp_path, 3, "sync.toml", "--result", RESULT)
    assert signal_and_wait(job, "/job:worker/task:2", signal.SIGUSR1) == 3
    res = read_result(tmp_path)
    assert res and res["stopped_by"] == "SIGUSR1", job.text()[-3000:]
    step = res["global_step"]
    assert f"stopped early by SIGUSR1: checkpoint at global_step {step} in runs/sync" in job.text()
    assert (tmp_path / f"runs/sync/ckpt-{step}.json").exists()


STUCK = """
import time
from mpi4py import MPI
import mpips
with mpips.abort_on_error():
    if MPI.COMM_WORLD.rank == {rank}:
        time.sleep(1000)  # a rank that never starts its loop
    mpips.train(mpips.load_job(None))
"""


@pytest.mark.parametrize(
    "rank,message",
    [
        (2, "error on rank 0: rank(s) 2 did not reach start-up within 2 s"),
        # rank 0 itself stuck: rank 1 gives up, naming it (the others would later)
        (0, "error on rank 1: rank 0 did not confirm within 7 s that every rank reached start-up"),
    ],
)
def test_a_rank_that_never_starts_ends_the_job(tmp_path, rank, message):
    (tmp_path / "stuck.py").write_text(STUCK.format(rank=rank))
    t0 = time.monotonic()
    r = run_mpi(4, ["stuck.py"], cwd=tmp_path, timeout=120, MPIPS_START_TIMEOUT="2")
    assert r.returncode != 0 and r.stderr.count(message) == 1, r.stderr
    assert time.monotonic() - t0 < PROMPT


HANG = """
import time, mpips
class Hang(mpips.Hook):
    def after_step(self, run, info):
        if run.role.task == {task} and info.local_updates == 5:
            time.sleep(1000)  # alive but hung mid-run: MPI cannot tell
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.checkpoint.dir = False, ""
    job.optimizer.kind = "{kind}"
    job.train.max_staleness = {bound}
    job.train.mode = "{mode}"
    mpips.train(job, hooks=[Hang()])
"""


@pytest.mark.parametrize(
    "task,kind,bound,mode,said",
    [
        (1, "sgd", None, "async", "/job:worker/task:1 (rank 2) made no update for 3 s"),
        (0, "adam", 2, "async", "/job:worker/task:0 (rank 1) made no update for 3 s"),
        (2, "sgd", None, "sync", "the step's agreement did not complete within 3 s"),
    ],
)
def test_a_worker_hung_mid_run_ends_the_job(tmp_path, task, kind, bound, mode, said):
    """The others finish (or wait for the slowest, bounded staleness, or for the replica
    in the next collective) and notice it: said once, exit 1."""
    (tmp_path / "hang.py").write_text(HANG.format(task=task, kind=kind, bound=bound, mode=mode))
    t0 = time.monotonic()
    r = run_mpi(4, ["hang.py"], cwd=tmp_path, timeout=120, MPIPS_STALL_TIMEOUT="3")
    assert r.returncode == 1, r.stderr
    assert r.stderr.count(said) == 1, r.stderr
    assert time.monotonic() - t0 < PROMPT

"""mode = "sync": W replicas with batch b equal one process with batch W*b; replicas stay
bitwise identical; the divergence check fires; shutdown never hangs (plain pytest)."""

import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import clean_env, mpiexec_path, run_mpi, run_train
from test_optimizers_mpi import read_ckpt

from mpips.data.batches import batches, load_split, open_dataset, resolve_path, worker_rows
from mpips.job import parse_job
from mpips.models.mlp import MLP
from mpips.optim import build_optimizer, clip_by_global_norm, learning_rate

pytestmark = pytest.mark.launcher

JOB = """
[model]
hidden = [16]
[data]
builtin = "digits"
[optimizer]
kind = "{kind}"
learning_rate = {lr}
clip_norm = {clip}
[train]
mode = "sync"
steps = {steps}
batch_size = 16
seed = 5
log_every = 1
progress = false
check_every = {check}
bucket_bytes = {bucket_bytes}
[checkpoint]
dir = "runs/ckpt"
"""
LR = {"sgd": 0.1, "momentum": 0.05, "adam": 0.01}
CRC = re.compile(r"\[/job:worker/task:(\d+)\] done: .*replica crc32 ([0-9a-f]{8})")


def write_job(tmp_path, kind="sgd", steps=20, check=5, bucket_bytes=1 << 20, clip=0.0):
    text = JOB.format(
        kind=kind, lr=LR[kind], steps=steps, check=check, bucket_bytes=bucket_bytes, clip=clip
    )
    (tmp_path / "job.toml").write_text(text)
    return parse_job(text)


def one_process(job, workers, steps):
    """One process, batch W*b: the concatenation of what the W replicas see each step."""
    info = open_dataset(resolve_path("", "digits"))
    b = job.train.batch_size
    shards = [worker_rows(info.rows["train"], workers, k) for k in range(workers)]
    per_epoch = min((stop - start) // b for start, stop in shards)
    streams = [
        batches(*load_split(info, "train", rows), b, job.train.seed, k, per_epoch=per_epoch)
        for k, rows in enumerate(shards)
    ]
    model = MLP([64, *job.model.hidden, 10])
    params = model.initial_values(job.model.init_seed)
    opt = build_optimizer(job.optimizer)
    slots = {k: opt.init_slots(v) for k, v in params.items()}
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    for step in range(steps):
        parts = [next(s) for s in streams]
        x = np.concatenate([p[1] for p in parts])
        y = np.concatenate([p[2] for p in parts])
        model.loss_and_grads(params, x, y, grads)
        clip_by_global_norm(list(grads.values()), job.optimizer.clip_norm)
        for k in params:
            opt.apply(params[k], grads[k], slots[k], learning_rate(job.optimizer, step), step + 1)
    return params, slots


MESSAGES = {"MPIPS_SHARED_MEMORY": "0"}  # the replicas exchange messages, as across nodes
SAYS = {
    "shared": "updated in node shared memory",
    "messages": "updated through Ireduce_scatter and Iallgatherv",
}


@pytest.mark.parametrize(
    ("kind", "workers", "bucket_bytes", "clip", "memory"),
    [
        *[(k, w, 1 << 20, 0.0, "shared") for k in ("sgd", "momentum", "adam") for w in (2, 3)],
        ("sgd", 2, 1 << 20, 0.0, "messages"),
        ("adam", 3, 1 << 20, 0.0, "messages"),
        # 16 buckets: matrices cut between rows, parts that cut variables; the replicas'
        # losses alone
        ("adam", 3, 300, 0.0, "shared"),
        ("adam", 3, 300, 0.0, "messages"),
        # the norm is summed over the replicas' parts
        ("momentum", 3, 300, 0.2, "shared"),
        ("momentum", 3, 300, 0.2, "messages"),
    ],
)
def test_w_replicas_equal_one_process_with_w_times_the_batch(
    tmp_path, kind, workers, bucket_bytes, clip, memory
):
    """Each replica updates its part of every bucket (in the node's shared memory, or sent
    to the others); the variables and the optimizer slots (collected from their owners into
    the chief's checkpoint) are those of one process."""
    job = write_job(tmp_path, kind, bucket_bytes=bucket_bytes, clip=clip)
    r = run_train(tmp_path, workers, "job.toml", **(MESSAGES if memory == "messages" else {}))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(SAYS[memory]) == workers, r.stdout
    res = r.result
    assert res["global_step"] == 20 and res["updates"] == 20, (
        "global_step advanced once per aggregated step"
    )
    assert res["total_examples"] == 20 * 16 * workers, "every replica made every step"
    done = CRC.findall(r.stdout)
    assert sorted(t for t, _ in done) == [str(k) for k in range(workers)]
    assert len({crc for _, crc in done}) == 1, "replicas are bitwise identical"
    steps = [int(s) for s in re.findall(r"\] step (\d+) loss", r.stdout)]
    assert steps == list(range(1, 21)), "each step said once (by the chief)"
    clocks = assert_one_process(tmp_path, job, workers)
    assert clocks == [20] * workers


def assert_one_process(tmp_path, job, workers):
    """The chief's checkpoint at step 20 (variables, and slots collected from their owners)
    equals one process with W x the batch; returns its clocks."""
    variables, slots, clocks = read_ckpt(tmp_path / "runs/ckpt/ckpt-20.json")
    want, want_slots = one_process(job, workers, 20)
    for name, value in want.items():
        np.testing.assert_allclose(variables[name], value, rtol=2e-4, atol=2e-6, err_msg=name)
    for name, per in want_slots.items():
        for slot, value in per.items():
            np.testing.assert_allclose(slots[f"{name}/{slot}"], value, rtol=2e-4, atol=2e-6)
    return clocks


BLOCKS = """
import mpips
from mpips import layers
layers.BLOCK_BYTES = 256  # every kernel written in blocks of a few rows
with mpips.abort_on_error():
    mpips.train(mpips.load_job("job.toml"))
"""


def test_kernels_written_in_blocks_train_as_one_process(tmp_path):
    """Across nodes: kernels written in blocks of rows (``ready(name, rows)``), which
    buckets of 300 bytes cut; each bucket starts on its own rows, and the replicas still
    train exactly as one process with W x the batch."""
    job = write_job(tmp_path, "adam", bucket_bytes=300)
    (tmp_path / "blocks.py").write_text(BLOCKS)
    r = run_mpi(3, ["blocks.py"], cwd=tmp_path, **MESSAGES)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(SAYS["messages"]) == 3, r.stdout
    assert_one_process(tmp_path, job, 3)


PERTURB = """
import mpips
class Perturb(mpips.Hook):
    def after_step(self, run, info):
        if run.role.task == {task} and info.step == {step}:
            run.params["dense_0/bias"][0] += 1e-3
with mpips.abort_on_error():
    mpips.train(mpips.load_job("job.toml"), hooks=[Perturb()])
"""


# one bucket of 1,211 values, last layer first: dense_0/bias lies in task 0's part (0-415).
# Messages only: with one copy in shared memory the replicas' CRCs are equal by definition.
@pytest.mark.parametrize("task", [0, 1], ids=["its-owner", "another-replica"])
def test_a_change_outside_the_update_is_overwritten_or_shared_by_the_next(tmp_path, task):
    """With a copy per replica, every part of every variable is updated by one replica and
    copied to the others: a replica's own change between steps is undone (a part another
    replica owns) or reaches every replica (its own part) at the next step, so the replicas
    cannot drift apart."""
    write_job(tmp_path, "sgd", steps=40, check=10)
    (tmp_path / "perturb.py").write_text(PERTURB.format(task=task, step=7))
    r = run_mpi(3, ["perturb.py"], cwd=tmp_path, **MESSAGES)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(SAYS["messages"]) == 3, r.stdout
    done = CRC.findall(r.stdout)
    assert len(done) == 3 and len({crc for _, crc in done}) == 1, r.stdout


def test_divergence_check_fires_when_a_replica_is_perturbed(tmp_path):
    """After the last step nothing repairs a change: the final check sees it (each replica
    holding its own copy, as across nodes)."""
    write_job(tmp_path, "sgd", steps=40, check=10)
    (tmp_path / "perturb.py").write_text(PERTURB.format(task=1, step=40))
    r = run_mpi(3, ["perturb.py"], cwd=tmp_path, **MESSAGES)
    assert r.returncode == 1, (r.returncode, r.stderr)
    message = "replicas diverged at global_step 40: the variables of worker task(s) 1 differ"
    assert r.stderr.count(message) == 1, r.stderr
    assert "Traceback" not in r.stderr


BOOM = """
import mpips
class Boom(mpips.Hook):
    def after_step(self, run, info):
        if run.role.task == 2 and info.step == 9:
            raise RuntimeError("injected failure")
with mpips.abort_on_error():
    mpips.train(mpips.load_job("job.toml"), hooks=[Boom()])
"""


def test_a_worker_raising_mid_run_ends_the_job(tmp_path):
    write_job(tmp_path, "sgd", steps=10**6)
    (tmp_path / "boom.py").write_text(BOOM)
    t0 = time.monotonic()
    r = run_mpi(3, ["boom.py"], cwd=tmp_path, timeout=60)
    assert r.returncode != 0
    assert "rank 2 (/job:worker/task:2) failed with RuntimeError: injected failure" in r.stderr
    assert time.monotonic() - t0 < 60  # promptly, even on a loaded machine


def test_ps_ranks_in_sync_mode_just_wait_and_resume_works(tmp_path):
    write_job(tmp_path, "adam", steps=10)
    (tmp_path / "layout.toml").write_text("ps = 1\n")
    r = run_train(tmp_path, 3, "job.toml", "--layout", "layout.toml")
    assert r.returncode == 0, r.stderr
    # two replicas (worker tasks 0 and 1) made the 10 steps; the PS rank trained nothing
    assert r.result["global_step"] == 10 and r.result["total_examples"] == 10 * 16 * 2
    assert {t for t, _ in CRC.findall(r.stdout)} == {"0", "1"}
    write_job(tmp_path, "adam", steps=16)
    r = run_train(tmp_path, 2, "job.toml")
    assert r.returncode == 0, r.stderr
    assert "restored global_step 10" in r.stdout and "resuming at batch 10" in r.stdout
    assert r.result["global_step"] == 16 and r.result["updates"] == 6


KEEP = """
import numpy as np
import mpips
class Keep(mpips.Hook):
    def end(self, run):
        self.params = run.params
keep = Keep()
with mpips.abort_on_error():
    mpips.train(mpips.load_job("job.toml"), hooks=[keep])
    from mpi4py import MPI  # a file per rank: their prints may interleave
    with open(f"kept-{MPI.COMM_WORLD.rank}.txt", "w") as f:
        f.write(repr(float(sum(np.sum(v) for v in keep.params.values()))))
"""


def test_params_kept_by_a_hook_outlive_the_shared_memory(tmp_path):
    """The replicas' shared memory is freed at the end of the run: ``run.params`` then holds
    copies, so a hook that keeps it reads the final variables, not freed memory."""
    write_job(tmp_path, "sgd", steps=5)
    (tmp_path / "keep.py").write_text(KEEP)
    r = run_mpi(2, ["keep.py"], cwd=tmp_path)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.count(SAYS["shared"]) == 2, r.stdout
    variables, _, _ = read_ckpt(tmp_path / "runs/ckpt/ckpt-5.json")
    want = float(sum(np.sum(v) for v in variables.values()))
    sums = [float((tmp_path / f"kept-{rank}.txt").read_text()) for rank in (0, 1)]
    assert sums == pytest.approx([want, want], rel=1e-6), r.stdout


SMALL_SHM = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)
def test_too_little_shared_memory_means_messages_not_a_crash(tmp_path):
    """With /dev/shm as small as a container's (64 MB), a model whose replicas' gradients,
    variables and slots do not fit trains over messages, and the chief says why."""
    (tmp_path / "job.toml").write_text(
        JOB.format(kind="adam", lr=0.01, clip=0.0, steps=3, check=5, bucket_bytes=1 << 20).replace(
            "hidden = [16]", "hidden = [2048, 2048]"
        )
    )
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", SMALL_SHM, "sh", "true"], capture_output=True
    )
    if probe.returncode:
        pytest.skip(f"cannot mount a small /dev/shm here: {probe.stderr[-200:]!r}")
    argv = ["-m", "mpips", "train", "--no-progress", "job.toml"]
    cmd = ["unshare", "-m", "sh", "-c", SMALL_SHM, "sh", mpiexec_path(), "-n", "2"]
    r = subprocess.run(
        [*cmd, sys.executable, *argv],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "/dev/shm has" in r.stdout and "exchanging messages instead" in r.stdout
    assert r.stdout.count(SAYS["messages"]) == 2, r.stdout

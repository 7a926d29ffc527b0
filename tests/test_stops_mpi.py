"""How runs end when something goes wrong, end to end under mpiexec (plain pytest only):
every wait has a deadline that names the task that did not arrive, idle waits sleep, every
rank honours preemption (SIGINT too), a loss that is not finite stops the job, and a
checkpoint directory that cannot be used is found before training."""

import json
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import BackgroundJob, run_mpi, run_py

from mpips import checkpoint, modes
from mpips.errors import ConfigError
from mpips.job import parse_job
from mpips.run.report import loss_not_finite

pytestmark = pytest.mark.launcher

# "the job ends promptly" means well before any default deadline (300 s and 600 s), with
# room for a slow start of 3-4 ranks on a loaded 2-core machine
PROMPT = 60


def ended_once(r, said, code):
    """The job exited with ``code`` and ``said`` appears exactly once, with one error line."""
    assert r.returncode == code, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert r.stderr.count(said) == 1, r.stderr[-3000:]
    assert r.stderr.count("mpips: error") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]


PATCHED = """
import sys, time
from mpi4py import MPI
import mpips
{patch}
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.train.log_every = False, 0
    job.train.steps, job.checkpoint.every_steps = {steps}, {every}
    job.train.zero_copy = {zero_copy}
    mpips.train(job)
"""


def run_patched(tmp_path, ranks, patch, steps=300, every=50, zero_copy=None, **env):
    text = PATCHED.format(patch=patch, steps=steps, every=every, zero_copy=zero_copy)
    (tmp_path / "job.py").write_text(text)
    t0 = time.monotonic()
    r = run_mpi(ranks, ["job.py"], cwd=tmp_path, timeout=120, **env)
    return r, time.monotonic() - t0


NOT_WRITTEN = "/job:ps/task:0 (rank 0) did not write its shard of the checkpoint at global_step"


@pytest.mark.parametrize(
    ("zero_copy", "snapshot", "said"),
    [
        (False, 0.25, NOT_WRITTEN),
        # the default on one node: zero copy, the PS holds its stripe locks while it copies
        # its memory, then writes the copy with the workers training on
        (None, 0.25, NOT_WRITTEN),
        # where no copy fits, it holds them while it writes
        (
            None,
            0.0,
            "a stripe of PS memory has been locked by /job:ps/task:0 (writing its checkpoint",
        ),
    ],
)
def test_a_ps_hung_in_a_shard_write_is_named(tmp_path, zero_copy, snapshot, said):
    """The chief's wait for checkpoint shards has a deadline and names the PS task (with
    zero copy and no room for a copy, the workers' wait for the stripe locks the PS holds
    while it writes); the other worker's watchdog does not blame the chief instead."""
    patch = f"""
import mpips.store.server
mpips.store.server.SNAPSHOT_SHARE = {snapshot}
import mpips.checkpoint as ck
real = ck.write_shard
def write_shard(d, step, shard, num_shards, *a, **k):
    if step > 0 and MPI.COMM_WORLD.rank == 0:
        time.sleep(1000)  # a PS hung in its shard write (a hung file system)
    return real(d, step, shard, num_shards, *a, **k)
ck.write_shard = write_shard
"""
    r, took = run_patched(tmp_path, 3, patch, zero_copy=zero_copy, MPIPS_STALL_TIMEOUT="3")
    ended_once(r, said, 1)
    assert took < PROMPT


def test_a_chief_that_never_raises_ready_is_named(tmp_path):
    patch = """
from mpips.store.control import RunControl
def raise_ready(self):
    time.sleep(1000)  # the chief stuck while initialising
RunControl.raise_ready = raise_ready
"""
    r, took = run_patched(tmp_path, 4, patch, MPIPS_START_TIMEOUT="3")
    ended_once(r, "/job:worker/task:0 (rank 1) (the chief) did not raise the ready flag within", 1)
    assert took < PROMPT


@pytest.mark.parametrize(
    "rank,said",
    [
        (2, "rank(s) 2 did not reach window creation within 3 s"),
        (0, "rank 0 did not confirm within 8 s that every rank reached window creation"),
    ],
)
def test_a_rank_stuck_before_window_creation_is_named(tmp_path, rank, said):
    """Window creation is a blocking collective: every rank checks in first, so a rank that
    never gets there is named and nobody is left inside MPI_Win_allocate."""
    patch = f"""
from mpips.store import window
real = window.Windows.__init__
def init(self, comm, *a, **k):
    if comm.rank == {rank}:
        time.sleep(1000)
    real(self, comm, *a, **k)
window.Windows.__init__ = init
"""
    r, took = run_patched(tmp_path, 3, patch, MPIPS_START_TIMEOUT="3")
    assert r.returncode != 0 and said in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert took < PROMPT


SAMPLER = """
import os, threading, time
from mpi4py import MPI
def sample(path):
    while True:  # this process's CPU seconds and the wall clock, 5 times a second
        with open(path, "a") as f:
            f.write(f"{time.monotonic()} {time.process_time()}\\n")
        time.sleep(0.2)
threading.Thread(target=sample, args=(f"cpu-{MPI.COMM_WORLD.rank}.txt",), daemon=True).start()
import mpips
class Hang(mpips.Hook):
    def after_step(self, run, info):
        if run.role.task == 2 and info.local_updates == 5:
            open("hang.txt", "w").write(str(time.monotonic()))
            time.sleep(1000)
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.checkpoint.dir, job.train.mode = False, "", "sync"
    mpips.train(job, hooks=[Hang()])
"""


def test_replicas_waiting_on_a_hung_peer_sleep(tmp_path):
    """A replica waiting in a collective for a hung one must not burn a core for the whole
    stall timeout: each waiting rank uses under 10% of a core while it waits."""
    (tmp_path / "hang.py").write_text(SAMPLER)
    r = run_mpi(4, ["hang.py"], cwd=tmp_path, timeout=120, MPIPS_STALL_TIMEOUT="6")
    assert r.returncode == 1 and "did not complete within 6 s" in r.stderr, r.stderr[-3000:]
    hung_at = float((tmp_path / "hang.txt").read_text())
    for rank in (0, 1, 3):  # rank 2 is the hung replica (sync mode: no PS)
        samples = [
            tuple(map(float, line.split()))
            for line in (tmp_path / f"cpu-{rank}.txt").read_text().splitlines()
        ]
        waiting = [(t, cpu) for t, cpu in samples if t > hung_at + 1.0]
        assert len(waiting) >= 10, samples[-5:]
        (t0, c0), (t1, c1) = waiting[0], waiting[-1]
        share = (c1 - c0) / (t1 - t0)
        assert share < 0.10, f"rank {rank} used {share:.0%} of a core while waiting"


SYNC_JOB = (
    '[data]\nbuiltin = "digits"\n[train]\nmode = "sync"\nsteps = 1000000000\n'
    '[checkpoint]\ndir = "runs/sync"\nevery_steps = 100\n'
)


def test_a_signal_on_a_ps_rank_in_sync_mode_stops_the_job_with_exit_3(tmp_path):
    """PS ranks in sync mode hold nothing, but a signal there stops the whole job like one on
    a replica: a checkpoint, and exit code 3 from every rank."""
    (tmp_path / "sync.toml").write_text(SYNC_JOB)
    (tmp_path / "layout.toml").write_text("ps = 1\n")
    job = BackgroundJob(tmp_path, 3, "sync.toml", "--layout", "layout.toml")
    ps = job.pid_of("/job:ps/task:0")
    job.wait_for(r"saved checkpoint")  # training is under way
    import os

    os.kill(ps, signal.SIGTERM)
    assert job.end() == 3, job.text()[-3000:]
    m = re.search(r"stopped early by SIGTERM: checkpoint at global_step (\d+)", job.text())
    assert m and (tmp_path / f"runs/sync/ckpt-{m.group(1)}.json").exists(), job.text()[-3000:]


def test_ctrl_c_checkpoints_and_exits_3_like_sigterm(tmp_path):
    """Ctrl-C reaches mpiexec, which forwards SIGINT to every rank: the same clean stop as
    SIGTERM (a checkpoint, exit 3), and the rerun resumes from it."""
    job = BackgroundJob(tmp_path, 3, "--steps", str(10**9))
    job.wait_for(r"saved checkpoint")
    job.proc.send_signal(signal.SIGINT)
    assert job.end() == 3, job.text()[-3000:]
    step = int(job.wait_for(r"stopped early by SIGINT: checkpoint at global_step (\d+)").group(1))
    assert (tmp_path / f"runs/default/ckpt-{step}.json").exists()
    again = run_mpi(
        3, ["-m", "mpips", "train", "--no-progress", "--steps", str(step + 20)], cwd=tmp_path
    )
    assert again.returncode == 0 and f"restored global_step {step}" in again.stdout, again.stderr


TWICE = """
import os, signal, sys, time
from mpips.process import preemption
preemption.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
os.kill(os.getpid(), signal.SIGINT)  # the same request again, as GNU timeout makes it
time.sleep(0.05)
print("alive", preemption.requested(), flush=True)
time.sleep(preemption.DUPLICATE_SECONDS + 1)
os.kill(os.getpid(), signal.SIGTERM)  # a second request: the default action, at once
time.sleep(10)
print("not ended", flush=True)
"""

STUCK = """
import os, signal, threading, time
import numpy as np
from mpi4py import MPI
from mpips.process import preemption
preemption.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
print("asked", preemption.requested(), flush=True)

def again():
    time.sleep(preemption.DUPLICATE_SECONDS + 1)
    os.kill(os.getpid(), signal.SIGINT)  # a second request while the main thread is in C

threading.Thread(target=again, daemon=True).start()
MPI.COMM_WORLD.Recv(np.empty(1), source=0, tag=7)  # blocks in MPI: no Python handler runs
print("not ended", flush=True)
"""


def test_a_repeated_signal_is_one_request_and_a_later_one_ends_the_process(tmp_path):
    """Two signals within DUPLICATE_SECONDS are one request (GNU timeout signals mpirun and
    its process group, so each rank got SIGTERM twice, and died of the second in 2 of 6
    runs, losing the checkpoint); one after that ends the process at once."""
    (tmp_path / "twice.py").write_text(TWICE)
    began = time.monotonic()
    r = run_py(["twice.py"], tmp_path, timeout=30)
    assert r.stdout == f"alive {int(signal.SIGTERM)}\n", (r.stdout, r.stderr)
    assert r.returncode == -signal.SIGTERM and time.monotonic() - began < 9, r
    # stuck in C (a blocking MPI receive): the later request still ends the process
    (tmp_path / "stuck.py").write_text(STUCK)
    r = run_py(["stuck.py"], tmp_path, timeout=30)
    assert r.stdout == f"asked {int(signal.SIGTERM)}\n", (r.stdout, r.stderr)
    assert r.returncode == -signal.SIGINT, r


NOTEBOOK = """
import os, signal, time
import mpips
from mpips.process import preemption
before = {s: signal.getsignal(s) for s in preemption.SIGNALS}

class CtrlC(mpips.Hook):
    def begin(self, run):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C in a notebook, during a run

job = mpips.load_job(None)
job.train.progress, job.train.steps = False, 5
result = mpips.train(job, hooks=[CtrlC()])
print("stopped by", result.stopped_by, flush=True)
assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
first = preemption.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.05)
second = preemption.install()  # a run at once after: the first request's watch is over
time.sleep(preemption.DUPLICATE_SECONDS + 0.5)
os.kill(os.getpid(), signal.SIGUSR1)  # the second run's first request, not a death
time.sleep(0.05)
print("second run asked by", preemption.requested(), flush=True)
preemption.restore(second)
preemption.restore(first)
assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == before
"""


def test_a_run_gives_the_callers_signal_handlers_back(tmp_path):
    """mpips.train in a script or notebook: Ctrl-C during the run stops it (a checkpoint);
    after the run Ctrl-C raises KeyboardInterrupt again, as before it. A run started
    within a second of an earlier request is not killed by that request's timer."""
    (tmp_path / "notebook.py").write_text(NOTEBOOK)
    r = run_py(["notebook.py"], tmp_path, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [line for line in r.stdout.splitlines() if not line.startswith("[")] == [
        f"stopped by {int(signal.SIGINT)}",
        "KeyboardInterrupt",
        f"second run asked by {int(signal.SIGUSR1)}",
    ], (r.stdout, r.stderr[-3000:])


def test_sigterm_to_gnu_timeout_around_mpirun_checkpoints_and_exits_3(tmp_path):
    """``timeout 60 mpirun ...`` sent SIGTERM (a scheduler's or a user's): the clean stop."""
    job = BackgroundJob(tmp_path, 3, "--steps", str(10**9), wrap=("timeout", "60"))
    job.wait_for(r"saved checkpoint")
    job.proc.send_signal(signal.SIGTERM)
    assert job.end() == 3, job.text()[-3000:]
    job.wait_for(r"stopped early by SIGTERM: checkpoint at global_step \d+")


FIRST = """
import os, signal, sys, mpips
class Preempt(mpips.Hook):
    def begin(self, run):
        os.kill(os.getpid(), signal.SIGUSR1)  # every worker, before its first update
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress = False
    result = mpips.train(job, hooks=[Preempt()])
sys.exit(3 if result.stopped_by else 0)
"""


def test_preempted_before_the_first_update_names_no_checkpoint(tmp_path):
    (tmp_path / "first.py").write_text(FIRST)
    r = run_mpi(3, ["first.py"], cwd=tmp_path, timeout=90)
    assert r.returncode == 3, r.stderr[-3000:]
    assert "stopped early by SIGUSR1: no update was made, so there is no checkpoint" in r.stdout
    assert "checkpoint at global_step" not in r.stdout
    assert not checkpoint.list_checkpoints(tmp_path / "runs/default")


EARLY_PS_SIGNAL = """
import os, signal, sys, time
from mpi4py import MPI
import mpips
from mpips.store.control import RunControl
real_wait, real_set = RunControl.wait_ready, RunControl.set_counters
def wait_ready(self, *a, **k):
    if MPI.COMM_WORLD.rank == 0:  # the PS task: signalled while the chief initialises
        os.kill(os.getpid(), signal.SIGTERM)
    return real_wait(self, *a, **k)
def set_counters(self, *a, **k):
    time.sleep(3)  # a slow restore: the PS has asked to stop before the counters are set
    return real_set(self, *a, **k)
RunControl.wait_ready, RunControl.set_counters = wait_ready, set_counters
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.train.steps = False, 100000
    result = mpips.train(job)
sys.exit(3 if result.stopped_by else 0)
"""


def test_a_signal_on_a_ps_before_the_chief_is_ready_is_kept(tmp_path):
    """The chief setting the counters must not wipe a stop a PS task asked for earlier."""
    (tmp_path / "early.py").write_text(EARLY_PS_SIGNAL)
    r = run_mpi(3, ["early.py"], cwd=tmp_path, timeout=90)
    assert r.returncode == 3, (r.stdout[-2000:], r.stderr[-3000:])
    assert "stopped early by SIGTERM: no update was made" in r.stdout, r.stdout[-2000:]


DIVERGE = """
[model]
hidden = [64, 64]        # with lr 1e30 the second layer overflows float32 at once
[data]
builtin = "digits"
[optimizer]
learning_rate = {lr}
[train]
mode = "{mode}"
steps = 100000
batch_size = 16
log_every = 0
progress = false
[checkpoint]
dir = "runs/nan"
every_steps = {every}
"""


@pytest.mark.parametrize(
    "mode,ranks,every", [("async", 4, 0), ("sync", 3, 0), ("async", 4, 3), ("sync", 3, 3)]
)
def test_a_loss_that_is_not_finite_stops_the_job(tmp_path, mode, ranks, every):
    """TensorFlow's NanTensorHook: a learning rate of 1e30 makes the loss NaN or infinite (1e6
    did only most of the time: the ReLUs can all die, leaving a huge loss that stays finite); the
    job stops at once with one message naming the worker and the global step (exit 1), and
    no committed checkpoint holds a non-finite value. The loss check speaks, with or
    without periodic checkpoints in the diverging run (every = 3 or 0): a step's loss is
    checked before that step can reach a checkpoint, so the checkpoint guard (tested in
    test_hostile_files.py) is only a second line and must not be the one that stops it."""
    # first a sane run commits checkpoints, then the diverging one restores and goes on
    (tmp_path / "job.toml").write_text(DIVERGE.format(mode=mode, lr=0.01, every=3))
    sane = run_mpi(
        ranks, ["-m", "mpips", "train", "job.toml", "--steps", "12"], cwd=tmp_path, timeout=120
    )
    (tmp_path / "job.toml").write_text(DIVERGE.format(mode=mode, lr=1e30, every=every))
    assert sane.returncode == 0, sane.stderr[-3000:]
    r = run_mpi(ranks, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path, timeout=120)
    assert r.returncode == 1, (r.returncode, r.stderr[-3000:])
    assert r.stderr.count("mpips: error") == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert re.search(
        r"the loss of /job:worker/task:\d+ is (nan|inf|-inf|not finite) at "
        r"global_step \d+: training stopped",
        r.stderr,
    ), r.stderr[-3000:]
    committed = checkpoint.list_checkpoints(tmp_path / "runs/nan")
    assert committed
    for _, manifest in committed:
        variables, slots = checkpoint.Checkpoint(manifest).read_all()
        for name, value in {**variables, **slots}.items():
            assert np.isfinite(value).all(), f"{manifest.name}: {name} is not finite"


@pytest.mark.parametrize("mode", ["async", "sync", "sync_replicas", "hybrid"])
def test_the_nan_message_suggests_clip_norm_only_where_the_mode_takes_it(mode):
    """Its advice must be one the job can follow: sync_replicas and hybrid refuse
    optimizer.clip_norm, so there it only says to lower the learning rate."""
    try:
        modes.check_job(
            parse_job(f'[train]\nmode = "{mode}"\nsteps = 5\n[optimizer]\nclip_norm = 1.0\n')
        )
        takes = True
    except ConfigError as e:
        assert "optimizer.clip_norm" in str(e)
        takes = False
    said = loss_not_finite(1, float("nan"), 7, modes.MODES[mode].takes_clip_norm)
    assert "task:1 is nan at global_step 7" in said and "optimizer.learning_rate" in said
    assert ("clip_norm" in said) == takes, said


def test_a_checkpoint_dir_that_cannot_be_written_is_found_before_training(tmp_path):
    (tmp_path / "afile").write_text("not a directory")
    r = run_mpi(
        3,
        ["-m", "mpips", "train", "--no-progress", "--ckpt-dir", "afile/ck"],
        cwd=tmp_path,
        timeout=60,
    )
    ended_once(r, "checkpoint.dir afile/ck: cannot write checkpoints there", 2)
    assert "train rows [" not in r.stdout and "step" not in r.stdout  # nothing trained


def test_a_fresh_start_never_mixes_with_another_run(tmp_path):
    """--no-restore into a directory holding another run's checkpoints is refused (naming
    the directory and its latest step, and how to go on), changing nothing."""
    first = run_mpi(3, ["-m", "mpips", "train", "--no-progress", "--steps", "250"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    d = tmp_path / "runs/default"
    before = {str(p): p.read_bytes() for p in d.rglob("*") if p.is_file()}  # summaries too
    assert any("metrics.jsonl" in name for name in before)
    r = run_mpi(
        3,
        ["-m", "mpips", "train", "--no-progress", "--steps", "100", "--no-restore"],
        cwd=tmp_path,
        timeout=60,
    )
    ended_once(
        r,
        "checkpoint.dir runs/default already holds 2 checkpoint(s) of an earlier run, "
        "the latest at global_step 250",
        2,
    )
    assert "--ckpt-dir" in r.stderr
    assert {str(p): p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    fresh = run_mpi(
        3,
        [
            "-m",
            "mpips",
            "train",
            "--no-progress",
            "--steps",
            "100",
            "--no-restore",
            "--ckpt-dir",
            "runs/other",
        ],
        cwd=tmp_path,
    )
    assert fresh.returncode == 0 and "final: global_step 100" in fresh.stdout, fresh.stderr


SLOW_WRITE = """
import os, time
import mpips
import mpips.checkpoint as ck
real, slow = ck.write_shard, [True]
def write_shard(d, step, *a, **k):
    if slow[0] and step > 0:
        slow[0] = False
        open("writing", "w").close()
        time.sleep(3)  # a slow file system
        out = real(d, step, *a, **k)
        open("written", "w").close()  # the slow shard is on disk
        return out
    return real(d, step, *a, **k)
ck.write_shard = write_shard
class StopOnceWritten(mpips.Hook):
    # the chief ends the run 200 of its steps after the slow shard is on disk: time to
    # commit that checkpoint without waiting, however fast the machine (a fixed count of
    # steps took 10-25 s, most of it after the commit)
    after = began = None
    def after_step(self, run, info):
        if run.is_chief and self.began is None and os.path.exists("writing"):
            self.began = info.local_updates
        if run.is_chief and self.after is None and os.path.exists("written"):
            self.after = info.local_updates + 200
            print(f"steps while the shard was written: {info.local_updates - self.began}")
        if self.after is not None and info.local_updates >= self.after:
            run.request_stop()
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.train.log_every = False, 0
    job.train.steps, job.checkpoint.every_steps = 10**9, 2000
    mpips.train(job, hooks=[StopOnceWritten()])
"""


def test_the_chief_keeps_training_while_the_ps_writes_a_checkpoint(tmp_path):
    """A periodic checkpoint does not stop the chief: with the PS's first shard write made
    to take 3 s, the chief's pause for that checkpoint is a small part of it, and it trains
    on meanwhile (zero copy, the default here: the PS writes a copy of its memory, holding
    the workers only while it copies)."""
    (tmp_path / "job.py").write_text(SLOW_WRITE)
    r = run_mpi(3, ["job.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    saved = [
        (int(t), int(p))
        for t, p in re.findall(
            r"saved checkpoint \S+ \(global_step \d+, (\d+) ms; the chief paused (\d+) ms\)",
            r.stdout,
        )
    ]
    slow = [(took, paused) for took, paused in saved if took >= 3000]
    assert len(slow) == 1, r.stdout[-3000:]
    took, paused = slow[0]
    assert paused < took / 2, r.stdout[-3000:]
    meanwhile = re.search(r"steps while the shard was written: (\d+)", r.stdout)
    assert meanwhile and int(meanwhile.group(1)) > 100, r.stdout[-3000:]


def test_the_chiefs_share_of_updates_is_logged_and_checkpointed(tmp_path):
    """``train --result FILE``: the run's result as JSON, read here instead of log lines."""
    r = run_mpi(
        8,
        ["-m", "mpips", "train", "--no-progress", "--result", "result.json"],
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["task"] == "/job:worker/task:0" and result["global_step"] == 600
    assert result["stopped_by"] is None and result["test_accuracy"] > 0.5
    counts = [s["updates"] for s in result["staleness"]]
    assert len(counts) == 6 and sum(counts) == 600
    assert f"updates per worker task: {' '.join(map(str, counts))}" in r.stdout
    manifest = json.loads((tmp_path / "runs/default/ckpt-600.json").read_text())
    assert sum(manifest["clocks"]) == 600
    assert Path(tmp_path / "runs/default/ckpt-600.shard-1-of-2.h5").exists()

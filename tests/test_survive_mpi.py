"""Survive mode: under ``python -m mpips.launch``, a worker other than the chief killed
outright mid-run costs its step, not the job (docs/guide/failures.md, "Ranks that die").
Plain mpirun keeps ending the job (test_train_mpi.py's kill -9 test)."""

import json
import os
import random
import re
import signal
import sys
import time

import numpy as np
import pytest
from conftest import RESULT, BackgroundJob, read_result

from mpips import launch
from mpips.store import atomics
from mpips.store.control import LOST, RunControl, _SharedCounters

STEPS = 30000  # digits: ~4-8 s of training on 2 cores: the kill (1-2 s in) lands mid-run
LOST_LINE = re.compile(r"lost: rank (\d+) \((/job:worker/task:\d+), pid (\d+) on \S+, last step")


def killed_mid_run(
    tmp_path, mode, steps, victim, *args, model='[data]\nbuiltin = "digits"\n', nodes=None
):
    """The digits job (or ``model``: its model, data and optimizer; ``mode``, ``steps``, a
    checkpoint a second) on 1 PS + 3 workers under mpips.launch (``nodes``: on emulated
    nodes, as run_mpi); ``victim`` killed with SIGKILL at a random moment after the first
    checkpoint. Checks the run reached its target with exit 0 and named the victim once;
    returns (its output, its result, the victim's rank and pid)."""
    (tmp_path / "job.toml").write_text(
        f'{model}[train]\nmode = "{mode}"\nsteps = {steps}\n'
        '[checkpoint]\ndir = "ckpt"\nevery_secs = 1.0\n'
    )
    launch = (sys.executable, "-m", "mpips.launch")
    args = (*args, "--result", RESULT)
    job = BackgroundJob(tmp_path, 4, "job.toml", *args, nodes=nodes, wrap=launch)
    rank, pid = job.rank_and_pid(victim)
    job.wait_for(r"saved checkpoint", 120)
    time.sleep(random.uniform(0.0, 1.0))
    os.kill(pid, signal.SIGKILL)
    rc = job.end(180)
    text = job.text()
    assert rc == 0, text[-3000:]
    result = read_result(tmp_path)
    assert result is not None and result["global_step"] == steps, text[-3000:]
    assert LOST_LINE.findall(text) == [(str(rank), victim, str(pid))], text[-3000:]
    return text, result, rank, pid


@pytest.mark.launcher
@pytest.mark.parametrize(
    "victim", ["/job:worker/task:0", "/job:worker/task:1", "/job:worker/task:2"]
)
def test_a_worker_killed_mid_run_costs_its_step_not_the_job(tmp_path, victim):
    """kill -9 at a random moment after the first checkpoint: exit 0, the target reached,
    every step 1..N counted once (the dead worker's claimed step made by a survivor), the
    lost rank named once, the final checkpoint at the target. The chief too: worker 1 takes
    over its duties (checkpoints, the final evaluation and report, the result file)."""
    text, result, rank, pid = killed_mid_run(tmp_path, "async", STEPS, victim, "--log-every", "1")
    (lost,) = result["lost"]
    assert lost["rank"] == rank
    # every step counted once; only the dead worker's last one may lack its line (it was
    # counted, then the worker died before it printed it)
    steps = [int(s) for s in re.findall(r"\] step (\d+) ", text)]
    assert len(steps) == len(set(steps)) and set(steps) <= set(range(1, STEPS + 1)), text[-3000:]
    assert set(range(1, STEPS + 1)) - set(steps) <= {lost["last_step"]}, text[-3000:]
    assert f"(global_step {STEPS}," in text  # the chief's final checkpoint
    assert "with 1 rank(s) lost" in text
    for bad in ("stopped early", "Traceback", "hung", "died without a word"):
        assert bad not in text, text[-3000:]
    assert not list(tmp_path.glob(".mpips-launch-*"))  # the launcher's folder removed
    assert_chief_duties(tmp_path, text, victim, STEPS)


def assert_chief_duties(tmp_path, text, victim, steps):
    """The chief's duties were done to the end, by worker 1 where the chief was lost: it
    said it took them over (and nobody else did), and the final checkpoint is committed."""
    takes_over = re.findall(r"\[(/job:worker/task:\d+)\] the chief .* was lost: this worker", text)
    assert takes_over == (["/job:worker/task:1"] if victim.endswith("task:0") else []), text[-3000:]
    assert (tmp_path / f"ckpt/ckpt-{steps}.json").exists()
    final = re.findall(r"\[(/job:worker/task:\d+)\] final: global_step (\d+) ", text)
    chief = "/job:worker/task:1" if victim.endswith("task:0") else "/job:worker/task:0"
    assert final == [(chief, str(steps))], text[-3000:]


@pytest.mark.launcher
def test_a_worker_killed_mid_run_of_a_job_with_a_table_costs_its_step(tmp_path):
    """Async with a table (FTRL logistic regression over a 2^20-row table on Zipf ids, zero
    copy: rows read and updated in place): a worker killed mid-run costs its step, the run
    reaches its target, the table's final checkpoint is committed."""
    from mpips.data import ctr_convert

    ctr_convert.make_zipf(tmp_path / "z.h5", rows=20_000, num_features=1 << 20, nnz=16)
    model = ZIPF_MODEL
    steps = 30000  # ~5 s of training: the kill (1-2 s in) lands mid-run
    text, result, rank, _ = killed_mid_run(
        tmp_path, "async", steps, "/job:worker/task:2", model=model
    )
    assert [lost["rank"] for lost in result["lost"]] == [rank]
    assert result["test_auc"] > 0.6, result
    assert (tmp_path / f"ckpt/ckpt-{steps}.json").exists(), text[-3000:]
    assert "with 1 rank(s) lost" in text and "Traceback" not in text, text[-3000:]


ZIPF_MODEL = (
    '[model]\nkind = "logreg"\n[data]\npath = "z.h5"\n'
    '[optimizer]\nkind = "ftrl"\nlearning_rate = 0.5\n'
)


@pytest.mark.launcher
@pytest.mark.parametrize(
    "mode,victim,table",
    [
        ("async", "/job:worker/task:0", False),  # the chief
        ("async", "/job:worker/task:2", True),  # a table job (FTRL, copied rows)
        ("sync_replicas", "/job:worker/task:1", False),
    ],
)
def test_a_worker_killed_on_one_of_two_nodes_costs_its_step(tmp_path, mode, victim, table):
    """Two emulated nodes (node0: the PS; node1: the three workers), every update and
    control word moved through MPI (no zero copy between nodes): a worker killed mid-run
    costs its step; the run reaches its target with exit 0 and names it once."""
    model = '[data]\nbuiltin = "digits"\n'
    if table:
        from mpips.data import ctr_convert

        ctr_convert.make_zipf(tmp_path / "z.h5", rows=20_000, num_features=1 << 20, nnz=16)
        model = ZIPF_MODEL
    # (TCP between the nodes: slower; the table job's FTRL updates go through the PS's
    # mailbox, ~15 ms a step with 3 workers on the one node)
    steps = 800 if table else {"async": 8000, "sync_replicas": 1500}[mode]
    text, result, rank, _ = killed_mid_run(tmp_path, mode, steps, victim, model=model, nodes=(1, 3))
    assert [lost["rank"] for lost in result["lost"]] == [rank]
    assert "survive mode off" not in text and "Traceback" not in text, text[-3000:]
    assert (tmp_path / f"ckpt/ckpt-{steps}.json").exists(), text[-3000:]
    assert_chief_duties(tmp_path, text, victim, steps)


@pytest.mark.launcher
def test_a_worker_killed_on_a_ps_node_of_several_is_restarted(tmp_path):
    """Two emulated nodes, the chief on the PS's node: its one-sided calls to that PS go
    through MPICH's node-local lock, which its death could leave held, so it is not
    survived in place: rank 0 says so at start-up, and --restarts 1 runs the job again
    from its latest checkpoint to the target."""
    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nsteps = 8000\n'
        '[checkpoint]\ndir = "ckpt"\nevery_secs = 1.0\n'
    )
    wrap = (sys.executable, "-m", "mpips.launch", "--restarts", "1")
    job = BackgroundJob(tmp_path, 4, "job.toml", "--result", RESULT, nodes=(2, 2), wrap=wrap)
    _, pid = job.rank_and_pid("/job:worker/task:0")
    job.wait_for(r"saved checkpoint", 120)
    os.kill(pid, signal.SIGKILL)
    rc = job.end(180)
    text = job.text()
    assert rc == 0, text[-3000:]
    assert "a worker on a PS task's node (rank 1) ends the job if it dies" in text, text[-3000:]
    assert "mpips.launch: restart 1 of 1" in text, text[-3000:]
    assert re.search(r"restored global_step [1-9]\d*", text.split("restart 1 of 1")[1])
    result = read_result(tmp_path)
    assert result is not None and result["global_step"] == 8000, text[-3000:]


SYNC_STEPS = 3000  # sync_replicas on digits, 3 replicas: ~5-8 s on the loaded 2 cores


@pytest.mark.launcher
@pytest.mark.parametrize("victim", ["/job:worker/task:0", "/job:worker/task:2"])
def test_a_sync_replica_killed_mid_run_shrinks_the_quorum_not_the_job(tmp_path, victim):
    """sync_replicas, 1 PS + 3 workers, every step takes all 3 gradients: kill -9 of a
    worker (the chief too) at a random moment after the first checkpoint; the PS takes the
    step with the gradients of the 2 left (and every later one), the target is reached,
    exit 0, the lost rank named once with the last step it pushed."""
    text, result, rank, pid = killed_mid_run(tmp_path, "sync_replicas", SYNC_STEPS, victim)
    (lost,) = result["lost"]
    assert lost["rank"] == rank and 0 < lost["last_step"] < SYNC_STEPS, lost
    assert f"(global_step {SYNC_STEPS}," in text  # the chief's final checkpoint
    assert "with 1 rank(s) lost" in text
    assert re.search(r"aggregated \d+ steps of 2 gradients each", text), text[-3000:]
    for bad in ("stopped early", "Traceback", "hung", "died without a word"):
        assert bad not in text, text[-3000:]
    assert_chief_duties(tmp_path, text, victim, SYNC_STEPS)


SLOW_START = """
import time
from mpips.process import supervise
supervise.supervise()  # (python -m mpips train does this: a script of its own must too)
import mpips
class SlowStart(mpips.Hook):
    def begin(self, run):  # (hooks begin before the chief raises ready)
        if run.is_chief:
            print("the chief begins", flush=True)
            time.sleep(120)
with mpips.abort_on_error():
    job = mpips.load_job("job.toml")
    mpips.train(job, hooks=[SlowStart()])
"""


@pytest.mark.launcher
def test_a_chief_killed_before_training_starts_ends_the_job_at_once(tmp_path):
    """The chief killed after the start-up's collectives, before it raised ready (its hook
    begins slowly): the PS and the workers waiting for ready see it dead and end the job
    within seconds (not at the start-up limit), naming it; exit not 0 (a restart's case)."""
    import subprocess

    from conftest import clean_env, mpiexec_path, stop_launcher

    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nsteps = 1000\nprogress = false\n'
    )
    (tmp_path / "slow.py").write_text(SLOW_START)
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mpips.launch", mpiexec_path(), "-n", "4"]
            + [sys.executable, "slow.py"],
            cwd=tmp_path,
            env=clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while "the chief begins" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.1)
        m = re.search(r"\[/job:worker/task:0\] rank (\d+), pid (\d+) on ", log.read_text())
        assert m, log.read_text()[-3000:]
        os.kill(int(m.group(2)), signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=60)
        took = time.monotonic() - killed
    finally:
        stop_launcher(proc)
    text = log.read_text()
    assert rc != 0 and took < 20, (rc, took, text[-3000:])
    assert "the chief, died before training started" in text, text[-3000:]
    assert f"rank {m.group(1)} (/job:worker/task:0" in text, text[-3000:]


# -- without MPI ---------------------------------------------------------------------------


def test_a_sync_replicas_step_takes_what_the_live_workers_give():
    """The PS's averager after a loss: a step waiting for a dead worker's gradient is
    complete with the live ones' (their mean, not the sum over the old count)."""
    from mpips.modes.engines.replicas_worker import Averager

    class Held:
        def held(self, task):
            return {"w": np.zeros(2)}, {}

    applied = []
    averager = Averager(Held(), 0, lambda v, g, s, lr, t: applied.append(g.copy()), [], 3)
    assert not averager.add({"w": np.array([1.0, 2.0])})
    assert not averager.add({"w": np.array([3.0, 4.0])})
    assert averager.shrink(3) is False  # nobody lost: still waits for the third
    assert averager.shrink(2) is True  # the third died: the step has all it takes
    averager.apply(0.1, 0)
    assert np.array_equal(applied[0], [2.0, 3.0])
    assert not averager.add({"w": np.ones(2)}) and averager.add({"w": np.ones(2)})  # 2 now


def test_the_launcher_prepares_hydra_for_survive_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    command = ["mpirun", "-n", "4", "python", "-m", "mpips", "train", "job.toml"]
    cmd, env, folder = launch.prepare(command, {}, hydra=True)
    assert cmd[:2] == ["mpirun", "-disable-auto-cleanup"] and cmd[2:] == command[1:]
    assert env["MPIPS_SURVIVE"] == "1" and env["MPIPS_OUTCOME_DIR"] == folder
    assert folder is not None and os.path.isdir(folder)
    # on several nodes too
    hosts = [*command[:1], "-hosts", "a,b", *command[1:]]
    assert launch.prepare(hosts, {}, hydra=True)[0][:2] == ["mpirun", "-disable-auto-cleanup"]
    assert launch.prepare(command, {"SLURM_JOB_NUM_NODES": "2"}, hydra=True)[2] is not None
    # off when asked, and for launchers that are not hydra (said once)
    assert launch.prepare(command, {"MPIPS_SURVIVE": "0"}, hydra=True)[2] is None
    assert launch.prepare(["srun", "-n", "4", "python"], {}, hydra=True)[2] is None
    assert launch.prepare(command, {}, hydra=False)[0] == command
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "a rank that dies ends the job" in err[0], err


def _outcome(folder, reached=True, lost=(3,), died=(3,), stopped_by=0):
    (folder / "outcome.json").write_text(
        json.dumps(
            {
                "global_step": 100,
                "target": 100,
                "reached": reached,
                "stopped_by": stopped_by,
                "lost": [{"rank": r} for r in lost],
            }
        )
    )
    for r in died:
        (folder / f"lost-{r}.json").write_text(json.dumps({"rank": r, "signal": 9}))


def test_the_launchers_verdict(tmp_path):
    assert launch.verdict(137, None) == (137, [])
    assert launch.verdict(137, str(tmp_path)) == (137, [])  # no outcome: the job failed
    _outcome(tmp_path)
    code, lines = launch.verdict(137, str(tmp_path))
    assert code == 0 and len(lines) == 1 and "reached its target" in lines[0]
    assert "with 1 rank(s) lost" in lines[0]
    _outcome(tmp_path, died=(2, 3))  # a death the run did not go on without
    assert launch.verdict(137, str(tmp_path)) == (137, [])
    (tmp_path / "lost-2.json").unlink()
    _outcome(tmp_path, reached=False)
    assert launch.verdict(137, str(tmp_path)) == (137, [])
    _outcome(tmp_path, reached=False, stopped_by=10)
    assert launch.verdict(137, str(tmp_path))[0] == 3
    _outcome(tmp_path, lost=(), died=())
    (tmp_path / "lost-3.json").unlink()
    assert launch.verdict(0, str(tmp_path)) == (0, [])  # nobody lost: the launcher's


class _Windows:
    """What RunControl reads of the windows: shared control words over a numpy array."""

    def __init__(self, workers: int):
        from mpips.placement.layout import Layout

        self.layout = Layout(1 + workers, [0])
        self.clocks_at = 9 + 1
        self.array = np.zeros(self.clocks_at + 4 * workers + 1, np.int64)
        self.control_shared = True

    def control_words(self):
        return atomics.Words(self.array)


def test_a_lost_workers_claimed_step_is_issued_again_once():
    windows = _Windows(3)
    control = RunControl(windows)  # type: ignore[arg-type]
    assert isinstance(control.counters, _SharedCounters)
    control.set_counters(0)
    for task in (0, 1, 2):
        control.begin_step(0, task)
    assert control.end_step(0) == 1 and control.last_step(0) == 1
    assert control.end_step(1) == 2  # worker 2 dies with its step claimed
    target = 3
    assert not control.take_reissued(0, target)
    assert control.declare_lost(2) and not control.declare_lost(2)  # said once
    assert control.lost_tasks() == [2]
    assert control.clocks()[1].tolist() == [False, False, True]  # nobody waits for it
    assert control.reissue_pending(target)
    # worker 0, past the target, takes it; worker 1 then finds it taken
    assert control.take_reissued(0, target) and not control.take_reissued(1, target)
    assert control.end_step(0) == 3 and not control.reissue_pending(target)
    control.publish_clock(1, 1, done=True)
    assert not control.declare_lost(1)  # it had finished: not lost


def test_a_dead_workers_counted_step_is_not_made_again():
    """Killed after counting its step but before unmarking its claim: nothing to redo."""
    windows = _Windows(2)
    control = RunControl(windows)  # type: ignore[arg-type]
    control.set_counters(0)
    control.begin_step(0, 1)
    control.counters.words.fetch_add(0, 1)  # worker 1 counted global_step 1, then died
    assert control.declare_lost(1)
    assert not control.take_reissued(0, 1) and not control.reissue_pending(1)
    assert int(windows.array[control.counters.inflight_at]) == 0  # worker 0's mark undone
    # two steps issued again, but one is missing: only one is made
    windows = _Windows(3)
    control = RunControl(windows)  # type: ignore[arg-type]
    control.set_counters(1)
    windows.array[control.counters.reissue_at] = 2
    assert control.take_reissued(0, 2) and not control.take_reissued(1, 2)
    assert int(windows.array[control.counters.reissue_at]) == 1  # (given back)
    assert LOST == 2

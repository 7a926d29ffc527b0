"""The chief's checkpoint hook and StopAtLoss, in one process with a stand-in for the run;
StopAtLoss in a job under mpiexec."""

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import run_mpi

from mpips.placement.layout import Role
from mpips.run.hooks import CheckpointSaver, PendingSave, Run, StepInfo, StopAtLoss


@dataclass
class FakeRun:
    """What CheckpointSaver uses of a Run: PS shards that take ``write_polls`` polls."""

    write_polls: int
    step: int = 0
    start_step: int = 0
    save_seconds: float = 0.0
    role: Role = Role("worker", 0)
    is_chief: bool = True
    asked: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)

    def global_step(self) -> int:
        return self.step

    def start_save(self) -> PendingSave:
        step, polls = self.step, [self.write_polls]
        self.asked.append(step)

        def commit(block: bool) -> Path | None:
            polls[0] -= 1
            if polls[0] > 0 and not block:
                return None  # the PS tasks are still writing their shards
            self.committed.append(step)
            return Path(f"ckpt-{step}.json")

        return PendingSave(step, commit)


def test_a_periodic_checkpoint_does_not_stop_the_chief():
    """The chief asks for a checkpoint and goes on training; it commits at a later step,
    once the shards are written; it asks for no second one meanwhile; the end waits."""
    run, saver = FakeRun(write_polls=4), CheckpointSaver(every_steps=10, every_secs=0)
    saver.begin(run)
    for step in range(1, 23):
        run.step = step
        saver.after_step(run, StepInfo(step, 0.1, 0, step))
        if step == 10:
            assert run.asked == [10] and run.committed == []  # asked, not waited for
    assert run.asked == [10, 20] and run.committed == [10]  # 10 committed at step 13
    run.step = 23
    saver.end(run)  # waits for 20's shards, then the final checkpoint at 23
    assert run.asked == [10, 20, 23] and run.committed == [10, 20, 23]
    assert run.save_seconds > 0


def test_stop_at_loss_stops_once_when_the_window_mean_reaches_the_threshold(capsys):
    """Not before the window is full, not on one lucky batch, at the first update whose
    window mean is at or below the threshold, and only once."""
    asked = []
    run = Run(
        job=None,
        role=Role("worker", 1),
        start_step=0,
        target_steps=0,
        global_step=lambda: 0,
        start_save=None,
        stop_run=lambda: asked.append(True),
    )
    hook = StopAtLoss(0.5, window=3)
    losses = [0.1, 2.0, 2.0, 0.1, 1.0, 0.6, 0.5, 0.3, 0.1, 0.1]
    for k, loss in enumerate(losses, 1):
        hook.after_step(run, StepInfo(10 * k, loss, 0, k))
        if k < 8:  # windows: 0.1 alone, then means 1.37, 1.37, 1.03, 0.57, 0.70, 0.53
            assert not run.stop_requested, k
    assert run.stop_requested and asked == [True]  # asked once, though later windows qualify
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[/job:worker/task:1] mean loss of the last 3 updates 0.4667 <= 0.5 at global_step 80: "
        "stopping the run"
    ]


STOP_AT_LOSS = """
import json, sys
import mpips
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.train.log_every, job.train.steps = False, 1, 3000
    result = mpips.train(job, hooks=[mpips.StopAtLoss(0.3, window=10)])
    if result.role.is_chief:
        with open("result.json", "w") as f:
            json.dump(result.to_json(), f)
sys.exit(3 if result.stopped_by else 0)
"""


@pytest.mark.launcher
def test_a_job_with_stop_at_loss_ends_normally_where_the_loss_fell(tmp_path):
    """The default job with StopAtLoss: a worker whose last 10 losses average 0.3 or less
    says so at the global step where it happened (checked against the losses it logged)
    and makes no later update; the run ends there with exit code 0 and its checkpoint."""
    (tmp_path / "stop.py").write_text(STOP_AT_LOSS)
    r = run_mpi(3, ["stop.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    updates = defaultdict(list)  # worker task -> its (global step, loss), as it logged them
    for m in re.finditer(r"\[/job:worker/task:(\d+)\] step (\d+) loss (\S+) epoch", r.stdout):
        updates[int(m[1])].append((int(m[2]), float(m[3])))
    said = re.findall(
        r"\[/job:worker/task:(\d+)\] mean loss of the last 10 updates (\S+) <= 0.3 at "
        r"global_step (\d+): stopping the run",
        r.stdout,
    )
    assert said, r.stdout[-3000:]
    for task, mean, step in said:
        mine = updates[int(task)]
        at = [t for t, _ in mine].index(int(step))  # its update that made the step
        means = [sum(x for _, x in mine[k - 9 : k + 1]) / 10 for k in range(9, at + 1)]
        # the window's mean fell to 0.3 there, not before (losses logged to 4 decimals)
        assert means[-1] == pytest.approx(float(mean), abs=1e-4) and means[-1] < 0.3 + 1e-4
        assert all(m > 0.3 - 1e-4 for m in means[:-1]), (task, step, mine)
        assert at == len(mine) - 1, (task, step, mine)  # no update after it asked to stop
    assert result["stopped_by"] is None and result["global_step"] < 3000
    first_said = min(int(s) for _, _, s in said)
    assert result["global_step"] <= first_said + 4, r.stdout[-3000:]  # steps in flight
    assert (tmp_path / f"runs/default/ckpt-{result['global_step']}.json").exists()


KEPT = """
import mpips
kept = {}
class Keep(mpips.Hook):
    def begin(self, run):
        kept["run"] = run
with mpips.abort_on_error():
    job = mpips.load_job(None)
    job.train.progress, job.train.steps = False, 40
    result = mpips.train(job, hooks=[Keep()])
    if "run" in kept:
        run = kept["run"]
        assert run.global_step() == result.global_step == 40, (run.global_step(), result)
        try:
            run.variables()
        except mpips.MpipsError as e:
            print("said:", e, flush=True)
"""


def test_a_run_kept_past_its_end_says_so_instead_of_reading_freed_memory(tmp_path):
    """A hook that keeps its Run and reads it after mpips.train returned: in async mode the
    PS store is freed by then (global_step() segfaulted, variables() was an MPI error on
    every rank); now the final step, and one clear error."""
    (tmp_path / "kept.py").write_text(KEPT)
    r = run_mpi(3, ["kept.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    # (each worker says it once; two ranks' lines may interleave in one line of stdout)
    assert r.stdout.count("mpips.Run.variables(): the run is over and its PS store") == 2, r.stdout


def test_hooks_none_is_no_hooks(tmp_path):
    """``mpips.train(job, hooks=None)`` (one process) trains, as with no hooks: it was a
    TypeError on every rank."""
    from mpi4py import MPI

    import mpips

    job = mpips.load_job(None)
    job.train.progress, job.train.steps, job.checkpoint.dir = False, 3, str(tmp_path / "ck")
    assert mpips.train(job, hooks=None, comm=MPI.COMM_SELF).global_step == 3

"""TensorFlow 1.x's own SyncReplicasOptimizer test with a backup worker
(sync_replicas_optimizer_test.py, test3Workers1Backup), replayed in mpips: 2 PS tasks, 3
workers, replicas_to_aggregate = 2, the same variables, gradients and learning rate, the
same order of events, and every value TensorFlow expects. Also the rule that keeps several
PS tasks on one step (sync_replicas.common_step), alone."""

import json

import numpy as np
import pytest
from conftest import run_mpi

from mpips import checkpoint
from mpips.modes.engines.replicas_worker import common_step

REPLAY = """
import json, time
from pathlib import Path

import numpy as np

import mpips


def wait_for(path):
    \"\"\"Until another worker's hook has written ``path`` (a deadline: never a hang).\"\"\"
    deadline = time.monotonic() + 120
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never came")
        time.sleep(0.01)


class Tf1Test(mpips.Model):
    \"\"\"get_workers() of TF's test: v0 = 0.0 on ps:0, v1 = 1.0 and v_sparse = [[3], [4]] on
    ps:1; worker k's gradients are 0.1 + 0.2k, 0.9 + 0.2k and row 1 of v_sparse 0.1 + 0.2k.
    Worker 1's first gradient is held until global step 1 is done, worker 2's second until
    global step 2 is: TF's "worker 0 and worker 2 finished first", then workers 0 and 1.
    Worker 0's first waits until worker 1 has read the step-0 variables (a worker that
    starts late on a busy machine would read step 1's and count for step 2).\"\"\"

    calls = 0

    def variables(self):
        return [mpips.Variable("v0", (1,)), mpips.Variable("v1", (1,)),
                mpips.Variable("v_sparse", (2, 1))]

    def initial_values(self, seed):
        return {"v0": np.array([0.0], np.float32), "v1": np.array([1.0], np.float32),
                "v_sparse": np.array([[3.0], [4.0]], np.float32)}

    def loss_and_grads(self, params, x, y, grads, ready=None):
        self.calls += 1
        if (self.worker, self.calls) == (1, 1):
            Path("worker-1-read-step-0").write_text("")
        held = {(0, 1): "worker-1-read-step-0", (1, 1): "step-1", (2, 2): "step-2"}.get(
            (self.worker, self.calls)
        )
        if held:
            wait_for(held)
        k = self.worker
        grads["v0"][...] = 0.1 + k * 0.2
        grads["v1"][...] = 0.9 + k * 0.2
        grads["v_sparse"][...] = [[0.0], [0.1 + k * 0.2]]
        return 0.0

    def evaluate(self, params, x, y):
        return {"loss": 0.0}


class Mark(mpips.Hook):
    def after_step(self, run, info):
        if run.is_chief:
            Path(f"step-{info.step}").write_text("")


with mpips.abort_on_error():
    job = mpips.parse_job('''
[data]
builtin = "digits"
[optimizer]
kind = "sgd"
learning_rate = 2.0
[train]
mode = "sync_replicas"
replicas_to_aggregate = 2
steps = 2
progress = false
[checkpoint]
dir = "run"
[layout]
ps = 2
[layout.pin]
v_sparse = 1     # with ops.device("/job:ps/task:1")
''')
    result = mpips.train(job, model=lambda data: Tf1Test(), hooks=[Mark()])
    if result.role.is_chief:
        json.dump(result.to_json(), open("r.json", "w"))
"""


@pytest.mark.launcher
def test_tf1s_three_workers_one_backup_with_two_ps_tasks(tmp_path):
    """Global step 1 averages workers 0 and 2 (worker 1's gradient comes late and is
    dropped), global step 2 workers 0 and 1 (worker 2's is dropped): v0 = -0.6 - 0.4,
    v1 = -1.2 - 2.0, as TF asserts. (TF's workers also waste one step each on the initial
    tokens, whose gradients are dropped: mpips has no token queue, so it has no such step.)"""
    (tmp_path / "replay.py").write_text(REPLAY)
    r = run_mpi(5, ["replay.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["global_step"] == 2
    assert [s["updates"] for s in result["staleness"]] == [2, 2, 2]
    assert [s["dropped"] for s in result["staleness"]] == [0, 1, 1]
    for ps in (0, 1):
        said = f"[/job:ps/task:{ps}] aggregated 2 steps of 2 gradients each; late gradients "
        assert said + "dropped: worker 1: 1, worker 2: 1" in r.stdout, r.stdout[-3000:]
    ckpt = checkpoint.Checkpoint(checkpoint.latest_checkpoint(tmp_path / "run"))
    assert ckpt.step == 2
    shards = {name: [p.shard for p in e.parts] for name, e in ckpt.variables.items()}
    assert shards == {"v0": [0], "v1": [1], "v_sparse": [1]}
    values, _ = ckpt.read_all()
    np.testing.assert_allclose(values["v0"], [-0.6 - (0.1 + 0.3) / 2 * 2.0], rtol=1e-6)
    np.testing.assert_allclose(values["v1"], [-1.2 - (0.9 + 1.1) / 2 * 2.0], rtol=1e-6)
    np.testing.assert_allclose(values["v_sparse"], [[3.0], [4.0 - 0.6 - 0.4]], rtol=1e-6)


def steps_seen(*answers):
    """A fake ps_steps() answering each list in turn, and a wait_past that records its
    tags and lets the lagging PS task catch up (the next answer)."""
    seen = list(answers)
    waits = []

    def ps_steps():
        return seen.pop(0) if len(seen) > 1 else seen[0]

    def wait_past(tags):
        waits.append(tags)
        return True

    return ps_steps, wait_past, waits


def test_a_worker_posts_only_for_a_step_every_ps_task_is_at():
    """ps:0 has finished step 5 while ps:1 is still on it: the worker waits until every PS
    task is past 5, then posts for 6 on all of them (never 6 on ps:0 and 5 on ps:1)."""
    ps_steps, wait_past, waits = steps_seen([6, 5], [6, 6])
    assert common_step(ps_steps, wait_past) == 6
    assert waits == [[5, 5]]
    ps_steps, wait_past, waits = steps_seen([3, 3, 3])
    assert common_step(ps_steps, wait_past) == 3 and waits == []
    ps_steps, wait_past, waits = steps_seen([4, 5, 5], [5, 5, 6], [6, 6, 6])
    assert common_step(ps_steps, wait_past) == 6 and waits == [[4, 4, 4], [5, 5, 5]]


def test_a_stop_ends_the_wait_for_a_lagging_ps_task():
    assert common_step(lambda: [2, 1], lambda tags: False) is None

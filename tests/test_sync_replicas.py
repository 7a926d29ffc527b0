"""train.mode = "sync_replicas": TensorFlow's SyncReplicasOptimizer through the PS. With no
backup worker it trains exactly like allreduce sync mode; with one, a slowed worker no
longer sets the pace, its late gradients are dropped, and every step averages exactly
replicas_to_aggregate gradients."""

import json

import numpy as np
import pytest
from conftest import run_mpi, run_train
from shared_runs import run_in_turn

import mpips
from mpips import checkpoint
from mpips.errors import ConfigError
from mpips.modes import check_job

pytestmark = pytest.mark.launcher

JOB = """
[model]
hidden = [32]
[data]
builtin = "digits"
[optimizer]
kind = "{optimizer}"
learning_rate = {lr}
[train]
mode = "{mode}"
steps = 20
batch_size = 32
[checkpoint]
dir = "runs/{mode}"
"""


OPTIMIZERS = [("sgd", 0.1), ("adam", 0.01)]


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """20 steps of JOB with each optimizer, in sync_replicas mode (1 PS, 2 workers: 3 ranks)
    and in allreduce sync mode (2 replicas): two launches, each training its mode's jobs in
    turn; the directory and each case ``<mode>-<optimizer>`` (run_in_turn), its checkpoints
    in ``runs/<mode>-<optimizer>``."""
    d = tmp_path_factory.mktemp("straight")
    cases = {}
    for mode, ranks in (("sync_replicas", 3), ("sync", 2)):
        names = []
        for optimizer, lr in OPTIMIZERS:
            name = f"{mode}-{optimizer}"
            text = JOB.format(mode=mode, optimizer=optimizer, lr=lr)
            (d / f"{name}.toml").write_text(text.replace(f"runs/{mode}", f"runs/{name}"))
            names.append(name)
        cases |= run_in_turn(
            d, names, lambda todo, n=ranks: run_mpi(n, ["in_turn.py", *todo], d, 120)
        )
    return d, cases


@pytest.mark.parametrize("optimizer,lr", OPTIMIZERS)
def test_without_backup_workers_it_equals_allreduce_sync_mode(straight_runs, optimizer, lr):
    """2 workers through 1 PS, every gradient aggregated, == 2 allreduce replicas."""
    d, cases = straight_runs
    final = {}
    for mode in ("sync_replicas", "sync"):
        name = f"{mode}-{optimizer}"
        assert cases[name].result()["global_step"] == 20  # (else: that case's failure alone)
        manifest = checkpoint.latest_checkpoint(d / f"runs/{name}")
        final[mode] = checkpoint.Checkpoint(manifest).read_all()
    (ours, our_slots), (theirs, their_slots) = final["sync_replicas"], final["sync"]
    assert set(ours) == set(theirs) and set(our_slots) == set(their_slots)
    for name in ours:
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6, err_msg=name)
    for name in our_slots:
        np.testing.assert_allclose(our_slots[name], their_slots[name], rtol=1e-5, atol=1e-6)


SLOWED = """
import json, time
import mpips
from mpips.models.mlp import MLP

class SlowOnTask2(MLP):  # worker task 2 computes slowly: a straggler
    def loss_and_grads(self, *args, **kwargs):
        if self.worker == 2:
            time.sleep(0.02)
        return super().loss_and_grads(*args, **kwargs)

with mpips.abort_on_error():
    job = mpips.parse_job('''
[data]
builtin = "digits"
[train]
mode = "sync_replicas"
replicas_to_aggregate = {aggregate}
steps = 100
batch_size = 32
progress = false
''')
    result = mpips.train(job, model=lambda data: SlowOnTask2([data.num_inputs, 32,
                                                              data.num_classes]))
    if result.role.is_chief:
        json.dump(result.to_json(), open("r.json", "w"))
"""


def test_a_backup_worker_keeps_a_straggler_from_setting_the_pace(tmp_path):
    """1 PS + 3 workers, 2 gradients a step: the straggler's gradients come after their
    step and are dropped; the two others carry the run."""
    (tmp_path / "slowed.py").write_text(SLOWED.format(aggregate=2))
    r = run_mpi(4, ["slowed.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["global_step"] == 100
    posted = [s["updates"] for s in result["staleness"]]
    dropped = [s["dropped"] for s in result["staleness"]]
    # every step averaged exactly 2 gradients for that step: the others were dropped
    assert sum(posted) - sum(dropped) == 100 * 2, (posted, dropped)
    assert "aggregated 100 steps of 2 gradients each" in r.stdout
    assert posted[2] * 2 <= min(posted[0], posted[1]), posted  # 20 ms a step vs ~1 ms
    assert dropped[2] >= 1, (posted, dropped)
    said = f"gradients dropped as late, per worker task: {' '.join(map(str, dropped))}"
    assert said in r.stdout


def test_without_a_backup_the_straggler_sets_the_pace(tmp_path):
    """The same straggler with every gradient aggregated: every worker posts every step,
    none is dropped (each step waits for the slowest)."""
    (tmp_path / "slowed.py").write_text(SLOWED.format(aggregate=3))
    r = run_mpi(4, ["slowed.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert [s["updates"] for s in result["staleness"]] == [100, 100, 100]
    assert [s["dropped"] for s in result["staleness"]] == [0, 0, 0]


def test_sync_replicas_settings_are_checked(tmp_path):
    base = '[data]\nbuiltin = "digits"\n'
    with pytest.raises(ConfigError, match='only for mode = "sync_replicas"'):
        check_job(mpips.parse_job(base + "[train]\nsteps = 5\nreplicas_to_aggregate = 2\n"))
    with pytest.raises(ConfigError, match="ends at a step target"):
        check_job(mpips.parse_job(base + '[train]\nmode = "sync_replicas"\nepochs = 2\n'))
    with pytest.raises(ConfigError, match="clip_norm"):
        check_job(
            mpips.parse_job(
                base + '[optimizer]\nclip_norm = 1.0\n[train]\nmode = "sync_replicas"\nsteps = 5\n'
            )
        )
    (tmp_path / "job.toml").write_text(
        base + '[train]\nmode = "sync_replicas"\nsteps = 5\nreplicas_to_aggregate = 3\n'
    )
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--no-progress"], cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("replicas_to_aggregate = 3: more than the 2 worker(s)") == 1
    # a mode's own rule (Mode.check_job), not the file's: one message from 3 ranks, exit 2
    (tmp_path / "job.toml").write_text(base + "[train]\nsteps = 5\nreplicas_to_aggregate = 2\n")
    assert mpips.load_job(tmp_path / "job.toml").train.replicas_to_aggregate == 2
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--no-progress"], cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    said = r.stderr.count('train.replicas_to_aggregate: only for mode = "sync_replicas"')
    assert said == 1, r.stderr


def test_a_resumed_run_continues_from_the_checkpoint(tmp_path, straight_runs):
    """Stop at 10, resume to 20 (2 PS tasks, Adam): the same variables and slots as a
    straight run to 20 (the PS tasks restore their shards; every PS step word is set before
    any worker reads it). The straight run is the module's, on 1 PS task: the placement
    does not change the sums."""
    d, cases = straight_runs
    cases["sync_replicas-adam"].result()  # the straight run ended (else: its failure, by name)
    job = JOB.format(mode="sync_replicas", optimizer="adam", lr=0.01) + "[layout]\nps = 2\n"
    (tmp_path / "job.toml").write_text(job)
    for args in (["--steps", "10"], []):
        r = run_train(tmp_path, 4, "job.toml", *args, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
    assert r.result["start_step"] == 10 and r.result["global_step"] == 20
    resumed = checkpoint.Checkpoint(checkpoint.latest_checkpoint(tmp_path / "runs/sync_replicas"))
    straight = checkpoint.Checkpoint(checkpoint.latest_checkpoint(d / "runs/sync_replicas-adam"))
    assert resumed.step == straight.step == 20
    (a, a_slots), (b, b_slots) = resumed.read_all(), straight.read_all()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=1e-6, err_msg=name)
        assert np.abs(a[name]).sum() > 0, name  # not zeroed
    for name in a_slots:
        np.testing.assert_allclose(a_slots[name], b_slots[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "extra,ranks,said",
    [("batch_size = 1024\n", 3, "make no full batch of 1024 on each of 2 workers")],
)
def test_layouts_and_data_sync_replicas_cannot_run_are_one_message(tmp_path, extra, ranks, said):
    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nmode = "sync_replicas"\nsteps = 5\n' + extra
    )
    r = run_mpi(ranks, ["-m", "mpips", "train", "job.toml", "--no-progress"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count(said) == 1, r.stderr


SLOW_PS = """
import sys, time
from mpi4py import MPI
from mpips.store import server

original = server._aggregate_loop


def late(*args, **kwargs):
    if MPI.COMM_WORLD.rank == 1:  # /job:ps/task:1 starts serving after ps:0 aggregated
        time.sleep(3)
    return original(*args, **kwargs)


server._aggregate_loop = late
from mpips.cli import main

sys.exit(main(sys.argv[1:]))
"""


def test_a_ps_task_that_starts_serving_late_aggregates_the_same_steps(tmp_path):
    """ps:0 aggregates (and advances global_step) before ps:1 even looks: ps:1 must still
    take its first step from the step it published, not from global_step (it dropped every
    gradient as late, and the run hung)."""
    (tmp_path / "job.toml").write_text(
        JOB.format(mode="sync_replicas", optimizer="sgd", lr=0.1) + "[layout]\nps = 2\n"
    )
    (tmp_path / "slow_ps.py").write_text(SLOW_PS)
    r = run_mpi(4, ["slow_ps.py", "train", "--no-progress", "job.toml"], cwd=tmp_path, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[/job:ps/task:1] aggregated 20 steps of 2 gradients each; late gradients " in r.stdout


COUNTING = """
import json, time
import numpy as np
import mpips

class Counting(mpips.Model):
    \"\"\"One variable per PS task (w0 on ps:0, w1 on ps:1 ...) with a slot per worker task;
    worker k's gradient is 1 in slot k, 0 elsewhere, whatever the batch: -w / lr is then the
    sum over steps of the mean of the gradients that PS task aggregated, and n * -w / lr
    counts each worker's gradients it aggregated.\"\"\"

    def variables(self):
        return [mpips.Variable(f"w{{p}}", (3,)) for p in range({ps})]

    def initial_values(self, seed):
        return {{f"w{{p}}": np.zeros(3, np.float32) for p in range({ps})}}

    def loss_and_grads(self, params, x, y, grads, ready=None):
        if self.worker == 2:
            time.sleep(0.01)  # a straggler: its gradients are mostly the late ones
        for g in grads.values():
            g[...] = 0
            g[self.worker] = 1
        return 0.0

    def evaluate(self, params, x, y):
        return {{"loss": 0.0}}

with mpips.abort_on_error():
    job = mpips.parse_job('''
[data]
builtin = "digits"
[optimizer]
kind = "sgd"
learning_rate = 0.015625
[train]
mode = "sync_replicas"
replicas_to_aggregate = 2
steps = 60
batch_size = 32
progress = false
[checkpoint]
dir = "run"
[layout]
ps = {ps}
''')
    result = mpips.train(job, model=lambda data: Counting())
    if result.role.is_chief:
        json.dump(result.to_json(), open("r.json", "w"))
"""


@pytest.mark.parametrize("ps", [1, 2])
def test_a_step_applies_the_mean_of_exactly_the_gradients_aggregated(tmp_path, ps):
    """3 workers, 2 gradients a step, SGD, on 1 and on 2 PS tasks: each step of each PS task
    subtracts lr x the mean of the 2 gradients it aggregated (divided by
    replicas_to_aggregate, not by the 3 workers), and a dropped gradient adds nothing.
    Worker k's gradient is the unit vector e_k, so each PS task's variable counts, per
    worker, the gradients that PS task aggregated (lr = 2^-6: exact sums). With 2 PS tasks
    each chooses its own, as TensorFlow's accumulators do: a gradient none dropped counts on
    both, one that only some dropped on the others."""
    (tmp_path / "counting.py").write_text(COUNTING.format(ps=ps))
    r = run_mpi(3 + ps, ["counting.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["global_step"] == 60
    posted = [s["updates"] for s in result["staleness"]]
    used_by_all = [s["updates"] - s["dropped"] for s in result["staleness"]]
    assert sum(s["dropped"] for s in result["staleness"]) >= 1, result["staleness"]
    params, _ = checkpoint.Checkpoint(checkpoint.latest_checkpoint(tmp_path / "run")).read_all()
    for p in range(ps):
        assert f"[/job:ps/task:{p}] aggregated 60 steps of 2 gradients each" in r.stdout
        # w = -lr x sum over steps of (e_k + e_j) / 2 for the 2 workers k, j aggregated
        counts = -params[f"w{p}"] / 0.015625 * 2
        assert counts.sum() == 60 * 2, counts
        assert all(u <= c <= n for u, c, n in zip(used_by_all, counts, posted, strict=True))
    if ps == 1:
        np.testing.assert_array_equal(counts, used_by_all)

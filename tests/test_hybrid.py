"""train.mode = "hybrid": tables on the PS tasks (rows pulled and pushed), the dense part
trained by the workers as synchronous replicas. With one worker it equals one process; with
two, every replica's dense variables stay bit-for-bit the same and the tables equal a
lockstep reference; its checkpoints restore onto another PS count."""

import os
import re
import signal

import numpy as np
import pytest
from conftest import RESULT, BackgroundJob, read_result, run_mpi
from shared_runs import run_in_turn
from test_ctr_mpi import JOB, small_dataset

from mpips.checkpoint import Checkpoint
from mpips.data.batches import batches, full_batches, load_split, open_dataset, worker_rows
from mpips.errors import ConfigError
from mpips.job import parse_job
from mpips.models.mlp import build_model
from mpips.modes import check_job
from mpips.optim import build_optimizer, learning_rate

pytestmark = pytest.mark.launcher
CRC = re.compile(r"replica crc32 ([0-9a-f]{8})")


def hybrid_job(tmp_path, model, opt, lr, steps):
    small_dataset(tmp_path / "s.h5")
    text = JOB.format(model=model, rule="mod", opt=opt, lr=lr, steps=steps)
    text = text.replace("[train]\n", '[train]\nmode = "hybrid"\n')
    (tmp_path / "job.toml").write_text(text)
    return parse_job(text.replace('"s.h5"', f'"{tmp_path / "s.h5"}"'))


def lockstep(job, steps, workers):
    """One process: each step every worker's gradient at the same parameters (whole
    tables); each worker's table gradient applied in turn, the dense mean once."""
    info = open_dataset(job.data.path)
    model = build_model(job.model, info)
    opt = build_optimizer(job.optimizer)
    params = model.initial_values(job.model.init_seed)
    tables = [t.name for t in model.tables()]
    for t in model.tables():
        params[t.name] = model.initial_rows(t.name, (0, t.shape[0], 1), job.model.init_seed)
    slots = {k: opt.init_slots(v) for k, v in params.items()}
    x, y = load_split(info, "train")
    b, n = job.train.batch_size, info.rows["train"]
    per_epoch = full_batches(n, workers, b)
    streams = []
    for w in range(workers):
        a, z = worker_rows(n, workers, w)
        streams.append(batches(x[a:z], y[a:z], b, job.train.seed, w, per_epoch=per_epoch))
    for step in range(steps):
        lr = learning_rate(job.optimizer, step)
        grads = []
        for stream in streams:
            _, bx, by = next(stream)
            g = {k: np.zeros_like(v) for k, v in params.items()}
            model.loss_and_grads(params, bx, by, g)
            grads.append(g)
        for g in grads:
            for t in tables:
                opt.apply(params[t], g[t], slots[t], lr, step + 1)
        for k in params:
            if k not in tables:
                mean = sum(g[k] for g in grads) / workers
                opt.apply(params[k], mean.astype(params[k].dtype), slots[k], lr, step + 1)
    return params


def assert_close(variables, want):
    assert variables.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(variables[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


ONE_WORKER = [("wide_deep", "adagrad", 0.3), ("logreg", "ftrl", 0.3)]


@pytest.fixture(scope="module")
def one_worker_runs(tmp_path_factory):
    """Each ONE_WORKER job, 30 steps on 2 PS tasks and 1 worker, trained in turn in one
    launch (into runs/<model>); the directory, each job and each case (run_in_turn)."""
    d = tmp_path_factory.mktemp("one_hybrid_worker")
    jobs = {}
    for model, opt, lr in ONE_WORKER:
        jobs[model] = hybrid_job(d, model, opt, lr, 30)
        text = (d / "job.toml").read_text().replace('dir = "runs/s"', f'dir = "runs/{model}"')
        (d / f"{model}.toml").write_text(text + "[layout]\nps = 2\n")
    cases = run_in_turn(d, [*jobs], lambda todo: run_mpi(3, ["in_turn.py", *todo], cwd=d))
    return d, jobs, cases


@pytest.mark.parametrize("model,opt,lr", ONE_WORKER)
def test_one_hybrid_worker_equals_one_process(one_worker_runs, model, opt, lr):
    d, jobs, cases = one_worker_runs
    cases[model].result()  # this case's own run ended (else: its failure alone, by name)
    variables, _ = Checkpoint(d / f"runs/{model}/ckpt-30.json").read_all()
    assert_close(variables, lockstep(jobs[model], 30, 1))
    assert np.any(variables["wide/weights"])


def test_two_hybrid_workers_keep_identical_dense_replicas_and_lockstep_tables(tmp_path):
    job = hybrid_job(tmp_path, "wide_deep", "sgd", 0.5, 24)
    r = run_mpi(4, ["-m", "mpips", "train", "job.toml", "--ps", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    crcs = CRC.findall(r.stdout)
    assert len(crcs) == 2 and crcs[0] == crcs[1], r.stdout[-2000:]  # bit for bit
    ckpt = Checkpoint(tmp_path / "runs/s/ckpt-24.json")
    shards = {name: [p.shard for p in e.parts] for name, e in ckpt.variables.items()}
    assert shards["deep/embedding"] == [0, 1] and shards["wide/bias"] == [2]  # the chief's
    variables, _ = ckpt.read_all()
    assert_close(variables, lockstep(job, 24, 2))


def test_a_hybrid_checkpoint_resumes_on_another_ps_count(tmp_path):
    """10 steps on 2 PS tasks, then to 20 on 3: the same as 20 straight (one worker)."""
    for steps, ranks, ps in ((10, 3, "2"), (20, 4, "3")):
        job = hybrid_job(tmp_path, "wide_deep", "adagrad", 0.3, steps)
        r = run_mpi(ranks, ["-m", "mpips", "train", "job.toml", "--ps", ps], cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "restored global_step 10" in r.stdout and "resuming at batch 10" in r.stdout
    variables, _ = Checkpoint(tmp_path / "runs/s/ckpt-20.json").read_all()
    assert_close(variables, lockstep(job, 20, 1))


def test_hybrid_needs_tables_and_no_clip_norm(tmp_path):
    with pytest.raises(ConfigError, match='optimizer.clip_norm: not with mode = "hybrid"'):
        check_job(parse_job('[optimizer]\nclip_norm = 1.0\n[train]\nmode = "hybrid"\nsteps = 5\n'))
    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nmode = "hybrid"\nsteps = 5\n'
    )
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path)
    assert r.returncode == 2 and "MLP has no tables to keep on the PS" in r.stderr + r.stdout


NAN_ON_WORKER_1 = """
import mpips
from mpips.models import ctr
from mpips.store import StoreClient

real_loss, real_push = ctr.WideDeep.loss_and_grads, StoreClient.push


def loss_and_grads(self, params, x, y, grads, ready=None):
    loss = real_loss(self, params, x, y, grads, ready)
    self.calls = getattr(self, "calls", 0) + 1
    return float("nan") if self.worker == 1 and self.calls == 4 else loss


def push(self, *args, **kwargs):
    print(f"pushed by {self.task}", flush=True)
    return real_push(self, *args, **kwargs)


ctr.WideDeep.loss_and_grads, StoreClient.push = loss_and_grads, push
with mpips.abort_on_error():
    mpips.train(mpips.load_job("job.toml"))
"""


def test_nothing_of_a_hybrid_step_whose_loss_is_not_finite_is_pushed(tmp_path):
    """Worker 1's loss is NaN at its fourth step: the job stops naming it, and no worker
    pushes that step's rows to the tables (the dense replicas agree on it first)."""
    hybrid_job(tmp_path, "wide_deep", "sgd", 0.5, 50)
    (tmp_path / "nan.py").write_text(NAN_ON_WORKER_1)
    r = run_mpi(3, ["nan.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-3000:])
    said = "the loss of /job:worker/task:1 is not finite at global_step 3: training stopped"
    assert r.stderr.count(said) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "clip_norm" not in r.stderr  # hybrid refuses it: not advised
    pushes = re.findall(r"pushed by (\d)", r.stdout)
    assert sorted(pushes) == ["0"] * 3 + ["1"] * 3, r.stdout[-2000:]


@pytest.mark.parametrize("victim", ["/job:worker/task:1", "/job:ps/task:0"])
def test_a_signal_stops_a_hybrid_job_with_exit_3_on_every_rank(tmp_path, victim):
    """SIGTERM to a worker (or the PS task) of a hybrid job: a checkpoint, exit 3 and
    stopped_by in the result (a worker's own signal stopped the replicas, but no task
    recorded it: the job exited 0 and a requeue on exit 3 never came)."""
    hybrid_job(tmp_path, "wide_deep", "adagrad", 0.3, 10**9)
    text = (tmp_path / "job.toml").read_text() + "every_steps = 20\n"
    (tmp_path / "job.toml").write_text(text)
    job = BackgroundJob(tmp_path, 4, "job.toml", "--result", RESULT)
    job.wait_for("saved checkpoint")
    os.kill(job.pid_of(victim), signal.SIGTERM)
    assert job.end(60) == 3, job.text()[-3000:]
    res = read_result(tmp_path)
    assert res and res["stopped_by"] == "SIGTERM", job.text()[-3000:]
    assert f"checkpoint at global_step {res['global_step']} in runs/s" in job.text()

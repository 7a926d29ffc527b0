"""A user model's contract, checked: initial values against variables() (names, shapes,
dtypes) and float variables only, at start-up; gradients written in place (not rebound,
every element written), on the first step of every training mode; a CTR model in one
process refused with its name and the mpirun command that runs it."""

import shutil
import time

import numpy as np
import pytest
from conftest import ROOT, run_train
from test_ctr_mpi import JOB, small_dataset

import mpips
from mpips.errors import AlreadyReported, ConfigError
from mpips.models import contract as model_api
from mpips.models.contract import check_model, first_loss_and_grads, said_once

MISTAKES = """
import numpy as np
import mpips
from mpips.models.ctr import WideDeep
import my_model


class Lacks(my_model.Softmax):
    def initial_values(self, seed):
        v = super().initial_values(seed)
        del v["b"]
        return v


class Extra(my_model.Softmax):
    def initial_values(self, seed):
        return {**super().initial_values(seed), "c": np.zeros(3, np.float32)}


class Shape(my_model.Softmax):
    def initial_values(self, seed):
        v = super().initial_values(seed)
        return {**v, "w": v["w"].T.copy()}


class Dtype(my_model.Softmax):
    def initial_values(self, seed):  # rng.normal without .astype(np.float32)
        v = super().initial_values(seed)
        return {**v, "w": v["w"].astype(np.float64)}


class Counter(my_model.Softmax):
    def variables(self):
        return super().variables() + [mpips.Variable("seen", (1,), "int64")]

    def initial_values(self, seed):
        return {**super().initial_values(seed), "seen": np.zeros(1, np.int64)}


def _softmax(model, params, x, y):
    xp, n = model.xp, len(y)
    z = x @ params["w"] + params["b"]
    p = xp.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    loss = -xp.log(p[xp.arange(n), y] + 1e-12).mean()
    p[xp.arange(n), y] -= 1
    return float(loss), p / n


class Rebinds(my_model.Softmax):
    def loss_and_grads(self, params, x, y, grads, ready=None):
        loss, d = _softmax(self, params, x, y)
        grads["w"] = x.T @ d  # the mistake: the push buffer keeps what it held
        grads["b"][...] = d.sum(axis=0)
        return loss


class Unwritten(my_model.Softmax):
    def loss_and_grads(self, params, x, y, grads, ready=None):
        loss, d = _softmax(self, params, x, y)
        grads["w"][...] = x.T @ d  # and forgets b's
        return loss


class CtrRebinds(WideDeep):
    def loss_and_grads(self, params, x, y, grads, ready=None):
        loss = super().loss_and_grads(params, x, y, grads, ready)
        grads["wide/bias"] = grads["wide/bias"].copy()  # written, then rebound
        return loss


def build(data, kind):
    if kind.startswith("Ctr"):
        return CtrRebinds(data.num_inputs, [4], 3)
    return globals()[kind](data.num_inputs, data.num_classes)
"""


def mistake_job(tmp_path, kind, mode="async", steps=200):
    """jobs/my_model.toml with the model ``mistakes:build`` of ``kind`` (a mistake)."""
    shutil.copy(ROOT / "jobs/my_model.py", tmp_path / "my_model.py")
    (tmp_path / "mistakes.py").write_text(MISTAKES)
    text = (
        (ROOT / "jobs/my_model.toml")
        .read_text()
        .replace('"my_model:build"', '"mistakes:build"')
        .replace("l2 = 0.0001", f'kind = "{kind}"')
        .replace("steps = 600", f'steps = {steps}\nmode = "{mode}"')
    )
    (tmp_path / "job.toml").write_text(text)


def assert_said_once(r, said, code=2):
    """Exit ``code``, ``said`` once in stderr, no traceback, no checkpoint written."""
    out = r.stderr[-3000:]
    assert r.returncode == code, out
    assert r.stderr.count(said) == 1 and "Traceback" not in r.stderr, out
    assert not list(r.cwd.glob("runs/*/ckpt-*.json")), out


def run(tmp_path, ranks, timeout=90):
    t0 = time.monotonic()
    r = run_train(tmp_path, ranks, "job.toml", timeout=timeout)
    r.cwd, r.seconds = tmp_path, time.monotonic() - t0
    return r


# -- start-up: initial values against variables(), float variables only --------------------

STARTUP = {
    "Lacks": "Lacks.initial_values() does not match variables(): it lacks b",
    "Extra": "Extra.initial_values() does not match variables(): it returns c, not declared",
    "Shape": "Shape.initial_values()['w'] has shape (10, 64); variables() declares 'w' with "
    "shape (64, 10)",
    "Dtype": "Dtype.initial_values()['w'] is float64; variables() declares 'w' as float32 "
    "(make it with .astype(np.float32)",
    "Counter": "variable 'seen' is int64: mpips trains float variables only",
}


@pytest.mark.launcher
@pytest.mark.parametrize("kind", sorted(STARTUP))
def test_initial_values_that_do_not_match_variables_are_one_start_up_error(tmp_path, kind):
    mistake_job(tmp_path, kind)
    r = run(tmp_path, 3)
    assert_said_once(r, STARTUP[kind])
    assert "step" not in r.stdout  # nothing trained


# -- the first step: gradients written in place --------------------------------------------

REBINDS = "Rebinds.loss_and_grads rebinds grads['w'] (grads['w'] = ...) instead of writing"
FIRST_STEP = {  # (model, mode, ranks): said
    ("Rebinds", "async", 3): REBINDS,
    ("Rebinds", "sync", 3): REBINDS,
    ("Rebinds", "sync_replicas", 3): REBINDS,
    ("Rebinds", "async", None): REBINDS,  # one process: a single sync replica
    ("Unwritten", "async", 3): "Unwritten.loss_and_grads did not write grads['b'] at the "
    "first step: write every element of every gradient in place",
    ("Unwritten", "sync", 3): "Unwritten.loss_and_grads did not write grads['b']",
    ("CtrRebinds", "hybrid", 3): "CtrRebinds.loss_and_grads rebinds grads['wide/bias']",
}


@pytest.mark.launcher
@pytest.mark.parametrize("case", list(FIRST_STEP), ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}")
def test_gradients_not_written_in_place_stop_the_first_step(tmp_path, case):
    """The mistake that trained silently to nothing (exit 0, chance accuracy, a checkpoint):
    now one message on the first step, exit 2, every rank ended at once, nothing saved."""
    kind, mode, ranks = case
    mistake_job(tmp_path, kind, mode)
    if kind.startswith("Ctr"):  # sparse data: the tables on the PS tasks, rows pushed
        small_dataset(tmp_path / "s.h5")
        text = (tmp_path / "job.toml").read_text()
        text = text.replace('builtin = "digits"', 'path = "s.h5"').replace(
            "steps = 200", "steps = 20"
        )
        (tmp_path / "job.toml").write_text(text)
    r = run(tmp_path, ranks)
    assert_said_once(r, FIRST_STEP[case])
    assert "in place, grads[" in r.stderr
    assert r.seconds < 45, r.seconds  # every rank ends promptly (the abort), no deadline
    assert "step 100" not in r.stdout


def test_first_loss_and_grads_unit():
    """Without MPI: NaN-filled buffers, rebinding and partial writes found; a model that
    writes every element passes, its buffers hold its gradients, the caller's dict intact."""
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "jobs"))
    spec = importlib.util.spec_from_file_location("my_model", ROOT / "jobs/my_model.py")
    my_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(my_model)
    good = my_model.Softmax(4, 3)
    params = good.checked_initial_values(0)
    x = np.random.default_rng(1).normal(size=(8, 4)).astype(np.float32)
    y = np.arange(8) % 3

    def buffers():
        return {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}

    grads = buffers()
    before = dict(grads)
    loss, problem = first_loss_and_grads(good, params, x, y, grads)
    assert problem == "" and np.isfinite(loss)
    assert all(grads[k] is before[k] for k in grads) and np.isfinite(grads["w"]).all()
    want = buffers()
    good.loss_and_grads(params, x, y, want)
    np.testing.assert_array_equal(grads["w"], want["w"])

    class Rebinds(my_model.Softmax):  # writes both, then rebinds them to copies
        def loss_and_grads(self, params, x, y, grads, ready=None):
            loss = super().loss_and_grads(params, x, y, grads)
            grads["w"], grads["b"] = grads["w"] * 1, grads["b"].copy()
            return loss

    grads = buffers()
    before = dict(grads)
    _, problem = first_loss_and_grads(Rebinds(4, 3), params, x, y, grads)
    assert problem.startswith(
        "Rebinds.loss_and_grads rebinds grads['w'] (grads['w'] = ...) instead of writing"
    ), problem
    assert problem.endswith("(rebound too: b)"), problem
    assert all(grads[k] is before[k] for k in grads)  # the caller's buffers, as handed over

    class Half(my_model.Softmax):
        def loss_and_grads(self, params, x, y, grads, ready=None):
            g = {k: np.zeros_like(v) for k, v in grads.items()}
            loss = super().loss_and_grads(params, x, y, g)
            grads["b"][...] = g["b"]
            grads["w"][1:] = g["w"][1:]  # one row left as it was
            return loss

    grads = buffers()
    _, problem = first_loss_and_grads(Half(4, 3), params, x, y, grads)
    assert "left 3 of 12 elements of grads['w'] unwritten at the first step" in problem, problem

    class Typo(my_model.Softmax):
        def loss_and_grads(self, params, x, y, grads, ready=None):
            g = {"w": np.zeros((4, 3), np.float32), "b": grads["b"]}
            loss = super().loss_and_grads(params, x, y, g)
            grads["W"] = g["w"]
            return loss

    grads = buffers()
    _, problem = first_loss_and_grads(Typo(4, 3), params, x, y, grads)
    assert "did not write grads['w']" in problem and "set grads['W']: no variable" in problem
    assert set(grads) == {"w", "b"}  # the model's dict was a copy

    class NanLoss(my_model.Softmax):  # NaN gradients with a NaN loss: the loss check says it
        def loss_and_grads(self, params, x, y, grads, ready=None):
            return float("nan")

    assert first_loss_and_grads(NanLoss(4, 3), params, x, y, buffers())[1] == ""

    class Overtaken(my_model.Softmax):
        """Another worker's diverging update reached the variables while this step read
        them (zero copy reads the PS memory live): the loss, computed before, is finite,
        backward's products overflow, inf - inf is NaN. Written, so not the model's
        mistake: a later step's loss is not finite, and the loss check says so."""

        def loss_and_grads(self, params, x, y, grads, ready=None):
            loss = super().loss_and_grads(params, x, y, grads)
            big = np.full_like(grads["w"], 3e38)
            with np.errstate(over="ignore", invalid="ignore"):
                grads["w"][...] = big * 2 - big * 2  # the default NaN, computed
            return loss

    grads = buffers()
    assert first_loss_and_grads(Overtaken(4, 3), params, x, y, grads)[1] == ""
    assert np.isnan(grads["w"]).all()
    for dtype in ("float16", "float32", "float64"):  # computed NaN never holds the mark
        big = np.full(4, np.finfo(dtype).max, dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            made = [big * 2 - big * 2, np.zeros(4, dtype) / 0, np.full(4, np.inf, dtype) * 0]
            marked = np.zeros(4, dtype)
            model_api._bits(marked).fill(model_api.UNWRITTEN[marked.itemsize])
            made.append(marked + 1.0)  # a sum with the mark keeps it: a buffer added into
        assert [model_api._unwritten_count(m) for m in made] == [0, 0, 0, 4], dtype
        assert np.isnan(marked).all()
    assert isinstance(said_once("p", True), ConfigError)
    quiet = said_once("p", False)
    assert isinstance(quiet, AlreadyReported) and quiet.exit_code == 2


def test_variables_must_be_float_and_initial_values_numpy():
    class Ints(mpips.Model):
        def variables(self):
            return [mpips.Variable("w", (2,), "int32")]

        initial_values = loss_and_grads = evaluate = lambda *a: None

    with pytest.raises(ConfigError, match="variable 'w' is int32: mpips trains float"):
        check_model(Ints(), "m")

    class Typo(Ints):
        def variables(self):
            return [mpips.Variable("w", (2,), "flaot32")]

    with pytest.raises(ConfigError, match="dtype 'flaot32', not a numpy dtype"):
        check_model(Typo(), "m")

    class Listy(Ints):
        def variables(self):
            return [mpips.Variable("w", [2], "float64")]

        def initial_values(self, seed):
            return {"w": [0.0, 0.0]}

    check_model(Listy(), "m")
    with pytest.raises(ConfigError, match=r"initial_values\(\)\['w'\] is list, not a numpy"):
        Listy().checked_initial_values(0)
    Listy.initial_values = lambda self, seed: {"w": np.zeros(2)}
    assert Listy().checked_initial_values(0)["w"].shape == (2,)  # a list shape is a tuple


# -- a CTR model in one process --------------------------------------------------------------


@pytest.mark.launcher
def test_a_ctr_model_in_one_process_is_named_with_the_command_to_run_it(tmp_path):
    """jobs/ctr.toml's model (logreg) in one process: named as the job names it (not as
    its class, WideDeep), with the mpirun command; a user's CTR model by its class."""
    small_dataset(tmp_path / "s.h5")
    text = JOB.format(model="logreg", rule="mod", opt="ftrl", lr=0.3, steps=20)
    (tmp_path / "job.toml").write_text(text)
    r = run(tmp_path, None)
    said = (
        "model.kind = 'logreg' keeps its tables (wide/weights float32[40, 1]) on PS tasks, "
        "and one process (no mpirun) has none: run it with a PS task and workers, e.g. "
        "mpirun -n 3 python -m mpips train --no-progress --result result.json job.toml "
        "(1 ps + 2 workers)"
    )
    assert_said_once(r, said)
    assert "WideDeep" not in r.stderr
    shutil.copy(ROOT / "jobs/my_model.py", tmp_path / "my_model.py")
    (tmp_path / "mistakes.py").write_text(MISTAKES)
    text = text.replace('kind = "logreg"', 'kind = "mistakes:build"')
    (tmp_path / "job.toml").write_text(
        text.replace("hidden = [4]\n", "").replace("[data]", '[model.args]\nkind = "Ctr"\n[data]')
    )
    r = run(tmp_path, None)
    assert_said_once(r, "model.kind = 'mistakes:build (CtrRebinds)' keeps its tables")
    assert "mpirun -n 3 python -m mpips train" in r.stderr


def test_unwritten_elements_are_counted_across_chunks(monkeypatch):
    """The first-step check counts marked elements a chunk at a time (no buffer-sized
    temporary): a count that spans chunk boundaries is still exact."""
    monkeypatch.setattr(model_api, "CHECK_CHUNK", 3)
    g = np.zeros((4, 5), np.float32)
    model_api._bits(g).flat[[0, 2, 3, 7, 19]] = model_api.UNWRITTEN[4]
    g.flat[[4, 5]] = np.nan  # written NaN: not counted
    assert model_api._unwritten_count(g) == 5
    assert model_api._unwritten_count(g[:, ::2]) == 4  # any layout: 0, 2, 7, 19
    assert model_api._unwritten_count(np.zeros(0, np.float32)) == 0

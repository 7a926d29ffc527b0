"""`python -m mpips eval` and `predict`: a checkpoint evaluated and used in one process, for a
built-in model and a model of your own; the wrong model or a bad input file is one message."""

import json
import re
import shutil

import h5py
import numpy as np
import pytest
from conftest import ROOT, run_mpi, run_py

pytestmark = pytest.mark.launcher


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    shutil.copy(ROOT / "jobs/my_model.py", d)
    shutil.copy(ROOT / "jobs/my_model.toml", d)
    for args in (["--steps", "200"], ["my_model.toml", "--steps", "200"]):
        r = run_mpi(
            3,
            [
                "-m",
                "mpips",
                "train",
                *args,
                "--no-progress",
                "--result",
                f"result-{len(args)}.json",
            ],
            cwd=d,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr[-3000:]
    return d


@pytest.mark.parametrize(
    "job,result", [([], "result-2.json"), (["my_model.toml"], "result-3.json")]
)
def test_eval_of_the_final_checkpoint_matches_the_runs_own_evaluation(trained, job, result):
    r = run_py(["-m", "mpips", "eval", *job], cwd=trained, timeout=60)
    assert r.returncode == 0, r.stderr
    acc = float(re.search(r"test_accuracy ([0-9.]+)", r.stdout).group(1))
    final = json.loads((trained / result).read_text())
    assert final["global_step"] == 200 and "global_step 200" in r.stdout
    assert acc == pytest.approx(final["test_accuracy"], abs=5e-5)


def test_predict_writes_probabilities_that_agree_with_eval(trained):
    from mpips.data.batches import open_dataset, resolve_path

    info = open_dataset(resolve_path("", "digits"))
    with h5py.File(info.path) as f:
        x, y = f["test/x"][()], f["test/y"][()]
    np.savez(trained / "inputs.npz", x=x)
    r = run_py(
        ["-m", "mpips", "predict", "--input", "inputs.npz", "--output", "p.npy"],
        cwd=trained,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    p = np.load(trained / "p.npy")
    assert p.shape == (len(y), 10) and np.allclose(p.sum(axis=1), 1, atol=1e-5)
    final = json.loads((trained / "result-2.json").read_text())
    assert (p.argmax(axis=1) == y).mean() == pytest.approx(final["test_accuracy"], abs=5e-5)


def test_the_wrong_model_or_a_bad_input_is_one_message(trained):
    r = run_py(
        ["-m", "mpips", "eval", "my_model.toml", "--ckpt", "runs/default"], cwd=trained, timeout=60
    )
    assert (
        r.returncode == 2
        and "written by model 'mlp', but the job's model.kind is 'my_model:build'" in r.stderr
        and "Traceback" not in r.stderr
    ), r.stderr
    np.save(trained / "words.npy", np.array(["a", "b"]))
    np.save(trained / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(trained / "narrow.npy", np.zeros((3, 5), np.float32))
    for name, said in (
        ("words.npy", "holds <U1 values, not numbers"),
        ("objects.npy", "unreadable"),
        ("narrow.npy", "shape [3, 5], the model takes rows of 64 inputs"),
        ("missing.npy", "not found"),
        ("x.csv", "give a .npy, .npz"),
    ):
        r = run_py(
            ["-m", "mpips", "predict", "--input", name, "--output", "o.npy"],
            cwd=trained,
            timeout=60,
        )
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, (
            name,
            r.stderr,
        )
    assert not (trained / "o.npy").exists()
    r = run_py(
        ["-m", "mpips", "predict", "my_model.toml", "--input", "inputs.npz", "--output", "q.npy"],
        cwd=trained,
        timeout=60,
    )
    q = np.load(trained / "q.npy")  # the README's model predicts class probabilities
    assert r.returncode == 0 and q.shape == (360, 10) and np.allclose(q.sum(axis=1), 1), r.stderr
    (trained / "blind.py").write_text(  # predict is optional: a model without it is told so
        "import my_model\n"
        "class Blind(my_model.Softmax):\n"
        "    predict = my_model.mpips.Model.predict\n"
        "def build(data, l2=0.0):\n"
        "    return Blind(data.num_inputs, data.num_classes, l2)\n"
    )
    (trained / "blind.toml").write_text(
        (trained / "my_model.toml").read_text().replace("my_model:build", "blind:build")
    )
    shutil.copytree(trained / "runs/my_model", trained / "runs/blind", dirs_exist_ok=True)
    for manifest in (trained / "runs/blind").glob("*.json"):
        manifest.write_text(manifest.read_text().replace("my_model:build", "blind:build"))
    r = run_py(
        [
            "-m",
            "mpips",
            "predict",
            "blind.toml",
            "--ckpt",
            "runs/blind",
            "--input",
            "inputs.npz",
            "--output",
            "b.npy",
        ],
        cwd=trained,
        timeout=60,
    )
    assert r.returncode == 2 and "Blind does not implement predict" in r.stderr, r.stderr

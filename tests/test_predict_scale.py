"""`predict` on input that is already scaled: the data's x_scale and the training inputs' range
decide whether rows are raw; rows that look scaled are refused unless the user says which
(--input-scaled, --input-raw), and an explicit choice at odds with the range is warned about.
Scaled twice, rows of pixels in [0, 1] gave confident nonsense (one class for every row)."""

import h5py
import numpy as np
import pytest
from conftest import run_py
from mpi4py import MPI

import mpips
from mpips.data import batches as data
from mpips.errors import DataError
from mpips.run import evaluation


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The built-in digits job (x_scale 1/16: raw pixels 0..16), trained 60 steps in this
    process; its job, and 40 test rows raw and scaled, with their labels."""
    d = tmp_path_factory.mktemp("predict_scale")
    job = mpips.load_job(None)
    job.train.steps, job.train.progress = 60, False
    job.checkpoint.dir = str(d / "ckpt")
    mpips.train(job, comm=MPI.COMM_SELF)
    with h5py.File(data.resolve_path("", "digits")) as f:
        x, y = f["test/x"][:40], f["test/y"][:40]
    np.save(d / "raw.npy", x)
    np.save(d / "scaled.npy", x.astype(np.float32) / 16)  # as TF1's mnist.test.images are
    return d, job, y


def predicted(trained, name, **kw):
    """The classes predict gives for the rows of ``name``, and the warnings it said."""
    d, job, _ = trained
    said: list[str] = []
    out = d / f"p-{name}-{kw.get('input_scaled')}.npy"
    evaluation.predict(job, str(d / f"{name}.npy"), str(out), warn=said.append, **kw)
    return np.load(out).argmax(axis=1), said


def test_raw_rows_are_scaled_as_training_rows_are(trained):
    classes, said = predicted(trained, "raw")
    assert (classes == trained[2]).mean() >= 0.8 and not said


def test_rows_already_scaled_are_refused_unless_the_user_says_so(trained):
    d, job, y = trained
    with pytest.raises(DataError) as e:
        evaluation.predict(job, str(d / "scaled.npy"), str(d / "p.npy"))
    said = str(e.value)
    assert "values span [0, 1], like the training inputs after x_scale 0.0625" in said
    assert "--input-scaled" in said and "--input-raw" in said and "\n" not in said
    assert not (d / "p.npy").exists()
    scaled, warned = predicted(trained, "scaled", input_scaled=True)
    raw, _ = predicted(trained, "raw")
    assert (scaled == raw).all() and not warned  # the same rows, the same classes


def test_an_explicit_choice_at_odds_with_the_range_is_warned_about(trained):
    _, said = predicted(trained, "scaled", input_scaled=False)
    assert len(said) == 1 and "like the training inputs after x_scale" in said[0]
    assert "--input-raw: multiplied by x_scale all the same" in said[0]
    _, said = predicted(trained, "raw", input_scaled=True)
    assert len(said) == 1 and "like the training inputs before x_scale ([0, 16])" in said[0]
    assert "--input-scaled: used as they are all the same" in said[0]
    _, said = predicted(trained, "raw", input_scaled=False)
    assert not said


def test_which_units_rows_look_in():
    raw = (0.0, 255.0)
    assert data_looks((0, 1), raw, 1 / 255) is True  # MNIST pixels in [0, 1]
    assert data_looks((0, 255), raw, 1 / 255) is False
    assert data_looks((0, 90), raw, 1 / 255) is False  # a dark image is still raw
    assert data_looks((-3, 2), (-0.004, 0.005), 1000.0) is True  # x_scale above 1
    assert data_looks((-0.004, 0.003), (-0.004, 0.005), 1000.0) is False
    assert data_looks((0, 0), raw, 1 / 255) is None  # zeros: the same either way
    assert data_looks((0, 1), (0, 0), 1 / 255) is None


def data_looks(span, raw, x_scale):
    return evaluation.looks_scaled(span, raw, x_scale)


def test_the_training_range_is_read_in_blocks_or_taken_from_the_file(tmp_path, monkeypatch):
    x = np.zeros((50, 4), np.float32)
    x[37, 2], x[45, 1] = 200.0, -3.0  # past the first blocks; 45 past RANGE_ROWS below
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["train/x"], f["train/y"] = x, np.arange(50) % 2
        f["test/x"], f["test/y"] = x[:5], np.arange(5) % 2
        f.attrs["x_scale"] = 0.01
    monkeypatch.setattr(data, "SCAN_BYTES", 4 * 4 * 8)  # 8 rows a block
    monkeypatch.setattr(data, "RANGE_ROWS", 40)
    assert data.raw_range(data.open_dataset(str(path))) == (0.0, 200.0)
    with h5py.File(path, "a") as f:
        f.attrs["x_range"] = [-3.0, 200.0]  # recorded by whoever wrote the file: not scanned
    assert data.raw_range(data.open_dataset(str(path))) == (-3.0, 200.0)
    for bad in ([5.0, 1.0], [0.0, np.inf], [1.0, 2.0, 3.0], "0..255"):
        with h5py.File(path, "a") as f:
            f.attrs["x_range"] = bad
        with pytest.raises(DataError, match="the attribute x_range must be the train inputs'"):
            data.raw_range(data.open_dataset(str(path)))


@pytest.mark.launcher
def test_the_command_line_says_which_option_to_give(trained):
    d = trained[0]
    argv = [
        "-m",
        "mpips",
        "predict",
        "--ckpt",
        "ckpt",
        "--input",
        "scaled.npy",
        "--output",
        "o.npy",
    ]
    r = run_py(argv, cwd=d)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("mpips: error: --input scaled.npy: its values span [0, 1]")
    assert not (d / "o.npy").exists()
    r = run_py([*argv, "--input-scaled"], cwd=d)
    assert r.returncode == 0 and not r.stderr, r.stderr
    assert (np.load(d / "o.npy").argmax(axis=1) == trained[2]).mean() >= 0.8
    r = run_py([*argv, "--input-raw"], cwd=d)
    assert r.returncode == 0 and r.stderr.startswith("mpips: warning: --input scaled.npy"), r
    r = run_py([*argv, "--input-raw", "--input-scaled"], cwd=d)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr, r.stderr

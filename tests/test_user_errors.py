"""Mistakes in the user's own model and job reach the user as their file and line and a
one-line cause, not as mpips's traceback and MPI_Abort's noise (-v or MPIPS_VERBOSE=1
keeps the full traceback); a model.kind naming a file says to drop the .py, and a data.path
naming a raw dataset says which converter makes a data file of it."""

import gzip
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_env, dense_data_file, run_mpi, run_train

import mpips
from mpips.data import batches as data
from mpips.errors import ConfigError, DataError
from mpips.models.contract import build_from_factory, first_loss_and_grads, import_factory
from mpips.process import failure


class Info:
    num_inputs, num_classes = 4, 3


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """A folder of the user's modules, imported from; forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        sys.modules.pop(name)


def test_a_file_name_as_model_kind_says_to_drop_the_py(user_modules):
    (user_modules / "ue_net.py").write_text("def build(data):\n    return None\n")
    (user_modules / "ue_needs.py").write_text("import ue_no_such_module\n")
    with pytest.raises(ConfigError) as e:
        import_factory("ue_net.py:build")
    assert "drop the .py" in str(e.value) and 'model.kind = "ue_net:build"' in str(e.value)
    with pytest.raises(ConfigError) as e:  # a module the user's module imports is missing
        import_factory("ue_needs.py:build")
    said = str(e.value)
    assert "drop the .py" not in said
    assert "No module named 'ue_no_such_module' at ue_needs.py:1" in said, said


def test_a_module_or_factory_that_raises_names_its_line(user_modules):
    (user_modules / "ue_imp.py").write_text("import math\nratio = 1 / 0\n")
    (user_modules / "ue_boom.py").write_text(
        "def build(data, width=1):\n    raise ValueError(f'width {width} is too small')\n"
    )
    with pytest.raises(ConfigError, match=r"ZeroDivisionError: division by zero at ue_imp.py:2"):
        import_factory("ue_imp:build")
    with pytest.raises(
        ConfigError, match=r"raised ValueError: width 5 is too small at ue_boom.py:2"
    ):
        build_from_factory(import_factory("ue_boom:build"), Info(), np, {"width": 5}, "the model")


def test_the_users_frame_is_found_under_numpy_and_the_layers(user_modules):
    (user_modules / "ue_model.py").write_text(
        "import numpy as np\n"
        "import mpips\n"
        "from mpips.layers import dense_forward\n"
        "class M(mpips.Model):\n"
        "    def variables(self):\n"
        "        return [mpips.Variable('w', (4, 3))]\n"
        "    def loss_and_grads(self, params, x, y, grads, ready=None):\n"
        "        if y is None:\n"
        "            return float(np.linalg.inv(params['w']).sum())\n"  # numpy raises
        "        return float(dense_forward(x, params['w'], params['w'][0]).sum())\n"
    )
    from ue_model import M

    w = np.zeros((4, 3), np.float32)
    for y, line, source, kind in (
        (None, 9, "return float(np.linalg.inv(params['w']).sum())", "LinAlgError"),
        (1, 10, "return float(dense_forward(x, params['w'], params['w'][0]).sum())", "ValueError"),
    ):
        with pytest.raises(Exception) as e:  # (under mpips's own first_loss_and_grads)
            first_loss_and_grads(M(), {"w": w}, np.ones((2, 5)), y, {"w": w.copy()})
        said = failure.in_user_code(e.value)
        assert said.startswith(f"ue_model.py:{line}: in loss_and_grads: {kind}: "), said
        assert said.endswith(f"\n    {source}"), said
    with pytest.raises(ZeroDivisionError) as e:  # raised by mpips itself: its bug, not yours
        data.worker_rows(10, 0, 0)
    assert failure.user_frame(e.value) is None and failure.in_user_code(e.value) == ""
    for path, whose in (
        (data.__file__, "mpips"),
        (str(Path(mpips.__file__).parent / "layers.py"), "library"),  # what models call
        (str(Path(mpips.__file__).parent / "models/mlp.py"), "library"),
        (str(Path(mpips.__file__).parent / "models/contract.py"), "mpips"),
        (str(Path(mpips.__file__).parent / "process/failure.py"), "mpips"),
        (np.__file__, "library"),
        (gzip.__file__, "library"),
        ("<frozen importlib._bootstrap>", "library"),
        (str(user_modules / "ue_model.py"), "user"),
        (str(ROOT / "jobs/my_model.py"), "user"),
    ):
        assert failure._whose(path) == whose, path


@pytest.mark.parametrize(
    "name,said",
    [
        ("mnist", "a folder of idx files (MNIST's format), not a data file: make a data file "
         "from it once with `python -m mpips data fashion-mnist OUT.h5 --src {d}/mnist`"),
        ("mnist/train-images-idx3-ubyte.gz", "an idx file (MNIST's format), not a data file: "
         "make a data file from it once with `python -m mpips data fashion-mnist OUT.h5 "
         "--src {d}/mnist` (its folder)"),
        ("mnist/t10k-labels-idx1-ubyte", "an idx file (MNIST's format)"),
        ("downloads", "a directory, not a data file (HDF5 or .npz): make a data file from it "
         "once with `python -m mpips data KIND OUT.h5 --src FILE`"),
        ("data.h5", "gzip-compressed, not a data file (HDF5 or .npz): decompress it and make "
         "a data file from it once with `python -m mpips data KIND OUT.h5 --src FILE`"),
    ],
)  # fmt: skip
def test_data_path_naming_a_raw_dataset_says_how_to_convert_it(tmp_path, name, said):
    (tmp_path / "mnist").mkdir()
    (tmp_path / "downloads").mkdir()
    (tmp_path / "mnist/train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\0\0\x08\x03"))
    (tmp_path / "mnist/t10k-labels-idx1-ubyte").write_bytes(b"\0\0\x08\x01" + bytes(8))
    (tmp_path / "data.h5").write_bytes(gzip.compress(b"\x89HDF\r\n\x1a\n"))
    job = mpips.parse_job(f'[data]\npath = "{tmp_path / name}"\n[train]\nsteps = 1\n')
    with pytest.raises(DataError) as e:
        data.open_data(job.data)
    text = str(e.value)
    assert text.startswith(f"data file {tmp_path / name}: {said.format(d=tmp_path)}"), text
    assert 'then set data.path = "OUT.h5"' in text and "\n" not in text


def test_a_data_file_named_gz_that_is_not_compressed_reads(tmp_path):
    path = dense_data_file(tmp_path / "d.h5")
    shutil.copy(path, tmp_path / "d.h5.gz")  # HDF5 all the same: the bytes decide, not the name
    assert data.open_dataset(str(tmp_path / "d.h5.gz")).rows == {"train": 60, "test": 10}


MISTAKE = 'x[:, :10] @ params["w"]'  # a layer of the wrong size: (64 inputs, 10 taken)


def mistaken_model(tmp_path, where="loss_and_grads"):
    """jobs/my_model.py as ``mistake.py``, its ``where`` method taking 10 of the 64 inputs;
    its job in job.toml. Returns the mistaken line's number."""
    text = (ROOT / "jobs/my_model.py").read_text()
    start = text.index(f"def {where}(")
    at = text.index('x @ params["w"]', start)
    text = text[:at] + MISTAKE + text[at + len('x @ params["w"]') :]
    (tmp_path / "mistake.py").write_text(text)
    job = (ROOT / "jobs/my_model.toml").read_text().replace("my_model:build", "mistake:build")
    (tmp_path / "job.toml").write_text(job.replace("runs/my_model", "runs/mistake"))
    return text[:at].count("\n") + 1


def assert_led_by_the_users_line(stderr, line, where="loss_and_grads"):
    lines = stderr.splitlines()
    assert lines[0].startswith(f"mistake.py:{line}: in {where}: ValueError: matmul: "), stderr
    assert lines[1].strip().startswith("z = " + MISTAKE), stderr
    assert "Traceback" not in stderr and "MPI_Abort" not in stderr, stderr
    assert "-v, or MPIPS_VERBOSE=1" in lines[2], stderr


@pytest.mark.launcher
def test_a_model_mistake_leads_with_the_users_line_on_every_path(tmp_path):
    line = mistaken_model(tmp_path)
    argv = ["-m", "mpips", "train", "job.toml", "--no-progress"]
    r = run_mpi(3, argv, cwd=tmp_path, timeout=120, MPIPS_VERBOSE="0")
    assert r.returncode == 1, r.stderr
    assert_led_by_the_users_line(r.stderr, line)
    assert len(r.stderr.splitlines()) <= 4, r.stderr  # and one line for the other worker
    # either worker may be the first of the node to explain; the other says one line
    explained = re.search(
        r"mpips: rank (1|2) \(/job:worker/task:(0|1)\) failed there; aborting", r.stderr
    )
    assert explained and int(explained[1]) == int(explained[2]) + 1, r.stderr
    r = subprocess.run(  # one process, without mpirun
        [sys.executable, *argv],
        cwd=tmp_path,
        env=clean_env(MPIPS_VERBOSE="0"),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 1, r.stderr
    assert_led_by_the_users_line(r.stderr, line)
    r = run_mpi(3, argv, cwd=tmp_path, timeout=120, MPIPS_VERBOSE="1")
    assert r.returncode == 1 and r.stderr.count("Traceback (most recent call last)") == 1
    assert f'mistake.py", line {line}, in loss_and_grads' in r.stderr, r.stderr


@pytest.mark.launcher
def test_eval_of_a_mistaken_model_leads_with_the_users_line(tmp_path):
    mistaken_model(tmp_path)
    shutil.copy(ROOT / "jobs/my_model.py", tmp_path / "mistake.py")  # trains as it should
    r = run_train(tmp_path, None, "job.toml", "--steps", "20", timeout=120)
    assert r.returncode == 0, r.stderr
    line = mistaken_model(tmp_path, "predict")  # evaluate() calls predict(): the last frame
    env = clean_env(MPIPS_VERBOSE="0")
    for extra, traceback in (([], False), (["-v"], True)):
        r = subprocess.run(
            [sys.executable, "-m", "mpips", "eval", "job.toml", *extra],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert r.returncode == 1 and ("Traceback" in r.stderr) == traceback, r.stderr
        if not traceback:
            assert_led_by_the_users_line(r.stderr, line, "predict")
            assert r.stderr.splitlines()[2].startswith("mpips: eval failed there"), r.stderr
            assert len(r.stderr.splitlines()) == 3, r.stderr


@pytest.mark.launcher
def test_a_closed_pipe_stays_quiet(tmp_path):
    """`layout | head`: the reader goes, and no traceback follows (the commands' handler of
    the user's mistakes comes after it)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "mpips", "layout", "-n", "20000"],
        cwd=tmp_path,
        env=clean_env(MPIPS_VERBOSE="0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert p.stdout.readline().startswith(b"job digits-mlp")
    p.stdout.close()
    err = p.stderr.read()
    assert p.wait(timeout=120) == 0 and not err, err

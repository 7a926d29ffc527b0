"""What mpips checks in the data it reads: every data file is a regular file (a FIFO blocks,
a device never ends), every input is a finite number, a batch larger than a worker's part is
said, a streamed part is shuffled at both levels; and which directory relative paths of a
job refer to."""

import math
import os
import shutil
import typing

import h5py
import numpy as np
import pytest
from conftest import ROOT, run_py, run_train

from mpips.data import batches as data
from mpips.data import convert, sparse
from mpips.data.ctr_convert import convert_libsvm
from mpips.errors import ConfigError, DataError
from mpips.job import DataConfig, Job, parse_job


def digits_arrays():
    """The digits that ship with mpips as float32 rows and labels: (x, y, x_test, y_test)."""
    info = data.open_dataset(data.resolve_path("", "digits"))
    return (*data.load_split(info, "train"), *data.load_split(info, "test"))


# -- data files that are not regular files ----------------------------------------------------


JOB = "[data]\n{data}\n[train]\nsteps = 1\n"


@pytest.mark.launcher
@pytest.mark.parametrize(
    "data_keys, special",
    [
        ('path = "d.h5"', "d.h5"),
        ('path = "d.npz"', "d.npz"),
        ('train_x = "x.npy"\ntrain_y = "y.npy"\ntest_x = "x.npy"\ntest_y = "y.npy"', "x.npy"),
        ('path = "/dev/zero"', None),
    ],
    ids=["h5-fifo", "npz-fifo", "npy-fifo", "dev-zero"],
)
def test_a_data_file_that_is_a_fifo_or_a_device_is_one_message(tmp_path, data_keys, special):
    """Opening a FIFO blocks until a writer comes (never): the job said nothing, forever."""
    x, y, _, _ = digits_arrays()
    np.save(tmp_path / "y.npy", y)
    if special:
        os.mkfifo(tmp_path / special)
    (tmp_path / "job.toml").write_text(JOB.format(data=data_keys))
    r = run_py(["-m", "mpips", "layout", "job.toml", "-n", "2"], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    if special:
        assert f"data file {special}: is a FIFO, not a regular file" in line
    else:
        assert "data file /dev/zero: is a device, not a regular file" in line


@pytest.mark.launcher
@pytest.mark.parametrize(
    "args, special",
    [
        (["arrays", "out.h5", "--src", "in.npz"], "in.npz"),
        (["libsvm", "out.h5", "--src", "in.txt"], "in.txt"),
        (["criteo", "out.h5", "--src", "in.txt"], "in.txt"),
        (["fashion-mnist", "out.h5", "--src", "."], "train-images-idx3-ubyte"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else None,
)
def test_a_converter_input_that_is_a_fifo_is_one_message(tmp_path, args, special):
    os.mkfifo(tmp_path / special)
    r = run_py(["-m", "mpips", "data", *args], tmp_path, timeout=60)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert f"{special}: is a FIFO, not a regular file" in line
    assert not (tmp_path / "out.h5").exists()


# -- values that are not finite ---------------------------------------------------------------


def write_h5(path, x, y, xt, yt, **attrs):
    with h5py.File(path, "w") as f:
        f["train/x"], f["train/y"], f["test/x"], f["test/y"] = x, y, xt, yt
        f.attrs.update(attrs)
    return str(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_value_that_is_not_finite_names_the_file_split_and_row(tmp_path, bad):
    x, y, xt, yt = digits_arrays()
    x[700, 5] = x[900, 1] = bad
    path = write_h5(tmp_path / "d.h5", x, y, xt, yt)
    info = data.open_data(DataConfig(path=path))
    want = (
        f"data file {path}: train row 700 (dataset 'train/x') holds {bad} at input 5: "
        f"mpips trains on finite numbers only"
    )
    with pytest.raises(DataError, match=want.replace("(", r"\(").replace(")", r"\)")):
        data.load_split(info, "train")
    assert data.load_split(info, "train", (0, 700))[0].shape == (700, 64)  # rows before it
    assert np.isfinite(data.load_split(info, "test")[0]).all()
    with pytest.raises(DataError, match="train row 700 "):  # a worker's part
        data.train_part(info, (650, 1437))
    part = data.train_part(info, (0, 1437), chunk_rows=128)  # streamed: the chunk that has it
    with pytest.raises(DataError, match=r"train row (700|900) \(dataset 'train/x'\) holds"):
        for _ in part.batches(32, seed=0, task=1, epochs=1):
            pass


def test_other_containers_and_what_is_not_wrong(tmp_path):
    x, y, xt, yt = digits_arrays()
    xt[3, 63] = np.nan
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    info = data.open_data(DataConfig(path=str(tmp_path / "d.npz")))
    with pytest.raises(DataError, match=r"test row 3 \(array 'x_test'\) holds nan at input 63"):
        data.load_split(info, "test")
    info = data.open_data(DataConfig(), {"train": (x, y), "test": (xt, yt)})
    with pytest.raises(DataError, match=r"data arrays: test row 3 \(array 'test/x'\) holds nan"):
        data.load_split(info, "test")
    # finite values whose sum overflows float32 are fine; x_scale that overflows them is not
    big = np.full((8, 4), 3e38, np.float32)
    path = write_h5(tmp_path / "big.h5", big, np.arange(8) % 2, big, np.arange(8) % 2)
    assert data.load_split(data.open_data(DataConfig(path=path)), "train")[0].max() == 3e38
    info = data.open_data(DataConfig(path=path, x_scale=2.0))
    with pytest.raises(DataError, match=r"row 0 \(dataset 'train/x' times x_scale 2.0\) holds inf"):
        data.load_split(info, "train")


def test_a_sparse_value_that_is_not_finite_names_the_row(tmp_path):
    import scipy.sparse as sp

    x = sp.csr_matrix(np.eye(6, 10, dtype=np.float32))
    x.data[4] = np.nan  # row 4's only feature, id 4
    labels = np.arange(6) % 2
    sparse.write_csr(tmp_path / "s.h5", (x, labels), (x, labels), 10)
    info = data.open_data(DataConfig(path=str(tmp_path / "s.h5")))
    with pytest.raises(DataError, match="train row 4 holds nan for feature id 4"):
        data.load_split(info, "train")
    with pytest.raises(DataError, match="test row 4 holds nan"):
        data.load_split(info, "test", (2, 6))
    assert data.load_split(info, "train", (0, 4))[0].shape == (4, 10)


def test_converters_refuse_values_that_are_not_finite(tmp_path):
    x, y, _, _ = digits_arrays()
    x[12, 7] = np.inf
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    with pytest.raises(DataError, match=r"mine.npz: x row 12 holds inf at input 7"):
        convert.convert_arrays(tmp_path / "out.h5", str(tmp_path / "mine.npz"))
    (tmp_path / "a.svm").write_text("1 3:0.5\n0 2:nan 4:1\n")
    with pytest.raises(DataError, match=r"a.svm:2: not a libsvm line \(a value that is not a"):
        convert_libsvm(tmp_path / "out.h5", tmp_path / "a.svm")
    (tmp_path / "b.svm").write_text("1 3:0.5\nnan 2:1\n")
    with pytest.raises(DataError, match=r"b.svm:2: not a libsvm line \(label 'nan'"):
        convert_libsvm(tmp_path / "out.h5", tmp_path / "b.svm")
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.launcher
def test_nan_in_the_data_stops_a_job_at_start_up_with_one_message(tmp_path):
    """Not ``the loss is nan ... learning rate too high?`` after training began."""
    x, y, xt, yt = digits_arrays()
    x[1000, 0] = np.nan
    write_h5(tmp_path / "d.h5", x, y, xt, yt)
    (tmp_path / "job.toml").write_text(JOB.format(data='path = "d.h5"'))
    r = run_train(tmp_path, 3, "job.toml", timeout=90)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln]
    assert errors == [
        "mpips: error: data file d.h5: train row 1000 (dataset 'train/x') holds nan at input "
        "0: mpips trains on finite numbers only (fix or drop that row)"
    ], r.stderr[-3000:]


# -- job keys ----------------------------------------------------------------------------------


def float_keys():
    """Every float key of a job file, as ``section.name``."""
    out = []
    for section, t in typing.get_type_hints(Job).items():
        if isinstance(t, type) and hasattr(t, "__dataclass_fields__"):
            out += [f"{section}.{k}" for k, h in typing.get_type_hints(t).items() if h is float]
    return out


def test_every_float_key_is_covered():
    assert {"optimizer.learning_rate", "checkpoint.every_secs", "optimizer.clip_norm"} <= set(
        float_keys()
    )
    assert len(float_keys()) >= 12


@pytest.mark.parametrize("key", float_keys())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "+nan"])
def test_every_float_key_refuses_nan_and_infinity(key, value):
    section, name = key.split(".")
    text = '[data]\nbuiltin = "digits"\n[train]\nsteps = 1\n'
    text = text.replace(f"[{section}]\n", f"[{section}]\n{name} = {value}\n")
    if f"[{section}]" not in text:
        text += f"[{section}]\n{name} = {value}\n"
    shown = {"+nan": "nan"}.get(value, value)
    with pytest.raises(ConfigError, match=f"job.toml: {key}: must be a finite number, got {shown}"):
        parse_job(text, "job.toml")


def test_overrides_and_python_jobs_are_checked_too():
    from mpips.job import validate

    job = parse_job('[data]\nbuiltin = "digits"\n[train]\nsteps = 1\n')
    job.optimizer.learning_rate = math.nan
    with pytest.raises(ConfigError, match="optimizer.learning_rate: must be a finite number"):
        validate(job)


# -- batches larger than a worker's part -------------------------------------------------------


def test_a_batch_larger_than_the_part_is_the_part_and_said_once(capsys):
    x, y = np.zeros((10, 2), np.float32), np.arange(10)
    got = list(data.batches(x, y, 10**12, seed=0, task=0, epochs=2))
    assert [len(b) for _, b, _ in got] == [10, 10]
    (line,) = capsys.readouterr().out.splitlines()
    assert line == (
        "[/job:worker/task:0] warning: train.batch_size = 1000000000000 is more than the 10 "
        "train rows of this worker's part: its batches hold 10 rows (lower "
        "train.batch_size to say what is used)"
    )
    list(data.batches(x, y, 10**12, seed=0, task=1, epochs=1))  # worker 0 says it, not each
    list(data.batches(x, y, 10, seed=0, task=0, epochs=1))  # a batch that fits: nothing
    assert capsys.readouterr().out == ""


@pytest.mark.launcher
def test_a_job_with_an_oversized_batch_says_it_once(tmp_path):
    (tmp_path / "job.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nsteps = 4\nbatch_size = 1000000000000\n'
    )
    r = run_train(tmp_path, 4, "job.toml", timeout=90)  # 1 PS, 3 workers of 479 rows
    assert r.returncode == 0, r.stderr[-3000:]
    said = [ln for ln in r.stdout.splitlines() if "batch_size" in ln]
    assert said == [
        "[/job:worker/task:0] warning: train.batch_size = 1000000000000 is more than the 479 "
        "train rows of this worker's part: its batches hold 479 rows (lower "
        "train.batch_size to say what is used)"
    ], r.stdout[-3000:]


# -- the streaming shuffle ---------------------------------------------------------------------


def test_a_streamed_part_shuffles_the_rows_within_each_chunk(tmp_path):
    """The second level of the two-level shuffle: chunks in a new order each epoch, and the
    rows of each chunk in a new order too; every row once an epoch, parts disjoint."""
    rows, chunk, batch = 1000, 64, 16
    x = np.arange(rows, dtype=np.float32)[:, None]
    path = write_h5(tmp_path / "s.h5", x, np.arange(rows) % 2, x[:4], np.arange(4) % 2)
    info = data.open_data(DataConfig(path=path))
    seen = []
    for task in range(2):
        lo, hi = data.worker_rows(rows, 2, task)
        part = data.train_part(info, (lo, hi), chunk_rows=chunk)
        assert isinstance(part, data.StreamedPart)
        got = [(e, xb[:, 0].astype(int)) for e, xb, _ in part.batches(batch, 5, task, epochs=2)]
        orders = []
        for epoch in range(2):
            order = np.concatenate([b for e, b in got if e == epoch])
            assert sorted(order) == list(range(lo, hi))  # every row of the part, once
            # consecutive runs of one chunk's rows: each chunk is read whole, in one place
            chunks = (order - lo) // chunk
            runs = np.split(order, np.flatnonzero(np.diff(chunks)) + 1)
            assert len(runs) == -(-(hi - lo) // chunk)
            assert [(r - lo)[0] // chunk for r in runs] != list(range(len(runs)))  # level 1
            for r in runs:  # level 2: no chunk's rows come in file order
                assert list(r) != sorted(r), (task, epoch, r)
            orders.append({int((r - lo)[0] // chunk): list(r) for r in runs})
        assert all(orders[0][c] != orders[1][c] for c in orders[0])  # a new order each epoch
        seen.append(set(range(lo, hi)))
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(rows))


# -- relative paths -----------------------------------------------------------------------------


@pytest.mark.launcher
def test_relative_paths_are_relative_to_the_working_directory(tmp_path):
    """A job file elsewhere: its data, .npy files and checkpoints are found and written in
    the working directory; its model module is imported from beside the job file."""
    jobs, work = tmp_path / "jobs", tmp_path / "work"
    jobs.mkdir()
    (work / "data").mkdir(parents=True)
    shutil.copy(ROOT / "jobs/my_model.py", jobs / "my_model.py")
    convert.convert_digits(work / "data/digits.h5")
    text = (
        '[model]\nkind = "my_model:build"\n[data]\npath = "data/digits.h5"\n'
        '[train]\nsteps = 3\n[checkpoint]\ndir = "runs/mine"\n[summary]\ndir = "runs/sums"\n'
    )
    (jobs / "job.toml").write_text(text)
    r = run_train(work, 2, "../jobs/job.toml", timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    assert list((work / "runs/mine").glob("ckpt-*.json")) and (work / "runs/sums").is_dir()
    assert not (jobs / "runs").exists()
    # .npy files too; a missing one says where it was looked for
    x, y, xt, yt = digits_arrays()
    for name, a in {"x": x, "y": y, "xt": xt, "yt": yt}.items():
        np.save(work / "data" / f"{name}.npy", a)
    npy = 'train_x = "data/x.npy"\ntrain_y = "data/y.npy"\n'
    npy += 'test_x = "data/xt.npy"\ntest_y = "data/yt.npy"'
    (jobs / "npy.toml").write_text(JOB.format(data=npy))
    r = run_py(["-m", "mpips", "layout", "../jobs/npy.toml", "-n", "2"], work, timeout=60)
    assert r.returncode == 0 and "64x64" in r.stdout, r.stderr
    r = run_py(["-m", "mpips", "layout", "jobs/npy.toml", "-n", "2"], tmp_path, timeout=60)
    assert r.returncode == 2
    where = f"(relative to the working directory {tmp_path})"
    assert f"missing file data/x.npy (the train split) {where}" in r.stderr
    r = run_py(["-m", "mpips", "layout", "jobs/job.toml", "-n", "2"], tmp_path, timeout=60)
    assert r.returncode == 2
    assert f"data/digits.h5: not found {where}" in r.stderr

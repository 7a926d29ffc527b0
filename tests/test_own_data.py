"""Your own data: HDF5 files with dataset paths named in the job, .npz and .npy files, arrays
handed to mpips.train, and a worker's part streamed from the file in chunks."""

import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from conftest import clean_env, run_mpi

import mpips
from mpips.data import batches as data
from mpips.errors import ConfigError, DataError
from mpips.job import DataConfig


def digits_arrays():
    """The digits that ship with mpips, as plain arrays (images 8x8, labels 0..9)."""
    info = data.open_dataset(data.resolve_path("", "digits"))
    (x, y), (xt, yt) = data.load_split(info, "train"), data.load_split(info, "test")
    return x.reshape(-1, 8, 8), y, xt.reshape(-1, 8, 8), yt


def test_an_hdf5_file_of_any_layout_with_paths_from_the_job(tmp_path):
    x, y, xt, yt = digits_arrays()
    with h5py.File(tmp_path / "mine.h5", "w") as f:  # no attributes, images not flattened
        f["images/train"], f["labels/train"] = x, y.astype(np.int32)
        f["images/test"], f["labels/test"] = xt, yt.astype(np.uint8)
    config = DataConfig(
        path=str(tmp_path / "mine.h5"),
        train_x="images/train",
        train_y="labels/train",
        test_x="images/test",
        test_y="labels/test",
    )
    info = data.open_data(config)
    assert (info.num_inputs, info.num_classes) == (64, 10)  # classes: largest label + 1
    assert info.rows == {"train": 1437, "test": 360}
    got_x, got_y = data.load_split(info, "test", (5, 9))
    assert np.array_equal(got_x, xt[5:9].reshape(4, 64)) and np.array_equal(got_y, yt[5:9])
    config.num_classes, config.x_scale = 12, 0.5
    info = data.open_data(config)
    assert info.num_classes == 12 and data.load_split(info, "test", (0, 1))[
        0
    ].max() == pytest.approx(xt[0].max() * 0.5)
    config.test_x = "images/nope"
    with pytest.raises(DataError, match="missing dataset 'images/nope' \\(the test split\\)"):
        data.open_data(config)


def test_npz_and_npy_files(tmp_path):
    x, y, xt, yt = digits_arrays()
    np.savez(tmp_path / "mnist_like.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    info = data.open_data(DataConfig(path=str(tmp_path / "mnist_like.npz")))
    assert info.kind == "npz" and info.rows == {"train": 1437, "test": 360}
    assert np.array_equal(data.load_split(info, "train", (0, 3))[1], y[:3])
    for name, a in {"x": x, "y": y, "xt": xt, "yt": yt}.items():
        np.save(tmp_path / f"{name}.npy", a)
    npy = {
        k: str(tmp_path / f"{v}.npy")
        for k, v in {"train_x": "x", "train_y": "y", "test_x": "xt", "test_y": "yt"}.items()
    }
    info = data.open_data(DataConfig(**npy))
    assert info.kind == "npy" and info.num_inputs == 64
    assert np.array_equal(data.load_split(info, "train", (7, 9))[0], x[7:9].reshape(2, 64))
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}] * 1437, dtype=object))
    with pytest.raises(DataError, match="not a readable .npy dataset"):  # no pickle, ever
        data.open_data(DataConfig(**{**npy, "train_x": str(tmp_path / "objects.npy")}))


@pytest.mark.parametrize(
    "text,message",
    [
        ('train_x = "a.npy"\n', "data.train_x, data.train_y: give both or neither"),
        ('train_x = "a.npy"\ntrain_y = "b.npy"\n', ".npy files need data.train_x"),
        (
            'train_x = "a.h5"\ntrain_y = "b.npy"\ntest_x = "c.npy"\ntest_y = "d.npy"\n',
            "'a.h5' is not",
        ),
        ('builtin = "digits"\ntrain_x = "a"\ntrain_y = "b"\n', "its arrays are fixed"),
        ('path = "d.h5"\nchunk_rows = -1\n', "data.chunk_rows: must be >= 0"),
        ('path = "d.h5"\nprefetch = 0\n', "data.prefetch: must be > 0"),
    ],
)
def test_data_keys_are_checked(text, message):
    with pytest.raises(ConfigError, match=message):
        mpips.parse_job(f"[data]\n{text}[train]\nsteps = 1\n")


def test_arrays_for_the_python_api_are_checked():
    x, y, xt, yt = digits_arrays()
    info = data.open_data(DataConfig(), {"train": (x, y), "test": (list(xt), list(yt))})
    assert info.rows == {"train": 1437, "test": 360} and info.num_inputs == 64
    with pytest.raises(DataError, match="no data: give data.path"):
        data.open_data(DataConfig())
    with pytest.raises(DataError, match="give 'train' and 'test'"):
        data.open_data(DataConfig(), {"train": (x, y)})
    with pytest.raises(DataError, match="has 1437 rows but array 'train/y' has 3"):
        data.open_data(DataConfig(), {"train": (x, y[:3]), "test": (xt, yt)})


def streamed(tmp_path, rows=1000, chunk_rows=64, **config):
    x = np.arange(rows, dtype=np.float32)[:, None].repeat(3, axis=1)
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f["train/x"], f["train/y"], f["test/x"], f["test/y"] = (
            x,
            np.arange(rows) % 4,
            x[:5],
            np.arange(5) % 4,
        )
    info = data.open_data(DataConfig(path=str(tmp_path / "s.h5"), **config))
    return data.train_part(info, (100, rows - 50), chunk_rows=chunk_rows, prefetch=2)


def rows_of(batch_stream):
    return [(e, xb[:, 0].astype(int).tolist()) for e, xb, _ in batch_stream]


def test_a_streamed_part_visits_every_row_once_an_epoch_in_a_new_order(tmp_path):
    part = streamed(tmp_path)
    assert isinstance(part, data.StreamedPart)
    got = rows_of(part.batches(32, seed=1, task=2, epochs=3))
    assert got == rows_of(part.batches(32, seed=1, task=2, epochs=3))  # deterministic
    epochs = [sum((r for e, r in got if e == k), []) for k in range(3)]
    for rows in epochs:
        assert sorted(rows) == list(range(100, 950))  # every row of the part, once
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0][:64] != list(range(100, 164))  # shuffled, not file order
    sizes = [len(r) for e, r in got if e == 0]
    assert sizes.count(32) == len(sizes) - 1 and sum(sizes) == 850  # one short batch
    assert rows_of(part.batches(32, seed=2, task=2, epochs=1)) != got[: len(sizes)]


def test_a_streamed_part_resumes_at_a_data_position_and_makes_full_batches(tmp_path):
    part = streamed(tmp_path)
    straight = rows_of(part.batches(32, seed=1, task=0, epochs=2))
    for start in (0, 5, 26, 27, 40):
        assert (
            rows_of(part.batches(32, seed=1, task=0, epochs=2, start_batch=start))
            == straight[start:]
        )
    full = rows_of(part.batches(32, seed=1, task=0, epochs=2, per_epoch=20))
    assert len(full) == 40 and all(len(r) == 32 for _, r in full)  # sync: equal batches
    assert [e for e, _ in full] == [0] * 20 + [1] * 20
    resumed = rows_of(part.batches(32, seed=1, task=0, epochs=2, start_batch=13, per_epoch=20))
    assert resumed == full[13:]


def test_a_bad_label_in_a_streamed_chunk_is_a_data_error(tmp_path):
    part = streamed(tmp_path, num_classes=3)  # labels go up to 3
    with pytest.raises(DataError, match="train/y has label 3 outside 0..2"):
        for _ in part.batches(32, seed=0, task=0, epochs=1):
            pass


STREAM_RSS = """
import resource, sys, numpy as np
from mpips.data import batches as data
from mpips.job import DataConfig
info = data.open_data(DataConfig(path=sys.argv[1]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
part = data.train_part(info, (0, info.rows["train"]), chunk_rows=int(sys.argv[2]))
seen = 0
for epoch, x, y in part.batches(256, seed=0, task=0, epochs=1):
    seen += len(y)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(seen, (after - before) // 1024)
"""


def test_streaming_a_part_larger_than_its_memory_budget(tmp_path):
    """A 256 MB train split streams through one worker in chunks of 1024 rows: its peak
    memory grows by a small fraction of the file, where reading the part whole would take
    more than the file (float32 copy included)."""
    rows, width = 65536, 1024
    with h5py.File(tmp_path / "big.h5", "w") as f:
        x = f.create_dataset("train/x", (rows, width), np.float32, chunks=(256, width))
        for i in range(0, rows, 8192):
            x[i : i + 8192] = np.random.default_rng(i).standard_normal((8192, width), np.float32)
        f["train/y"] = np.arange(rows) % 10
        f["test/x"], f["test/y"] = np.zeros((10, width), np.float32), np.arange(10)
    script = tmp_path / "stream.py"
    script.write_text(STREAM_RSS)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "big.h5"), "1024"],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
    )
    assert r.returncode == 0, r.stderr
    seen, grew_mb = map(int, r.stdout.split())
    assert seen == rows
    assert grew_mb < 80, f"peak memory grew by {grew_mb} MB streaming a 256 MB file"


OWN_ARRAYS = """
import json, sys
import numpy as np
import mpips
from mpips.data import batches as data
with mpips.abort_on_error():
    info = data.open_dataset(data.resolve_path("", "digits"))
    (x, y), (xt, yt) = data.load_split(info, "train"), data.load_split(info, "test")
    job = mpips.parse_job('''
[model]
hidden = [64]
[optimizer]
learning_rate = 0.1
[train]
mode = "{mode}"
steps = 400
batch_size = 32
progress = false
''')
    result = mpips.train(job, data={{"train": (x.reshape(-1, 8, 8), y), "test": (xt, yt)}})
    if result.role.is_chief:
        json.dump({{"global_step": result.global_step, "acc": result.test_accuracy}},
                  open("r.json", "w"))
"""


@pytest.mark.launcher
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_arrays_handed_to_mpips_train(tmp_path, mode):
    (tmp_path / "own.py").write_text(OWN_ARRAYS.format(mode=mode))
    r = run_mpi(3, ["own.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["global_step"] == 400 and result["acc"] > 0.9, result


@pytest.mark.launcher
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_job_streams_its_own_hdf5_layout(tmp_path, mode):
    """A job naming dataset paths in a file of its own, each worker streaming its part in
    chunks, trains as well as from memory."""
    x, y, xt, yt = digits_arrays()
    with h5py.File(tmp_path / "mine.h5", "w") as f:
        f["tr/img"], f["tr/lab"], f["te/img"], f["te/lab"] = x, y, xt, yt
    (tmp_path / "job.toml").write_text(f"""
[data]
path = "mine.h5"
train_x = "tr/img"
train_y = "tr/lab"
test_x = "te/img"
test_y = "te/lab"
chunk_rows = 96
[train]
mode = "{mode}"
steps = 400
[checkpoint]
dir = "runs/mine"
""")
    r = run_mpi(
        3,
        ["-m", "mpips", "train", "job.toml", "--no-progress", "--result", "r.json"],
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["global_step"] == 400 and result["test_accuracy"] > 0.9, result
    assert "streamed in chunks of 96 rows" in r.stdout
    # the checkpoint evaluates from the same file, in one process
    ev = subprocess.run(
        [sys.executable, "-m", "mpips", "eval", "job.toml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert ev.returncode == 0 and "accuracy" in ev.stdout, ev.stderr


def test_small_unsigned_labels_are_counted(tmp_path):
    """Keras' mnist.npz keeps its labels as uint8: the class count comes out right."""
    x, y, xt, yt = digits_arrays()
    np.savez(
        tmp_path / "u8.npz",
        x_train=x,
        y_train=y.astype(np.uint8),
        x_test=xt,
        y_test=yt.astype(np.uint8),
    )
    info = data.open_data(DataConfig(path=str(tmp_path / "u8.npz")))
    assert info.num_classes == 10

"""Converted dense data files record the train inputs' range as the attribute ``x_range``
(float64 [min, max], raw units: before x_scale), so `predict` tells raw rows from scaled ones
without reading train rows; without it, it scanned up to 65536 of them."""

import gzip
import struct

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import mpips
from mpips.data import batches as data
from mpips.data import convert
from mpips.errors import DataError
from mpips.run import evaluation


def recorded(path):
    """The file's x_range attribute as stored, or None."""
    with h5py.File(path) as f:
        return f.attrs["x_range"] if "x_range" in f.attrs else None


def test_arrays_record_the_train_rows_range_only(tmp_path):
    x = np.full((10, 3), 5.0, np.float32)
    x[2, 1], x[6, 0] = -7.5, 90.0
    x[9, 2] = 1000.0  # in the last 20%: held out as the test split, not train
    np.savez(tmp_path / "a.npz", x=x, y=np.arange(10) % 2)
    convert.convert_arrays(tmp_path / "a.h5", str(tmp_path / "a.npz"))
    got = recorded(tmp_path / "a.h5")
    assert got.dtype == np.float64 and got.tolist() == [-7.5, 90.0]


def test_fashion_mnist_records_its_range_in_pixels(tmp_path):
    """Before x_scale (1/255): the raw units predict's --input-raw rows come in."""
    src = tmp_path / "src"
    src.mkdir()
    images = np.arange(6 * 4, dtype=np.uint8).reshape(6, 2, 2) * 10  # 0..230
    for prefix, cut in (("train", slice(0, 4)), ("t10k", slice(4, 6))):
        idx_file(src / f"{prefix}-images-idx3-ubyte.gz", images[cut])
        idx_file(src / f"{prefix}-labels-idx1-ubyte.gz", np.arange(6, dtype=np.uint8)[cut])
    convert.convert_fashion_mnist(tmp_path / "f.h5", src)
    assert recorded(tmp_path / "f.h5").tolist() == [0.0, 150.0]  # train: the first 4 images


def idx_file(path, a):
    """``a`` (uint8) as a gzipped idx file, MNIST's format."""
    head = struct.pack(">HBB", 0, 0x08, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape)
    path.write_bytes(gzip.compress(head + a.tobytes()))


def test_synthetic_and_digits_record_theirs(tmp_path):
    convert.make_synthetic(tmp_path / "s.h5", rows=30, test_rows=5, inputs=4, classes=3)
    with h5py.File(tmp_path / "s.h5") as f:
        x = f["train/x"][()]
    assert recorded(tmp_path / "s.h5").tolist() == [float(x.min()), float(x.max())]
    convert.convert_digits(tmp_path / "d.h5")
    assert recorded(tmp_path / "d.h5").tolist() == [0.0, 16.0]


def test_an_empty_or_unfinished_train_split(tmp_path):
    """No rows: the file is written (it was a ValueError from h5py's chunking), with no range,
    and reading it says what is wrong; values that are not finite are left out of the range,
    as predict's scan leaves them."""
    test = (np.ones((2, 3), np.float32), np.array([0, 1]))
    empty = (np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    convert.write_dataset(tmp_path / "e.h5", empty, test, 2)
    assert recorded(tmp_path / "e.h5") is None
    with pytest.raises(DataError, match="the train split has no rows"):
        data.open_dataset(str(tmp_path / "e.h5"))
    x = np.array([[1.0, np.nan], [-np.inf, 4.0]], np.float32)
    convert.write_dataset(tmp_path / "n.h5", (x, np.array([0, 1])), test, 2)
    assert recorded(tmp_path / "n.h5").tolist() == [1.0, 4.0]
    convert.write_dataset(tmp_path / "z.h5", (x[:, :1] * np.nan, np.array([0, 1])), test, 2)
    assert recorded(tmp_path / "z.h5") is None


@pytest.fixture
def no_train_rows_read(monkeypatch):
    """Reading the train inputs fails: whatever still works did not scan them."""
    read = h5py.Dataset.__getitem__

    def guarded(self, key):
        if self.name == "/train/x":
            raise AssertionError("the train inputs were read")
        return read(self, key)

    monkeypatch.setattr(h5py.Dataset, "__getitem__", guarded)


def test_predict_takes_the_range_from_the_converted_file(tmp_path, request):
    """Digits (x_scale 1/16) converted, trained a few steps in this process; predict then
    refuses rows scaled already, and takes raw ones, without reading a train row."""
    convert.convert_digits(tmp_path / "d.h5")
    job = mpips.load_job(None)
    job.data.builtin, job.data.path = "", str(tmp_path / "d.h5")
    job.train.steps, job.train.progress = 5, False
    job.checkpoint.dir = str(tmp_path / "ckpt")
    mpips.train(job, comm=MPI.COMM_SELF)
    with h5py.File(tmp_path / "d.h5") as f:
        x = f["test/x"][:20]
    np.save(tmp_path / "raw.npy", x)
    np.save(tmp_path / "scaled.npy", x.astype(np.float32) / 16)
    request.getfixturevalue("no_train_rows_read")
    with pytest.raises(DataError, match=r"before x_scale \(\[0, 16\]\): scaled again"):
        evaluation.predict(job, str(tmp_path / "scaled.npy"), str(tmp_path / "p.npy"))
    rows, _ = evaluation.predict(job, str(tmp_path / "raw.npy"), str(tmp_path / "p.npy"))
    assert rows == 20 and np.load(tmp_path / "p.npy").shape == (20, 10)

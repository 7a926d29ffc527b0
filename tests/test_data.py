import gzip
import struct
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpips.data import batches as data
from mpips.data import convert
from mpips.errors import DataError


def test_shards_are_disjoint_and_cover():
    for n, k in [(1437, 6), (10, 3), (7, 7), (100, 1)]:
        ranges = [data.worker_rows(n, k, i) for i in range(k)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


def test_batches_reshuffle_per_epoch_and_are_deterministic():
    x = np.arange(10, dtype=np.float32)[:, None]
    y = np.arange(10)

    def run():
        return [(e, b.tolist()) for e, _, b in data.batches(x, y, 4, seed=3, task=1, epochs=2)]

    first = run()
    assert first == run()
    assert [e for e, _ in first] == [0, 0, 0, 1, 1, 1]
    epoch0 = sum((b for e, b in first if e == 0), [])
    epoch1 = sum((b for e, b in first if e == 1), [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1


def test_builtin_digits():
    info = data.open_dataset(data.resolve_path("", "digits"))
    assert (info.num_inputs, info.num_classes, info.rows) == (64, 10, {"train": 1437, "test": 360})
    x, y = data.load_split(info, "train", (0, 5))
    assert x.dtype == np.float32 and x.max() <= 1.0 and y.dtype == np.int64


def write(path, **over):
    rng = np.random.default_rng(0)
    parts = {
        "train/x": rng.integers(0, 255, (20, 4), dtype=np.uint8),
        "train/y": rng.integers(0, 3, 20),
        "test/x": rng.integers(0, 255, (5, 4), dtype=np.uint8),
        "test/y": rng.integers(0, 3, 5),
    }
    parts.update(over)
    with h5py.File(path, "w") as f:
        for k, v in parts.items():
            if v is not None:
                f[k] = v
        f.attrs["num_classes"] = 3
    return path


@pytest.mark.parametrize(
    "over,message",
    [
        ({"test/y": None}, "missing dataset 'test/y'"),
        ({"train/x": np.zeros((20, 2, 2), np.float64)}, None),  # rows of any shape: flattened
        ({"train/x": np.full((20, 4), b"a")}, "must be rows of numbers"),
        ({"train/y": np.zeros(20, np.float32)}, "1-D integer labels"),
        ({"train/y": np.zeros(19, np.int64)}, "has 20 rows but dataset 'train/y' has 19"),
        ({"test/x": np.zeros((5, 3), np.uint8)}, "different widths"),
    ],
)
def test_malformed_data_files(tmp_path, over, message):
    if message is None:
        info = data.open_dataset(str(write(tmp_path / "d.h5", **over)))
        assert info.num_inputs == 4 and data.load_split(info, "train")[0].shape == (20, 4)
        return
    with pytest.raises(DataError, match=message):
        data.open_dataset(str(write(tmp_path / "d.h5", **over)))


def test_missing_truncated_and_bad_labels(tmp_path):
    with pytest.raises(DataError, match="not found"):
        data.open_dataset(str(tmp_path / "none.h5"))
    good = write(tmp_path / "d.h5")
    raw = Path(good).read_bytes()
    (tmp_path / "t.h5").write_bytes(raw[: len(raw) // 3])
    with pytest.raises(DataError, match="not a readable mpips HDF5 dataset"):
        data.open_dataset(str(tmp_path / "t.h5"))
    (tmp_path / "junk.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="not a readable"):
        data.open_dataset(str(tmp_path / "junk.h5"))
    bad = write(tmp_path / "b.h5", **{"train/y": np.full(20, 7)})
    with pytest.raises(DataError, match="label 7 outside 0..2"):
        data.load_split(data.open_dataset(str(bad)), "train")


def _idx(path, array):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_converter_reads_idx(tmp_path):
    rng = np.random.default_rng(0)
    imgs = {s: rng.integers(0, 256, (n, 28, 28)) for s, n in (("train", 12), ("t10k", 4))}
    for s, a in imgs.items():
        _idx(tmp_path / f"{s}-images-idx3-ubyte.gz", a)
        _idx(tmp_path / f"{s}-labels-idx1-ubyte.gz", np.arange(len(a)) % 10)
    out = tmp_path / "fm.h5"
    convert.convert_fashion_mnist(out, tmp_path)
    info = data.open_dataset(str(out))
    assert info.rows == {"train": 12, "test": 4} and info.num_inputs == 784
    x, y = data.load_split(info, "test")
    np.testing.assert_allclose(x, imgs["t10k"].reshape(4, -1) / 255, rtol=1e-6)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: not found"):
        convert.convert_fashion_mnist(tmp_path / "x.h5", tmp_path)

"""Hostile and corrupt files, in one process: HDF5 links and external storage are refused,
declared sizes are checked against each other and against memory before any allocation,
and no checkpoint ever holds NaN or infinity."""

import io
import json
import os
import warnings
import zipfile

import h5py
import numpy as np
import pytest
from conftest import dense_data_file, run_py

from mpips import checkpoint
from mpips.checkpoint import Entry, Part
from mpips.data import batches as data
from mpips.data import sparse
from mpips.errors import CheckpointError, ConfigError, DataError, NonFinite
from mpips.job import DataConfig
from mpips.models.variables import VariableSpec
from mpips.placement.layout import read_layout_file
from mpips.process.memory import ABSURD_BYTES, available_bytes

SECRET = b"the user's private file: \x00\x01\x02\x03" * 4


def secret_file(tmp_path):
    """A file outside the checkpoint directory that a crafted file tries to read."""
    path = tmp_path / "outside" / "secret.bin"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    with h5py.File(tmp_path / "outside" / "secret.h5", "w") as f:
        f["x"] = np.frombuffer(SECRET[:32], np.float32).reshape(2, 4)
    return path


def hostile(kind, f, name, tmp_path):
    """Put ``name`` into open file ``f`` as a link or dataset of ``kind`` pointing outside."""
    secret = secret_file(tmp_path)
    if kind == "external link":
        f[name] = h5py.ExternalLink(str(secret.with_suffix(".h5")), "/x")
    elif kind == "external storage":
        f.create_dataset(name, (2, 4), "float32", external=[(str(secret), 0, 32)])
    elif kind == "soft link":
        f["hidden/x"] = np.zeros((2, 4), np.float32)
        f[name] = h5py.SoftLink("/hidden/x")
    elif kind == "virtual dataset":
        layout = h5py.VirtualLayout((2, 4), "float32")
        layout[:] = h5py.VirtualSource(str(secret.with_suffix(".h5")), "x", shape=(2, 4))
        f.create_virtual_dataset(name, layout)


KINDS = ["external link", "external storage", "soft link", "virtual dataset"]
MESSAGE = {
    "external link": "is an external link",
    "soft link": "is a soft link",
    "external storage": "keeps its data in an external file",
    "virtual dataset": "is a virtual dataset",
}


def crafted_checkpoint(tmp_path, kind):
    """A committed checkpoint whose shard holds variable 'w' as ``kind``."""
    d = tmp_path / "ck"
    d.mkdir()
    with h5py.File(d / checkpoint.shard_name(3, 0, 1), "w") as f:
        f.attrs["format"] = checkpoint.FORMAT
        hostile(kind, f, "variables/w", tmp_path)
    checkpoint.commit(d, 3, 1, {"w": Entry((2, 4), "float32", (Part(0),))}, {}, {})
    return d


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_that_points_outside_is_refused(tmp_path, kind):
    d = crafted_checkpoint(tmp_path, kind)
    ckpt = checkpoint.resolve(d)
    with pytest.raises(CheckpointError, match=MESSAGE[kind]):
        ckpt.read([VariableSpec("w", (2, 4))])
    for cmd in (["export", str(d), str(tmp_path / "out.h5")], ["inspect", str(d)]):
        r = run_py(["-m", "mpips", "ckpt", *cmd], cwd=tmp_path)
        assert r.returncode == 2 and MESSAGE[kind] in r.stderr, (r.returncode, r.stderr)
        assert r.stderr.count("mpips: error") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "out.h5").exists()


def dense_file(path, **over):
    return dense_data_file(path, train=20, test=5, **over)


@pytest.mark.parametrize("kind", KINDS)
def test_a_data_file_that_points_outside_is_refused(tmp_path, kind):
    path = tmp_path / "d.h5"
    dense_file(path)
    with h5py.File(path, "a") as f:
        del f["test/x"]
        hostile(kind, f, "test/x", tmp_path)
    with pytest.raises(DataError, match=MESSAGE[kind]):
        data.open_dataset(str(path))


def manifest_declaring(tmp_path, shape, parts=None):
    d = tmp_path / "ck"
    checkpoint.write_shard(d, 5, 0, 1, {"w": np.zeros((2, 4), np.float32)})
    checkpoint.commit(d, 5, 1, {"w": Entry((2, 4), "float32", (Part(0),))}, {}, {})
    raw = json.loads((d / "ckpt-5.json").read_text())
    raw["variables"]["w"]["shape"] = shape
    if parts is not None:
        raw["variables"]["w"]["parts"] = parts
        raw["shards"] = len(parts)
    (d / "ckpt-5.json").write_text(json.dumps(raw))
    return d


def test_a_manifest_declaring_70_tib_is_refused_before_allocation(tmp_path):
    d = manifest_declaring(tmp_path, [70 << 40 >> 2])  # 70 TiB of float32
    ckpt = checkpoint.resolve(d)  # parsing allocates nothing per row
    with pytest.raises(CheckpointError, match=r"needs 70\.0 TiB, more than the .* available"):
        ckpt.read_all()
    r = run_py(["-m", "mpips", "ckpt", "export", "ck", "out.h5"], cwd=tmp_path)
    assert r.returncode == 2 and "needs 70.0 TiB" in r.stderr and "Traceback" not in r.stderr


def test_partitions_of_a_huge_table_are_checked_without_allocating(tmp_path):
    """Coverage of 10^13 rows in two parts is arithmetic (the old check allocated a counter
    per row: a MemoryError); a gap or an overlap is still found."""
    rows = 10**13
    d = manifest_declaring(
        tmp_path,
        [rows, 1],
        [{"shard": 0, "rows": [0, rows, 2]}, {"shard": 1, "rows": [1, rows, 2]}],
    )
    assert checkpoint.resolve(d).variables["w"].shape == (rows, 1)
    for parts in (
        [[0, rows, 2], [2, rows, 2]],
        [[0, rows, 2], [0, rows, 2]],
        [[0, rows // 2, 1], [rows // 2 + 1, rows, 1]],
    ):
        d = manifest_declaring(
            tmp_path / str(len(list(tmp_path.iterdir()))),
            [rows, 1],
            [{"shard": k, "rows": p} for k, p in enumerate(parts)],
        )
        with pytest.raises(CheckpointError, match="do not cover it exactly once"):
            checkpoint.resolve(d)


def test_an_absurd_declaration_is_refused_when_parsed(tmp_path):
    d = manifest_declaring(tmp_path, [ABSURD_BYTES, 8])
    with pytest.raises(CheckpointError, match="absurd"):
        checkpoint.resolve(d)


def test_sizes_of_data_attributes_are_checked(tmp_path):
    with h5py.File(dense_file(tmp_path / "c.h5"), "a") as f:
        f.attrs["num_classes"] = 1 << 40
    with pytest.raises(DataError, match="num_classes must be in 2..16777216"):
        data.open_dataset(str(tmp_path / "c.h5"))
    with h5py.File(dense_file(tmp_path / "s.h5"), "a") as f:
        f.attrs["x_scale"] = float("nan")
    with pytest.raises(DataError, match="x_scale must be a positive number"):
        data.open_dataset(str(tmp_path / "s.h5"))


def csr_file(tmp_path, **attrs):
    rng = np.random.default_rng(0)
    import scipy.sparse as sp

    x = sp.random(30, 50, density=0.1, format="csr", random_state=1, dtype=np.float32)
    y = rng.integers(0, 2, 30)
    path = tmp_path / "csr.h5"
    sparse.write_csr(path, (x[:20], y[:20]), (x[20:], y[20:]), 50)
    with h5py.File(path, "a") as f:
        f.attrs.update(attrs)
    return str(path)


def test_max_nnz_is_checked_against_indptr_at_open(tmp_path):
    path = csr_file(tmp_path)
    info = data.open_dataset(path)
    with h5py.File(path, "a") as f:
        f.attrs["max_nnz"] = info.max_nnz - 1  # a lie that would overflow the PS inboxes
    with pytest.raises(
        DataError, match=f"max_nnz = {info.max_nnz - 1}, but the longest row has {info.max_nnz}"
    ):
        data.open_dataset(path)
    with h5py.File(path, "a") as f:
        f.attrs["max_nnz"] = 10**12  # absurd: it sizes every inbox
    with pytest.raises(DataError, match="max_nnz = 1000000000000"):
        data.open_dataset(path)
    with h5py.File(path, "a") as f:
        del f.attrs["max_nnz"]
    with pytest.raises(DataError, match="attribute max_nnz is missing"):
        data.open_dataset(path)


def test_indptr_that_decreases_is_found_at_open(tmp_path, monkeypatch):
    monkeypatch.setattr(sparse, "CHUNK_ROWS", 4)  # the check reads indptr in chunks
    path = csr_file(tmp_path)
    with h5py.File(path, "a") as f:
        indptr = f["train/indptr"][()]
        indptr[9] = indptr[10] + 1
        f["train/indptr"][...] = indptr
    with pytest.raises(DataError, match="indptr decreases"):
        data.open_dataset(path)


def test_a_shard_read_that_does_not_fit_in_memory_is_refused(tmp_path, monkeypatch):
    path = dense_file(tmp_path / "d.h5")
    info = data.open_dataset(path)
    monkeypatch.setattr("mpips.process.memory.available_bytes", lambda: 100)
    with pytest.raises(DataError, match="needs .* more than the 100 B of memory available"):
        data.load_split(info, "train")


def test_available_memory_is_plausible():
    assert 1 << 20 < available_bytes() < ABSURD_BYTES


def test_no_checkpoint_holds_non_finite_values(tmp_path):
    good = {"w": np.ones(3, np.float32)}
    checkpoint.write_shard(tmp_path, 1, 0, 1, good)
    for bad in (np.nan, np.inf, -np.inf):
        w = np.ones(1000, np.float32)
        w[777] = bad
        with pytest.raises(NonFinite, match="'w' holds NaN or infinite values at global_step 2"):
            checkpoint.write_shard(tmp_path, 2, 0, 1, {"w": w})
        with pytest.raises(NonFinite, match="'w/m' holds NaN or infinite values"):
            checkpoint.write_shard(tmp_path, 2, 0, 1, good, {"w/m": w})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1.shard-0-of-1.h5"]
    big = np.full(1000, 3e38, np.float32)  # finite, though a float32 sum would overflow
    checkpoint.write_shard(tmp_path, 3, 0, 1, {"w": big})
    huge = np.full(1000, 1e308)  # finite float64 values whose float64 sum overflows
    checkpoint.write_shard(tmp_path, 4, 0, 1, {"w": huge})
    huge[5] = np.nan
    with pytest.raises(NonFinite):
        checkpoint.write_shard(tmp_path, 5, 0, 1, {"w": huge})


def test_ctr_loss_has_no_overflow_warning_for_any_logit():
    from mpips.layers import log_loss

    z = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0], np.float32)
    y = np.array([1, 0, 1, 1, 0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss, p = log_loss(np, z, y)
    np.testing.assert_allclose(p, [0.0, 0.0, 0.5, 1.0, 1.0], atol=1e-20)
    assert np.isfinite(loss) and loss == pytest.approx(
        (1000 + 0 + np.log(2) + 0 + 1000) / 5, rel=1e-5
    )


def npy_bytes(a):
    """``a`` as the bytes of a .npy file."""
    out = io.BytesIO()
    np.save(out, a)
    return out.getvalue()


# how a .npy or .npz file is damaged (its bytes -> the damaged bytes) and what is said
DAMAGE = {
    "empty": (lambda raw: b"", "(empty)"),
    "one byte": (lambda raw: raw[:1], ""),
    "magic string only": (lambda raw: raw[:6], ""),
    "truncated header": (lambda raw: raw[:20], ""),
    "truncated data": (lambda raw: raw[:-9], ""),
}


@pytest.mark.parametrize("kind", ["npy", "npz"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_an_empty_or_truncated_numpy_data_file_is_one_data_error(tmp_path, kind, damage):
    """numpy raises EOFError on an empty file, zipfile.BadZipFile on a truncated .npz (no
    OSError, no ValueError): each was a traceback at start-up."""
    cut, said = DAMAGE[damage]
    x, y = np.zeros((6, 3), np.float32), np.arange(6) % 2
    if kind == "npy":
        for name, a in (("x.npy", x), ("y.npy", y)):
            (tmp_path / name).write_bytes(npy_bytes(a))
        (tmp_path / "bad.npy").write_bytes(cut(npy_bytes(y)))
        config = DataConfig(
            train_x=str(tmp_path / "x.npy"),
            train_y=str(tmp_path / "bad.npy"),  # (named last: the error names it, not x.npy)
            test_x=str(tmp_path / "x.npy"),
            test_y=str(tmp_path / "y.npy"),
        )
    else:
        np.savez(tmp_path / "good.npz", x_train=x, y_train=y, x_test=x, y_test=y)
        (tmp_path / "bad.npz").write_bytes(cut((tmp_path / "good.npz").read_bytes()))
        config = DataConfig(path=str(tmp_path / "bad.npz"))
    bad = tmp_path / f"bad.{kind}"
    with pytest.raises(DataError, match=f"data file {bad}: not a readable .{kind} dataset") as e:
        data.open_data(config)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_npz_member_that_is_no_array_or_damaged_is_one_data_error(tmp_path):
    """np.load gives a member that is not a .npy file as bytes (no shape, no dtype), and a
    member with a bad CRC as zipfile.BadZipFile."""
    x, y = np.zeros((6, 3), np.float32), np.arange(6) % 2
    members = {"x_train": x, "y_train": y, "x_test": x, "y_test": y}
    with zipfile.ZipFile(tmp_path / "text.npz", "w") as z:
        for name, a in members.items():
            z.writestr(f"{name}.npy", b"not an array" if name == "y_test" else npy_bytes(a))
    with pytest.raises(DataError, match=r"text.npz: not a readable .npz dataset \(its member y_"):
        data.open_data(DataConfig(path=str(tmp_path / "text.npz")))
    np.savez(tmp_path / "crc.npz", **members)
    raw = bytearray((tmp_path / "crc.npz").read_bytes())
    raw[len(raw) // 3] ^= 0xFF  # inside a stored member's data
    (tmp_path / "crc.npz").write_bytes(bytes(raw))
    with pytest.raises(DataError, match="crc.npz: not a readable .npz dataset .Bad CRC-32"):
        data.open_data(DataConfig(path=str(tmp_path / "crc.npz")))


def test_a_npz_member_larger_than_memory_says_so_and_what_to_use(tmp_path):
    """A .npz member is read whole: one of 3.6 TiB (its header says) is numpy's MemoryError,
    said as memory, with the formats that are read in parts."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)}
    )
    with zipfile.ZipFile(tmp_path / "huge.npz", "w") as z:
        z.writestr("x_train.npy", header.getvalue() + bytes(64))
        for name in ("y_train", "x_test", "y_test"):
            z.writestr(f"{name}.npy", npy_bytes(np.zeros(4, np.int64)))
    with pytest.raises(DataError) as e:
        data.open_data(DataConfig(path=str(tmp_path / "huge.npz")))
    said = str(e.value)
    assert "huge.npz: not a readable .npz dataset (Unable to allocate 3.64 TiB" in said, said
    assert "more than this machine's memory holds" in said and "memory-mapped" in said, said


@pytest.mark.parametrize(
    "name, content, said",
    [
        ("empty.npz", b"", "empty.npz: not a readable .npz file (empty)"),
        ("one.npz", b"P", "one.npz: not a readable .npz file (not in numpy's format"),
        ("zip.npz", b"PK\x03\x04", "zip.npz: not a readable .npz file (File is not a zip"),
        ("a.npy", npy_bytes(np.zeros((4, 2))), "a.npy: not a readable .npz file (one .npy"),
    ],
)
def test_data_arrays_from_a_bad_npz_is_one_line(tmp_path, name, content, said):
    (tmp_path / name).write_bytes(content)
    r = run_py(["-m", "mpips", "data", "arrays", "o.h5", "--src", name], cwd=tmp_path)
    assert r.returncode == 2 and said in r.stderr, (r.returncode, r.stderr)
    assert r.stderr.count("mpips: error") == 1 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
@pytest.mark.parametrize(
    "args",
    [
        ["digits"],
        ["synthetic", "--rows", "20"],
        ["arrays", "--src", "xy.npz"],
        ["libsvm", "--src", "s.svm"],
        ["criteo", "--src", "s.svm"],
    ],
)
def test_data_that_cannot_be_written_is_one_line(tmp_path, args):
    """A folder no file can be made in (/proc: even root cannot, as a read-only folder
    stops everyone else): one line naming the output, as `ckpt export` says it, exit 1 (an
    I/O failure), not a PermissionError's traceback."""
    np.savez(tmp_path / "xy.npz", x=np.zeros((10, 3)), y=np.arange(10) % 2)
    (tmp_path / "s.svm").write_text("1 1:1\n0 2:1\n" * 5)
    r = run_py(["-m", "mpips", "data", args[0], "/proc/x.h5", *args[1:]], cwd=tmp_path)
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "cannot write /proc/x.h5 (" in r.stderr and "no dataset written" in r.stderr
    assert r.stderr.count("mpips: error") == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "text, said",
    [
        ('world_size = "2"', "world_size: expected an integer, got '2'"),
        ("world_size = true", "world_size: expected an integer, got True"),
        ("world_size = 2.0", "world_size: expected an integer, got 2.0"),
        ("world_size = 0", "world_size: must be in 1..1048576, got 0"),
        ("ps = true", 'ps: expected a count, a list of ranks or "per_node", got True'),
        ("ps = 1.0", 'ps: expected a count, a list of ranks or "per_node", got 1.0'),
        ("ps = [0, true]", 'ps: expected a count, a list of ranks or "per_node", got [0, True]'),
        ("ps = [0.0]", 'ps: expected a count, a list of ranks or "per_node", got [0.0]'),
        ('ps = "pernode"', "ps: expected a count, a list of ranks or \"per_node\", got 'pernode'"),
    ],
)
def test_a_layout_file_checks_its_types(tmp_path, text, said):
    """As a job's [layout] table is checked: unchecked, ``world_size = "2"`` was refused as
    "world_size = 2, but the job runs on 2 ranks", ``true`` passed as 1 rank, and `mpips
    layout` ended in a TypeError's traceback."""
    (tmp_path / "l.toml").write_text(text + "\n")
    with pytest.raises(ConfigError) as e:
        read_layout_file(tmp_path / "l.toml")
    assert str(e.value) == f"layout file {tmp_path / 'l.toml'}: {said}"
    r = run_py(["-m", "mpips", "layout", "-n", "2", "--layout", "l.toml"], cwd=tmp_path)
    assert r.returncode == 2 and f"layout file l.toml: {said}" in r.stderr, r.stderr
    assert r.stderr.count("mpips: error") == 1 and "Traceback" not in r.stderr, r.stderr


def test_a_layout_file_of_good_types_is_read(tmp_path):
    for text, spec in (
        ("ps = 2\nworld_size = 8", {"ps": 2, "world_size": 8}),
        ("ps = [0, 4]", {"ps": [0, 4]}),
        ('ps = "per_node"', {"ps": "per_node"}),
    ):
        (tmp_path / "l.toml").write_text(text + "\n")
        assert read_layout_file(tmp_path / "l.toml") == spec

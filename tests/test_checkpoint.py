import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpips import checkpoint
from mpips.errors import CheckpointError
from mpips.placement import VariableSpec

SPECS = [VariableSpec("dense_0/kernel", (3, 2)), VariableSpec("dense_0/bias", (2,))]


def values(seed=0):
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in SPECS}


def test_round_trip_and_latest(tmp_path):
    v = values()
    checkpoint.save(tmp_path, 7, v)
    checkpoint.save(tmp_path, 12, values(1), meta={"clocks": [5, 7]})
    assert checkpoint.latest_checkpoint(tmp_path).name == "ckpt-12.h5"
    step, got, clocks = checkpoint.restore(tmp_path / "ckpt-7.h5", SPECS)
    assert step == 7 and clocks is None
    assert checkpoint.restore(tmp_path / "ckpt-12.h5", SPECS)[2] == [5, 7]
    for k in v:
        np.testing.assert_array_equal(got[k], v[k])


def test_prune_keeps_newest_and_ignores_partial_files(tmp_path):
    for s in (1, 2, 3, 4):
        checkpoint.save(tmp_path, s, values(s), max_to_keep=2)
    dead, alive = tmp_path / ".ckpt-9.h5.tmp-999999999", tmp_path / f".ckpt-9.h5.tmp-{os.getpid()}"
    dead.write_bytes(b"half written")
    alive.write_bytes(b"being written")
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 4]
    assert checkpoint.latest_checkpoint(tmp_path).name == "ckpt-4.h5"
    checkpoint.save(tmp_path, 5, values(5), max_to_keep=2)
    assert not dead.exists() and alive.exists()  # only a dead writer's file is removed


def test_failed_write_keeps_previous(tmp_path):
    checkpoint.save(tmp_path, 1, values())
    with pytest.raises(TypeError):
        checkpoint.save(tmp_path, 2, {"dense_0/kernel": object()})
    assert [p.name for p in Path(tmp_path).iterdir()] == ["ckpt-1.h5"]
    assert checkpoint.restore(tmp_path / "ckpt-1.h5", SPECS)[0] == 1


def test_mismatch_names_the_variable(tmp_path):
    checkpoint.save(tmp_path, 1, values())
    wrong = [VariableSpec("dense_0/kernel", (3, 4)), SPECS[1]]
    with pytest.raises(CheckpointError, match=r"'dense_0/kernel' is float32\[3, 2\], the model "
                                              r"expects float32\[3, 4\]"):
        checkpoint.restore(tmp_path / "ckpt-1.h5", wrong)
    with pytest.raises(CheckpointError, match="has no variable 'extra'"):
        checkpoint.restore(tmp_path / "ckpt-1.h5", SPECS + [VariableSpec("extra", (1,))])


def test_corrupt_and_foreign_files(tmp_path):
    path = checkpoint.save(tmp_path, 1, values())
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        checkpoint.restore(path, SPECS)
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = 1
    with pytest.raises(CheckpointError, match="not an mpips checkpoint"):
        checkpoint.restore(tmp_path / "other.h5", SPECS)

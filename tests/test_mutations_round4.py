"""Behaviours that a broken implementation passed every other test with (each was mutated
in the production code and the suite stayed green): each case here fails on its mutation.

The crc32 chained across a shard's write blocks; a shard with no run id under a run that
has one; the async zero-copy default with a /dev/shm too small for the PS windows;
restore() waiting out the duplicate-signal window; a converter or predict writing over an
input it reads; NaN rows past the first scan block; job, layout and manifest files over
the text limit; a data position resumed on fewer workers than wrote it."""

import os
import shutil
import signal
import subprocess
import sys
import zlib

import h5py
import numpy as np
import pytest
from conftest import clean_env, mpiexec_path, run_py

from mpips import checkpoint
from mpips.checkpoint import Checkpoint, checksum
from mpips.cli import main
from mpips.data import batches as data
from mpips.data.hdf5 import plain_attrs
from mpips.errors import CheckpointError, ConfigError, DataError
from mpips.job import DataConfig, load_job, parse_job
from mpips.placement.layout import read_layout_file
from mpips.process.files import TEXT_LIMIT

W = {"w": np.arange(8, dtype=np.float32).reshape(2, 4)}


def said_in_process(capsys, argv, *said):
    """``main(argv)`` stops with exit 2 and one line holding each of ``said``."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mpips: error:") and err.count("\n") == 1, (code, err)
    for text in said:
        assert text in err, err


# -- the crc32 of a dataset written in blocks -------------------------------------------------


def test_a_dataset_over_the_write_block_carries_the_crc32_of_all_its_blocks(tmp_path, monkeypatch):
    """A shard's dataset larger than the writer's block is written a block of rows at a
    time; its crc32 continues from block to block, so it is the whole dataset's, and the
    checkpoint reads back (a crc32 of the last block alone was refused as damaged)."""
    monkeypatch.setattr(checksum, "CHUNK_ELEMENTS", 4)  # 2 rows of 2 a block: 10 blocks
    a = {"w": np.arange(40, dtype=np.float32).reshape(20, 2)}
    assert len(list(checksum.copied_blocks(a["w"]))) == 10
    checkpoint.write_shard(tmp_path, 1, 0, 1, a, run="r")
    path = checkpoint.commit(tmp_path, 1, 1, checkpoint.whole_index(a), {}, {}, run="r")
    with h5py.File(tmp_path / checkpoint.shard_name(1, 0, 1), "r") as f:
        assert int(f["variables/w"].attrs["crc32"]) == zlib.crc32(a["w"].tobytes())
    np.testing.assert_array_equal(Checkpoint(path).read_all()[0]["w"], a["w"])


# -- run identity: a shard that carries none --------------------------------------------------


def test_a_shard_with_no_run_id_is_refused_under_a_run_that_has_one(tmp_path):
    """Only a shard of another run id was tested: one with no id at all (written before run
    ids, or by hand) is as foreign, at commit and at read."""
    assert checkpoint.run_of(tmp_path) is None  # (no run holds the directory here)
    checkpoint.write_shard(tmp_path, 1, 0, 1, W, run="aaaa")
    path = checkpoint.commit(tmp_path, 1, 1, checkpoint.whole_index(W), {}, {}, run="aaaa")
    checkpoint.write_shard(tmp_path, 2, 0, 1, W)  # no run id
    with h5py.File(tmp_path / checkpoint.shard_name(2, 0, 1), "r") as f:
        assert "run" not in plain_attrs(f)
    with pytest.raises(checkpoint.ForeignShard, match=r"a run with no id, not by this run \(aa"):
        checkpoint.commit(tmp_path, 2, 1, checkpoint.whole_index(W), {}, {}, run="aaaa")
    assert not (tmp_path / "ckpt-2.json").exists()
    # the committed manifest's shard replaced by one of the same step with no run id
    checkpoint.write_shard(tmp_path, 1, 0, 1, W)
    with pytest.raises(CheckpointError, match="a run with no id, not by the run that committed"):
        Checkpoint(path).read_all()


# -- zero copy by default, with too little /dev/shm -------------------------------------------

SMALL_SHM = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'  # a container's default
BIG_JOB = """
[model]
kind = "mlp"
hidden = [{hidden}, {hidden}]
[data]
builtin = "digits"
[train]
steps = 4
batch_size = 8
[layout]
ps = 1
"""


def small_shm_run(tmp_path, hidden):
    """``train`` of BIG_JOB on 3 ranks under a 64 MB /dev/shm of their own (of which MPICH
    takes about 16 MB for itself)."""
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", SMALL_SHM, "sh", "true"], capture_output=True
    )
    if probe.returncode:
        pytest.skip(f"cannot mount a small /dev/shm here: {probe.stderr[-200:]!r}")
    (tmp_path / "job.toml").write_text(BIG_JOB.format(hidden=hidden))
    cmd = ["unshare", "-m", "sh", "-c", SMALL_SHM, "sh", mpiexec_path(), "-n", "3"]
    return subprocess.run(
        [*cmd, sys.executable, "-m", "mpips", "train", "--no-progress", "job.toml"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


NEEDS_ROOT = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare"
)


@pytest.mark.launcher
@NEEDS_ROOT
def test_async_copies_where_dev_shm_lacks_room_for_zero_copy(tmp_path):
    """Zero copy is async's default on one node only where /dev/shm holds the PS windows
    with a quarter to spare: a 44 MB model, with about 51 MB of /dev/shm free, trains with
    copied pulls (only sync's fallback was tested)."""
    r = small_shm_run(tmp_path, 3264)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    out = r.stdout + r.stderr
    assert out.count("MB per step from 1 ps task(s)") == 2, out[-3000:]
    assert "zero copy" not in out, out[-3000:]


@pytest.mark.launcher
@NEEDS_ROOT
def test_ps_memory_larger_than_dev_shm_is_no_sigbus(tmp_path):
    """A 68 MB model under a 64 MB /dev/shm: MPICH puts every window of a node with several
    ranks in /dev/shm, copied pulls' too, and PS memory past its end died of SIGBUS. The PS
    memory is in private memory instead (the chief says so) and the run trains."""
    r = small_shm_run(tmp_path, 4096)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stdout.count("private memory instead") == 1, r.stdout[-2000:]


# -- restore() and the duplicate-signal window ------------------------------------------------

RESTORE = """
import os, signal, threading, time
from mpips.process import preemption
seen = []
signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))  # the caller's own handler
previous = preemption.install()
os.kill(os.getpid(), signal.SIGUSR1)  # a request, and the run ends at once
time.sleep(0.05)

def again():  # the same request delivered twice (GNU timeout, then mpirun, forwards it)
    time.sleep(preemption.DUPLICATE_SECONDS / 3)
    os.kill(os.getpid(), signal.SIGUSR1)

duplicate = threading.Thread(target=again)
duplicate.start()
began = time.monotonic()
preemption.restore(previous)
waited = time.monotonic() - began
duplicate.join()
time.sleep(0.2)
print("requested", preemption.requested(), "caller saw", len(seen), flush=True)
print("waited enough", waited >= preemption.DUPLICATE_SECONDS - 0.1, flush=True)
"""


@pytest.mark.launcher  # (a process of its own: its signals)
def test_restore_waits_out_the_duplicate_window_before_giving_the_handlers_back(tmp_path):
    """restore() right after a request first waits out DUPLICATE_SECONDS: the duplicate of
    that request still finds the signals ignored, and never reaches the handler the caller
    gets back (a script's own handler, or KeyboardInterrupt for Ctrl-C)."""
    (tmp_path / "restore.py").write_text(RESTORE)
    r = run_py(["restore.py"], tmp_path, timeout=60)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert r.stdout == f"requested {int(signal.SIGUSR1)} caller saw 0\nwaited enough True\n", (
        r.stdout,
        r.stderr,
    )


# -- an output that is an input ---------------------------------------------------------------


def test_a_converters_test_or_validation_source_as_its_output_is_refused(
    tmp_path, capsys, monkeypatch
):
    """Only --src was checked: --test-src or --val-src named as the output HDF5 file was
    read, then replaced by the converted file (exit 0, the user's .npz gone)."""
    np.savez(tmp_path / "src.npz", x=np.zeros((40, 3), np.float32), y=np.arange(40) % 2)
    np.savez(tmp_path / "t.npz", x=np.ones((10, 3), np.float32), y=np.arange(10) % 2)
    (tmp_path / "a.svm").write_text("1 3:1.5\n0 7:2\n" * 50)
    (tmp_path / "t.svm").write_text("1 2:1\n0 5:2\n" * 5)
    cases = [
        (["data", "arrays", "t.npz", "--src", "src.npz", "--test-src", "t.npz"], "t.npz"),
        (["data", "arrays", "t.npz", "--src", "src.npz", "--val-src", "./t.npz"], "t.npz"),
        (["data", "libsvm", "t.svm", "--src", "a.svm", "--test-src", "t.svm"], "t.svm"),
    ]
    monkeypatch.chdir(tmp_path)
    for argv, kept in cases:
        before = (tmp_path / kept).read_bytes()
        said_in_process(capsys, argv, "the same file as the input", "give another output name")
        assert (tmp_path / kept).read_bytes() == before, argv
    assert not list(tmp_path.glob("*.h5"))


def test_predict_onto_its_job_file_is_refused(tmp_path, capsys, monkeypatch):
    """Only --input was checked: the job file named as --output was overwritten by the
    predictions."""
    (tmp_path / "j.toml").write_text('[data]\nbuiltin = "digits"\n[train]\nsteps = 5\n')
    np.save(tmp_path / "in.npy", np.zeros((4, 64), np.float32))
    monkeypatch.chdir(tmp_path)
    before = (tmp_path / "j.toml").read_bytes()
    argv = ["predict", "j.toml", "--ckpt", "ck", "--input", "in.npy", "--output", "./j.toml"]
    said_in_process(capsys, argv, "the same file as the input j.toml")
    assert (tmp_path / "j.toml").read_bytes() == before


# -- NaN past the first scan block ------------------------------------------------------------


def test_a_row_that_is_not_finite_is_found_past_the_first_scan_block(tmp_path, monkeypatch):
    """Rows are searched for NaN SCAN_BYTES at a time: with blocks of 2 rows, the bad rows
    far past the first block are found, by their own numbers."""
    monkeypatch.setattr(data, "SCAN_BYTES", 2 * 64)  # 2 rows of 64 inputs a block
    info = data.open_dataset(data.resolve_path("", "digits"))
    x, y = data.load_split(info, "train")
    x[1001, 7] = x[1200, 0] = np.nan
    arrays = data.open_data(DataConfig(), {"train": (x, y), "test": (x[:10], y[:10])})
    with pytest.raises(DataError, match=r"train row 1001 \(array 'train/x'\) holds nan at input 7"):
        data.load_split(arrays, "train")
    with pytest.raises(DataError, match=r"train row 1200 .*holds nan at input 0"):
        data.load_split(arrays, "train", (1100, 1300))


# -- readers and the text limit ---------------------------------------------------------------


def over_the_limit(path):
    """A (sparse) file one byte over files.TEXT_LIMIT."""
    with open(path, "wb") as f:
        f.truncate(TEXT_LIMIT + 1)
    return path


OVER = f"{TEXT_LIMIT + 1} bytes, more than the {TEXT_LIMIT} such a file may hold"


def test_job_layout_and_manifest_readers_refuse_a_file_over_the_text_limit(tmp_path):
    """Only the writer's limit (a manifest never committed too big) was tested: each reader
    refuses a larger file by its size, before reading it (not a parse error after 64 MB)."""
    with pytest.raises(ConfigError, match=f"job file .*big.toml: {OVER}"):
        load_job(over_the_limit(tmp_path / "big.toml"))
    with pytest.raises(ConfigError, match=f"layout file .*layout.toml: {OVER}"):
        read_layout_file(over_the_limit(tmp_path / "layout.toml"))
    with pytest.raises(CheckpointError, match=f"checkpoint .*ckpt-1.json: {OVER}"):
        Checkpoint(over_the_limit(tmp_path / "ckpt-1.json"))


# -- a data position on fewer workers ---------------------------------------------------------


def test_a_data_position_is_not_resumed_on_fewer_workers_than_wrote_it(tmp_path):
    """Only more workers was tested: 3 workers' batch counts given to 2 workers would skip
    batches of parts that are no longer theirs."""
    from mpips.run.startup import data_position

    job = parse_job("[train]\nsteps = 5\nbatch_size = 7\nseed = 3\n")
    w = {"w": np.ones(2, np.float32)}
    checkpoint.write_shard(tmp_path, 4, 0, 1, w, run="r")
    meta = {"clocks": [4, 5, 6], "data": {"batch_size": 7, "seed": 3}}
    ckpt = Checkpoint(
        checkpoint.commit(tmp_path, 4, 1, checkpoint.whole_index(w), {}, meta, run="r")
    )
    assert data_position(job, ckpt, 3) == ([4, 5, 6], "")
    for workers in (1, 2):
        assert data_position(job, ckpt, workers) == (
            None,
            f"the number of workers changed (the checkpoint was written by 3, this run has "
            f"{workers})",
        )

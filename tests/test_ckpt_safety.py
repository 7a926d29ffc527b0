"""Reading and writing checkpoints safely, in one process and from the command line: a
shard of another run is never committed or read; a checkpoint never makes mpips import the
code it names; a FIFO, a device or deeply nested JSON as a manifest is one message, never a
hang or a flood of memory; a full or read-only file system is one message and leaves the
previous checkpoint as it was; NaN in a checkpoint is flagged; `eval --result` writes JSON."""

import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from conftest import BackgroundJob, clean_env, run_mpi, run_py, small_tmpfs, stop_launcher

from mpips import checkpoint
from mpips.checkpoint import Checkpoint, writing
from mpips.data.hdf5 import plain_attrs
from mpips.errors import CheckpointError
from mpips.models import initial
from mpips.models.variables import VariableSpec
from mpips.process import files

W = {"w": np.arange(8, dtype=np.float32).reshape(2, 4)}


def save(d, step, arrays=W, run=None, meta=None):
    """One shard holding ``arrays`` and its commit, as the chief writes them in sync mode."""
    checkpoint.write_shard(d, step, 0, 1, arrays, run=run)
    return checkpoint.commit(d, step, 1, checkpoint.whole_index(arrays), {}, meta or {}, run=run)


# -- run identity ----------------------------------------------------------------------------


def test_a_shard_of_another_run_is_refused_at_commit_and_at_read(tmp_path):
    save(tmp_path, 1, run="aaaa")
    manifest = json.loads((tmp_path / "ckpt-1.json").read_text())
    assert manifest["run"] == "aaaa"
    with h5py.File(tmp_path / checkpoint.shard_name(1, 0, 1)) as f:
        assert plain_attrs(f)["run"] == "aaaa"
    checkpoint.write_shard(tmp_path, 2, 0, 1, W, run="bbbb")  # another run's shard, same name
    with pytest.raises(checkpoint.ForeignShard, match="written by run bbbb, not by this run"):
        checkpoint.commit(tmp_path, 2, 1, checkpoint.whole_index(W), {}, {}, run="aaaa")
    assert not (tmp_path / "ckpt-2.json").exists()  # not committed
    # a committed manifest whose shard was replaced by another run's (renamed over it)
    os.replace(tmp_path / checkpoint.shard_name(2, 0, 1), tmp_path / checkpoint.shard_name(1, 0, 1))
    with pytest.raises(CheckpointError, match="written by run bbbb, not by the run that committed"):
        Checkpoint(tmp_path / "ckpt-1.json").read_all()
    r = run_py(["-m", "mpips", "ckpt", "inspect", str(tmp_path)], tmp_path)
    assert r.returncode == 2 and "written by run bbbb" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_manifest_no_reader_would_accept_is_never_committed(tmp_path, monkeypatch):
    """Readers refuse manifests over files.TEXT_LIMIT; a commit that would write one is
    refused instead, and the checkpoint before it stays the latest."""
    save(tmp_path, 1)
    monkeypatch.setattr(writing, "TEXT_LIMIT", 200)  # the limit a commit checks
    with pytest.raises(CheckpointError, match="more than the 200 a reader accepts"):
        save(tmp_path, 2, {f"v{k}": W["w"] for k in range(10)})
    assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "ckpt-1.json"


def test_the_run_a_process_writes_for_tags_its_shards_and_manifests(tmp_path):
    """After lock_directory (the chief) or join_run (a PS task), writes carry the run id
    without being told; a directory held by another process is refused, naming it."""
    d = tmp_path / "ck"
    lock = checkpoint.lock_directory(d, "job.toml")
    try:
        assert lock.unlocked is None and checkpoint.run_of(d) == lock.run
        save(d, 3)
        assert Checkpoint(d / "ckpt-3.json").run == lock.run
        holder = json.loads((d / checkpoint.LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["run"] == lock.run
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from mpips import checkpoint\n"
                "try:\n    checkpoint.lock_directory(sys.argv[1], 'second.toml')\n"
                "except Exception as e:\n    print(e); sys.exit(2)\n",
                str(d),
            ],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert other.returncode == 2, other
        said = other.stdout
        assert f"checkpoint.dir {d} is in use by another run: job job.toml" in said, said
        assert f"pid {os.getpid()} on " in said and f"run {lock.run}" in said, said
    finally:
        checkpoint.release_directory(d)
    assert checkpoint.run_of(d) is None
    checkpoint.join_run(d, "cccc")  # a PS task of a run whose chief holds the lock
    try:
        checkpoint.write_shard(d, 4, 0, 1, W)
        with h5py.File(d / checkpoint.shard_name(4, 0, 1)) as f:
            assert plain_attrs(f)["run"] == "cccc"
    finally:
        checkpoint.release_directory(d)


# -- a checkpoint runs no code ---------------------------------------------------------------


def sparse_checkpoint(d, meta):
    """A checkpoint whose embedding is stored sparsely with base "initial": its untouched
    rows are the model's initial values, which only a model can compute."""
    from mpips.job import OptimizerConfig
    from mpips.models.ctr import EMBEDDING, WideDeep
    from mpips.optim import build_optimizer

    model = WideDeep(30_000, [2], embedding_dim=4)
    opt = build_optimizer(OptimizerConfig(kind="sgd"))
    values = initial.from_model(model, opt)
    table = model.initial_rows(EMBEDDING, (0, 30_000, 1), 3)
    table[7] += 1
    tables = checkpoint.SparseTables({EMBEDDING: (0, 30_000, 1)}, 3, values)
    checkpoint.write_shard(d, 1, 0, 1, {EMBEDDING: table}, {}, tables)
    checkpoint.commit(d, 1, 1, checkpoint.whole_index({EMBEDDING: table}), {}, meta)
    assert Checkpoint(d / "ckpt-1.json").layouts(EMBEDDING) == [(0, 1)]
    return model, opt, table


def test_reading_a_checkpoint_never_imports_the_model_its_manifest_names(tmp_path):
    """The manifest names a job whose model module writes a canary file on import: `ckpt
    inspect` and `ckpt export` read the checkpoint without it (export says what to pass)."""
    evil = tmp_path / "evil"
    evil.mkdir()
    canary = tmp_path / "canary"
    (evil / "canary_model.py").write_text(f"open({str(canary)!r}, 'w').write('ran')\n")
    (evil / "job.toml").write_text(
        '[model]\nkind = "canary_model:build"\n[data]\nbuiltin = "digits"\n[train]\nsteps = 10\n'
    )
    d = tmp_path / "ck"
    sparse_checkpoint(d, {"job": str(evil / "job.toml"), "model": "canary_model:build"})
    r = run_py(["-m", "mpips", "ckpt", "inspect", str(d)], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "(sparse: 1 rows stored)" in r.stdout and "pass the job file" in r.stdout, r.stdout
    r = run_py(["-m", "mpips", "ckpt", "export", str(d), "out.h5"], tmp_path)
    assert r.returncode == 2 and "pass the job file that trained it (--job JOB)" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    with pytest.raises(checkpoint.NeedsModel):
        Checkpoint(d / "ckpt-1.json").read_all()
    assert not canary.exists()
    assert not (tmp_path / "out.h5").exists()


@pytest.mark.parametrize(
    "dataset, said",
    [
        ("values", "do not match the checksum written with them"),
        ("index", "its row index does not match the checksum written with it"),
    ],
)
def test_a_flipped_byte_in_a_sparse_part_is_refused(tmp_path, dataset, said):
    """A sparse part's row index (read whole when it is checked) and its stored rows (when
    all are read) are checked against their crc32s, naming the shard and the table."""
    from mpips.models.ctr import EMBEDDING

    d = tmp_path / "ck"
    model, opt, table = sparse_checkpoint(d, {})
    shard = d / checkpoint.shard_name(1, 0, 1)
    with h5py.File(shard, "r") as f:
        offset = f[f"variables/{EMBEDDING}/{dataset}"].id.get_offset()
    raw = bytearray(shard.read_bytes())
    raw[offset] ^= 0x10  # index 7 becomes 23: in range, ascending; a value changes
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=f"shard {shard.name} .*'{EMBEDDING}'.* {said}"):
        Checkpoint(d / "ckpt-1.json").read_all(initial.from_model(model, opt))


# -- hostile manifests -----------------------------------------------------------------------


def hostile_manifest(d, kind):
    """A committed checkpoint at step 1, and a newer 'manifest' at step 9 of ``kind``."""
    save(d, 1)
    newest = d / "ckpt-9.json"
    if kind == "fifo":
        os.mkfifo(newest)
        return "is a FIFO, not a regular file"
    if kind == "/dev/zero":
        newest.symlink_to("/dev/zero")
        return "is a device, not a regular file"
    newest.write_text("[" * 100_000 + "]" * 100_000)
    return "nested too deeply"


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "nested"])
def test_a_hostile_manifest_is_one_message_for_inspect_and_eval(tmp_path, kind):
    said = hostile_manifest(tmp_path / "runs/default", kind)
    for args in (["ckpt", "inspect", "runs/default"], ["eval"], ["ckpt", "list", "runs/default"]):
        r = run_py(["-m", "mpips", *args], tmp_path, timeout=60)
        assert r.returncode == 2 and said in r.stderr and "ckpt-9.json" in r.stderr, (args, r)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.launcher
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_a_hostile_manifest_stops_train_at_start_up(tmp_path, kind):
    said = hostile_manifest(tmp_path / "ck", kind)
    r = run_mpi(
        3,
        ["-m", "mpips", "train", "--no-progress", "--ckpt-dir", "ck"],
        tmp_path,
        timeout=90,
        MPIPS_START_TIMEOUT="20",
    )
    assert r.returncode == 2 and r.stderr.count(said) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr


# -- write failures --------------------------------------------------------------------------


def test_a_failed_write_is_said_and_cleanup_never_hides_it(tmp_path, monkeypatch):
    """The write fails (disk full) and removing its temporary fails too (a read-only file
    system says EROFS even for a file that is not there): the first error is the one said,
    as WriteFailed (exit 1); without a consequence to say, the OSError passes through."""
    import errno
    from pathlib import Path

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    def refuse(self, missing_ok=False):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.raises(files.WriteFailed) as e:
        files.atomic_write(tmp_path / "x.h5", full, "nothing written")
    assert str(e.value) == (
        f"cannot write {tmp_path / 'x.h5'} (No space left on device: an I/O failure, not bad "
        f"input); nothing written"
    )
    assert e.value.exit_code == 1
    with pytest.raises(OSError, match="No space left"):
        files.atomic_write(tmp_path / "x.h5", full)


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs at tmp_path/fs."""
    with small_tmpfs(tmp_path / "fs", "1m") as mnt:
        yield mnt


def test_a_full_disk_is_one_message_and_the_previous_checkpoint_stays(small_fs):
    d = small_fs / "ck"
    save(d, 1)
    big = {"w": np.ones((2048, 256), np.float32)}  # 2 MiB on a 1 MiB file system
    with pytest.raises(files.WriteFailed) as e:
        checkpoint.write_shard(d, 2, 0, 1, big)
    message = str(e.value)
    assert "No space left on device" in message and "ckpt-2.shard-0-of-1.h5" in message
    assert "checkpoint at global_step 2 not committed" in message and "\n" not in message
    assert sorted(p.name for p in d.iterdir()) == ["ckpt-1.json", "ckpt-1.shard-0-of-1.h5"]
    got = checkpoint.resolve(d).read([VariableSpec("w", (2, 4))])
    np.testing.assert_array_equal(got["w"], W["w"])


def test_a_read_only_directory_is_one_message_and_the_previous_checkpoint_stays(small_fs):
    d = small_fs / "ck"
    save(d, 1)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True, timeout=30)
    with pytest.raises(files.WriteFailed, match=r"Read-only file system: an I/O failure"):
        checkpoint.write_shard(d, 2, 0, 1, W)
    with pytest.raises(files.WriteFailed, match=r"Read-only file system"):
        checkpoint.commit(d, 1, 1, checkpoint.whole_index(W), {}, {"job": "again"})
    r = run_py(["-m", "mpips", "ckpt", "export", str(d), str(small_fs / "out.h5")], small_fs.parent)
    assert r.returncode == 1 and "Read-only file system" in r.stderr, r.stderr
    assert "nothing exported" in r.stderr and "Traceback" not in r.stderr
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


@pytest.mark.launcher
def test_a_run_whose_checkpoint_does_not_fit_stops_with_one_message(tmp_path, small_fs):
    """1.2 MB checkpoints into a 1 MiB file system: the first save fails, the run stops with
    exit 1 and one line naming the file and the cause."""
    (tmp_path / "job.toml").write_text(
        '[model]\nhidden = [512, 512]\n[data]\nbuiltin = "digits"\n'
        "[train]\nsteps = 20\nbatch_size = 16\nlog_every = 0\nprogress = false\n"
        f'[checkpoint]\ndir = "{small_fs / "ck"}"\nevery_steps = 5\n'
    )
    r = run_py(["-m", "mpips", "train", "job.toml"], tmp_path, timeout=120)
    assert r.returncode == 1, r.stderr[-3000:]
    assert r.stderr.count("No space left on device") == 1, r.stderr[-3000:]
    assert "not committed" in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert checkpoint.list_checkpoints(small_fs / "ck") == []


# -- NaN, and eval --result ------------------------------------------------------------------


def digits_checkpoint(d, nan=False):
    """A checkpoint of the default job's model at its initial values (``nan``: one NaN in
    dense_0/kernel, as no mpips run writes it)."""
    from mpips.data.batches import open_data
    from mpips.job import load_job
    from mpips.models.mlp import build_model

    job = load_job(None)
    params = build_model(job.model, open_data(job.data)).initial_values(0)
    if nan:
        params["dense_0/kernel"][3, 5] = np.nan
        params["dense_0/kernel"][4, 5] = np.inf
    path = d / "runs/default" / checkpoint.shard_name(7, 0, 1)
    path.parent.mkdir(parents=True)
    with h5py.File(path, "w") as f:  # written by hand: write_shard refuses NaN
        f.attrs["format"] = checkpoint.FORMAT
        f.attrs["global_step"], f.attrs["shard"] = 7, 0
        for name, value in params.items():
            f[checkpoint.h5_path(name, False)] = value
    checkpoint.commit(path.parent, 7, 1, checkpoint.whole_index(params), {}, {"model": "mlp"})


def test_a_checkpoint_holding_nan_is_flagged_by_inspect_and_refused_by_eval(tmp_path):
    digits_checkpoint(tmp_path, nan=True)
    r = run_py(["-m", "mpips", "ckpt", "inspect", "runs/default"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "warning: 'dense_0/kernel' holds 2 NaN or infinite value(s) of 4096" in r.stdout
    r = run_py(["-m", "mpips", "eval", "--result", "r.json"], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "'dense_0/kernel' holds 2 NaN or infinite value(s) of 4096" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "r.json").exists()


def test_eval_writes_its_metrics_as_json_with_result(tmp_path):
    digits_checkpoint(tmp_path)
    r = run_py(["-m", "mpips", "eval", "--result", "r.json"], tmp_path)
    assert r.returncode == 0, r.stderr
    said = json.loads((tmp_path / "r.json").read_text())
    assert said["global_step"] == 7 and said["model"] == "mlp"
    assert said["checkpoint"].endswith("runs/default/ckpt-7.json")
    assert f"test_accuracy {said['test_accuracy']:.4f}" in r.stdout, (said, r.stdout)
    assert said["test_metrics"]["loss"] == said["test_loss"] > 0
    r = run_py(["-m", "mpips", "eval", "--result", "nowhere/r.json"], tmp_path)
    assert r.returncode == 2 and "--result nowhere/r.json: cannot write there" in r.stderr


# -- two runs on one directory ---------------------------------------------------------------


@pytest.mark.launcher
def test_a_second_run_on_a_directory_in_use_is_refused_and_the_first_is_intact(tmp_path):
    """Run A (two PS tasks writing shards) holds runs/default; run B on the same directory
    stops at start-up (exit 2, one message naming A's chief: pid, host, job, start time);
    A goes on, and its checkpoints load and evaluate."""
    a = BackgroundJob(tmp_path, 3, "--steps", str(10**9), "--ps", "2")
    try:
        chief = a.pid_of("/job:worker/task:0")
        a.wait_for(r"saved checkpoint")
        b = run_mpi(
            3, ["-m", "mpips", "train", "--no-progress", "--steps", "50"], tmp_path, timeout=90
        )
        assert b.returncode == 2, b.stderr[-3000:]
        assert b.stderr.count("checkpoint.dir runs/default is in use by another run") == 1, b.stderr
        assert f"pid {chief} on " in b.stderr and "job <built-in default job>" in b.stderr
        assert "started 20" in b.stderr and "Traceback" not in b.stderr, b.stderr
        saves = len(a.text().split("saved checkpoint"))
        deadline = time.monotonic() + 60
        while len(a.text().split("saved checkpoint")) == saves and time.monotonic() < deadline:
            time.sleep(0.1)  # A still saves after B was turned away
        a.proc.send_signal(signal.SIGINT)
        assert a.end() == 3, a.text()[-3000:]
    finally:
        stop_launcher(a.proc)
    ckpt = checkpoint.resolve(tmp_path / "runs/default")
    assert ckpt.run and ckpt.num_shards == 2
    for k in range(2):
        with h5py.File(ckpt.shard_path(k)) as f:
            assert plain_attrs(f)["run"] == ckpt.run
    ckpt.read_all()
    r = run_py(["-m", "mpips", "eval"], tmp_path)
    assert r.returncode == 0 and f"global_step {ckpt.step}" in r.stdout, r.stderr
    assert not any(p.name.startswith(".ckpt-") for p in (tmp_path / "runs/default").iterdir())


RELEASE = """
import fcntl, os, sys
import mpips
class Boom(mpips.Hook):
    def after_step(self, run, info):
        raise RuntimeError("boom")
job = mpips.load_job(None)
job.train.progress, job.train.steps, job.checkpoint.dir = False, 20, "ck"
try:
    mpips.train(job, hooks=[Boom()] if sys.argv[1:] == ["raise"] else [])
except RuntimeError as e:
    print("raised", e)
fd = os.open("ck/.mpips-lock", os.O_RDWR)  # another open file: flock conflicts if held
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("held")
"""


@pytest.mark.parametrize("end", ["return", "raise"])
def test_a_run_through_the_python_api_releases_its_directory_when_it_ends(tmp_path, end):
    """A notebook (a long-lived process) that called mpips.train() must not keep the
    checkpoint directory from other runs once its run is over, whether it returned or
    raised."""
    (tmp_path / "run.py").write_text(RELEASE)
    r = run_py(["run.py", end], tmp_path, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("raised boom" in r.stdout) == (end == "raise"), r.stdout[-2000:]
    assert r.stdout.splitlines()[-1] == "free", r.stdout[-2000:]

"""What mpips writes never destroys what it should not: an export, a result file or a
converted dataset given a checkpoint's own file name, a device or a directory is
refused with one message (exit 2) and the checkpoint stays loadable; a checkpoint.dir
that is a link to nothing is one message too."""

import os
from pathlib import Path

import pytest
from conftest import run_mpi, run_py

pytestmark = pytest.mark.launcher

JOB = """[model]
hidden = [16]
[data]
builtin = "digits"
[train]
steps = 20
progress = false
[checkpoint]
dir = "ck"
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("outputs")
    (d / "job.toml").write_text(JOB)
    r = run_mpi(4, ["-m", "mpips", "train", "job.toml", "--ps", "2"], cwd=d, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def files_of(d: Path) -> dict[str, bytes]:
    """The checkpoint files in ``d`` (the lock file says who ran last: not compared)."""
    return {p.name: p.read_bytes() for p in sorted(d.glob("ckpt-*")) if p.is_file()}


@pytest.mark.parametrize(
    "target",
    ["ck/ckpt-20.json", "ck/ckpt-20.shard-1-of-2.h5", "ck/.mpips-lock", "ck/ckpt-99.json"],
)
def test_an_export_onto_a_checkpoints_file_is_refused(trained, target):
    before, lock = files_of(trained / "ck"), (trained / "ck/.mpips-lock").read_bytes()
    r = run_py(["-m", "mpips", "ckpt", "export", "ck", target], cwd=trained)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "a checkpoint's file name" in r.stderr and "Traceback" not in r.stderr
    assert files_of(trained / "ck") == before
    assert (trained / "ck/.mpips-lock").read_bytes() == lock
    assert not (trained / "ck/ckpt-99.json").exists()
    r = run_py(["-m", "mpips", "eval", "job.toml"], cwd=trained)
    assert r.returncode == 0 and "global_step 20" in r.stdout, r.stderr


def test_a_device_fifo_or_directory_is_never_replaced(trained):
    fifo = trained / "a-fifo"
    os.mkfifo(fifo)
    (trained / "a-dir").mkdir()
    for target, kind in [(fifo, "a FIFO"), (trained / "a-dir", "a directory")]:
        r = run_py(["-m", "mpips", "ckpt", "export", "ck", str(target)], cwd=trained)
        assert r.returncode == 2 and f"is {kind}" in r.stderr, (r.stdout, r.stderr)
    assert fifo.is_fifo() and (trained / "a-dir").is_dir()
    r = run_py(["-m", "mpips", "data", "digits", "a-dir"], cwd=trained)
    assert r.returncode == 2 and "is a directory" in r.stderr, r.stderr
    r = run_py(["-m", "mpips", "ckpt", "export", "ck", "model.h5"], cwd=trained)
    assert r.returncode == 0 and (trained / "model.h5").is_file(), r.stderr  # (a plain name)


def test_a_result_onto_a_manifest_is_refused(trained):
    before = files_of(trained / "ck")
    args = ["-m", "mpips", "train", "job.toml", "--steps", "20", "--result", "ck/ckpt-20.json"]
    r = run_mpi(3, args, cwd=trained, timeout=120)
    assert r.returncode == 2 and "a checkpoint's file name" in r.stderr, (r.stdout, r.stderr)
    assert files_of(trained / "ck") == before


def test_a_checkpoint_dir_linked_to_nothing_is_one_message(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    os.symlink("loop-b", tmp_path / "loop-a")
    os.symlink("loop-a", tmp_path / "loop-b")
    os.symlink("nowhere", tmp_path / "dangling")
    for d in ("loop-a", "dangling"):
        args = ["-m", "mpips", "train", "job.toml", "--ps", "1", "--ckpt-dir", d]
        r = run_mpi(3, args, cwd=tmp_path, timeout=90)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert r.stderr.count("\n") == 1 and "a symbolic link to nothing" in r.stderr, r.stderr


def test_ctrl_c_while_the_ranks_start_ends_them_quietly(tmp_path):
    """SIGINT to mpirun while its ranks still import or initialise MPI (the first second or
    two of a run, most of a small job's wall time): every rank ends at once, without a
    KeyboardInterrupt traceback from the middle of an import (or a crash in one), and none
    stays in MPI_Init waiting for ranks that are gone (a Python handler never runs there);
    a little later the run's own handling takes over (a checkpoint, exit 3). Whenever it
    comes, the job ends, quietly."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import clean_env, mpiexec_path, stop_launcher

    (tmp_path / "job.toml").write_text(JOB.replace("steps = 20", "steps = 100000"))
    for delay in (0.2, 0.5, 0.8, 1.1, 1.4, 1.7):
        cmd = [mpiexec_path(), "-n", "3", sys.executable, "-m", "mpips", "train", "job.toml"]
        proc = subprocess.Popen(
            [*cmd, "--ckpt-dir", f"ck-{delay}"],
            cwd=tmp_path,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            stop_launcher(proc)
            pytest.fail(f"Ctrl-C after {delay} s: the job did not end ({proc.communicate()})")
        assert proc.returncode != 0, (delay, err)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, (delay, err)
    r = run_py(["-c", "import mpips, signal; print(signal.getsignal(signal.SIGINT))"], tmp_path)
    assert "default_int_handler" in r.stdout  # (a library import leaves Ctrl-C alone)

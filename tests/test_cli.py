"""The command line as a user meets it (plain processes, no MPI launch)."""

import h5py
import pytest
from conftest import ROOT, run_mpi, run_py


def test_help_lists_commands():
    r = run_py(["-m", "mpips", "--help"], cwd=ROOT)
    assert r.returncode == 0
    for word in ("train", "layout", "data", "mpirun -n 8 python -m mpips train"):
        assert word in r.stdout
    for cmd in ("train", "layout", "data"):
        sub = run_py(["-m", "mpips", cmd, "--help"], cwd=ROOT)
        assert sub.returncode == 0 and "usage: python -m mpips " + cmd in sub.stdout


def test_layout_prints_roles_and_placement():
    r = run_py(["-m", "mpips", "layout", "-n", "8"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "2 ps, 6 workers, chief = rank 2" in r.stdout
    assert "   7  /job:worker/task:5" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines()]
    assert ["dense_0/kernel", "64x64", "float32", "16384", "/job:ps/task:0", "0"] in rows
    assert ["dense_0/bias", "64", "float32", "256", "/job:ps/task:1", "0"] in rows
    assert ["dense_1/kernel", "64x10", "float32", "2560", "/job:ps/task:0", "16384"] in rows
    assert "pulls: in place, zero copy (the default on one node" in r.stdout
    r = run_py(["-m", "mpips", "layout", "-n", "4", "--nodes", "2"], cwd=ROOT)
    assert r.returncode == 0 and "pulls: copied each step (several nodes)" in r.stdout, r.stdout


def test_optimizer_settings_the_rule_ignores_are_warned_by_layout_and_train(tmp_path):
    """nesterov with adagrad trains (a job that changes only its kind still runs), and both
    the dry run and the run say once that the setting has no effect."""
    text = '[data]\nbuiltin = "digits"\n[optimizer]\nkind = "adagrad"\nnesterov = true\n'
    (tmp_path / "job.toml").write_text(text + "[train]\nsteps = 5\n")
    said = "warning: optimizer.nesterov = True has no effect: kind 'adagrad' does not use it"
    r = run_py(["-m", "mpips", "layout", "job.toml", "-n", "3"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.count(said) == 1, r.stdout + r.stderr
    sync = text.replace("[optimizer]", '[train]\nmode = "sync"\nsteps = 5\n[optimizer]')
    (tmp_path / "sync.toml").write_text(sync)
    r = run_py(["-m", "mpips", "layout", "sync.toml", "-n", "3"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.count(said) == 1, r.stdout + r.stderr
    r = run_py(["-m", "mpips", "train", "job.toml", "--no-progress"], cwd=tmp_path)
    assert r.returncode == 0 and (r.stdout + r.stderr).count(said) == 1, r.stdout + r.stderr


def test_layout_errors_are_one_line(tmp_path):
    (tmp_path / "all-ps.toml").write_text("ps = [0, 1]\n")
    r = run_py(
        ["-m", "mpips", "layout", "-n", "2", "--layout", str(tmp_path / "all-ps.toml")], cwd=ROOT
    )
    assert r.returncode == 2 and r.stderr.startswith("mpips: error:")
    assert "at least one worker is needed" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "l.toml").write_text("ps = [7]\n")
    r = run_py(["-m", "mpips", "layout", "-n", "4", "--layout", str(tmp_path / "l.toml")], cwd=ROOT)
    assert r.returncode == 2 and "ps rank 7 is out of range for 4 ranks" in r.stderr
    # a pin to no variable: the error alone, not the rank table and then the error
    (tmp_path / "pin.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nsteps = 5\n[layout.pin]\n"nope" = 1\n'
    )
    r = run_py(["-m", "mpips", "layout", "pin.toml", "-n", "4"], cwd=tmp_path)
    assert r.returncode == 2 and "layout.pin: the model has no variable 'nope'" in r.stderr
    assert not r.stdout, r.stdout


def test_layout_on_one_process_shows_the_single_replica_it_trains_as():
    r = run_py(["-m", "mpips", "layout", "-n", "1"], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "0 ps, 1 worker, chief = rank 0" in r.stdout and "single synchronous replica" in r.stdout
    assert '(here "async")' in r.stdout and "placement (" not in r.stdout


def test_layout_on_one_process_refuses_a_model_with_tables_as_train_does(tmp_path):
    from test_ctr_mpi import JOB, small_dataset

    small_dataset(tmp_path / "s.h5")
    text = JOB.format(model="logreg", rule="mod", opt="ftrl", lr=0.3, steps=20)
    (tmp_path / "job.toml").write_text(text)
    r = run_py(["-m", "mpips", "layout", "job.toml", "-n", "1"], cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "keeps its tables (wide/weights float32[40, 1]) on PS tasks" in r.stderr
    assert "mpirun -n 3 python -m mpips train" in r.stderr and not r.stdout
    r = run_py(["-m", "mpips", "layout", "job.toml", "-n", "3"], cwd=tmp_path)
    assert r.returncode == 0 and "wide/weights" in r.stdout, r.stderr


def test_data_synthetic(tmp_path):
    r = run_py(["-m", "mpips", "data", "synthetic", "s.h5", "--rows", "300"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "300 train + 10000 test rows, 784 inputs, 10 classes" in r.stdout
    with h5py.File(tmp_path / "s.h5") as f:
        assert f["train/x"].shape == (300, 784)


def test_data_converter_errors(tmp_path):
    r = run_py(
        ["-m", "mpips", "data", "fashion-mnist", "f.h5", "--src", str(tmp_path)], cwd=tmp_path
    )
    assert r.returncode == 2 and "not found (apt-get install dataset-fashion-mnist)" in r.stderr
    assert not (tmp_path / "f.h5").exists()


def test_ckpt_list_inspect_export(tmp_path):
    import numpy as np

    from mpips import checkpoint

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    for step in (5, 9):  # two shards, as two PS tasks write them
        checkpoint.write_shard(tmp_path / "ck", step, 0, 2, {"dense_0/kernel": w * step})
        checkpoint.write_shard(tmp_path / "ck", step, 1, 2, {}, {"dense_0/kernel/m": w + 1})
        index = checkpoint.whole_index({"dense_0/kernel": w})
        slots = {"dense_0/kernel/m": checkpoint.Entry((2, 3), "float32", (checkpoint.Part(1),))}
        checkpoint.commit(
            tmp_path / "ck", step, 2, index, slots, {"job": "j.toml", "clocks": [4, 5]}
        )
    r = run_py(["-m", "mpips", "ckpt", "list", "ck"], cwd=tmp_path)
    assert r.returncode == 0 and [line.split()[0] for line in r.stdout.splitlines()] == ["5", "9"]
    assert "ck/ckpt-9.json  2 shard(s)" in r.stdout
    r = run_py(["-m", "mpips", "ckpt", "inspect", "ck"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "ck/ckpt-9.json: global_step 9, written by j.toml" in r.stdout
    assert "data position (updates per worker task): [4, 5]" in r.stdout
    rows = [line.split()[:3] for line in r.stdout.splitlines()]
    assert ["dense_0/kernel", "2x3", "float32"] in rows
    assert ["dense_0/kernel/m", "2x3", "float32"] in rows
    r = run_py(
        ["-m", "mpips", "ckpt", "export", "ck/ckpt-5.json", "out.h5", "--slots"], cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "out.h5") as f:
        assert f.attrs["global_step"] == 5
        np.testing.assert_array_equal(f["dense_0/kernel"][()], w * 5)
        np.testing.assert_array_equal(f["slots/m/dense_0/kernel"][()], w + 1)
    for args, message in (
        (["inspect", "missing"], "missing: not found"),
        (["inspect", "."], "no checkpoint (ckpt-<step>.json) in this directory"),
    ):
        r = run_py(["-m", "mpips", "ckpt", *args], cwd=tmp_path)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_ckpt_list_of_a_missing_directory_is_an_error(tmp_path):
    for path, said in (("nowhere", "nowhere: not found"), ("afile", "afile: not a directory")):
        (tmp_path / "afile").write_text("x")
        r = run_py(["-m", "mpips", "ckpt", "list", path], cwd=tmp_path)
        assert r.returncode == 2 and said in r.stderr and "Traceback" not in r.stderr, r.stderr
    (tmp_path / "empty").mkdir()
    r = run_py(["-m", "mpips", "ckpt", "list", "empty"], cwd=tmp_path)
    assert r.returncode == 0 and "empty: no checkpoints" in r.stdout


def test_data_digits_needs_nothing_beyond_the_package(tmp_path):
    """The digits ship inside mpips: `data digits` copies them, with no scikit-learn (a
    stand-in module that fails on import proves it is not used)."""
    (tmp_path / "sklearn.py").write_text("raise ImportError('scikit-learn is not installed')\n")
    r = run_py(
        [
            "-c",
            "import sys; sys.path.insert(0, '.'); from mpips.cli import main; "
            "sys.exit(main(['data', 'digits', 'd.h5']))",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "1437 train + 360 test rows, 64 inputs, 10 classes" in r.stdout
    from mpips.data import batches as data

    with h5py.File(tmp_path / "d.h5") as f, h5py.File(data.resolve_path("", "digits")) as g:
        for key in ("train/x", "train/y", "test/x", "test/y"):
            assert (f[key][()] == g[key][()]).all()


def test_help_texts_name_only_what_the_repository_has():
    """--help must not send users to documents they do not have."""
    import re

    for cmd in ([], ["train"], ["layout"], ["data"], ["ckpt"]):
        r = run_py(["-m", "mpips", *cmd, "--help"], cwd=ROOT)
        assert r.returncode == 0
        for doc in re.findall(r"[\w./-]+\.md\b", r.stdout):
            assert (ROOT / doc).exists(), f"`{' '.join(cmd)} --help` names {doc}"
        assert "REFERENCE" not in r.stdout and "../shared" not in r.stdout


def test_layout_of_a_sync_job(tmp_path):
    (tmp_path / "sync.toml").write_text(
        '[data]\nbuiltin = "digits"\n[train]\nmode = "sync"\nsteps = 10\n'
    )
    r = run_py(["-m", "mpips", "layout", "sync.toml", "-n", "8"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "0 ps, 8 workers, chief = rank 0" in r.stdout
    assert "sync replicas: every worker holds all 4 variables" in r.stdout
    rows = [line.split() for line in r.stdout.splitlines()]
    assert ["dense_0/kernel", "64x64", "float32", "16384"] in rows
    r = run_py(["-m", "mpips", "layout", "sync.toml", "-n", "8", "--ps", "1"], cwd=tmp_path)
    assert r.returncode == 0 and "the 1 ps task(s) hold nothing and wait" in r.stdout, r.stderr


def test_version_comes_from_the_package():
    import subprocess
    import sys

    import mpips

    r = subprocess.run(
        [sys.executable, "-m", "mpips", "--version"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and r.stdout.strip() == f"mpips {mpips.__version__}"


def test_one_process_trains_and_its_final_line_says_one_worker(tmp_path):
    r = run_py(["-m", "mpips", "train", "--steps", "20", "--no-progress"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "final: global_step 20 " in r.stdout and " examples on 1 worker in " in r.stdout


@pytest.mark.launcher
def test_a_first_run_is_quiet_and_verbose_adds_the_details(tmp_path):
    """Without MPIPS_VERBOSE or -v, a run prints no per-rank detail (pids, rows,
    staleness, each worker's "done" line: the result file holds them); -v prints them, as
    MPIPS_VERBOSE=1 does (tests run verbose). Either way every rank says bye to its node's
    watcher: nobody "died". (One pair of runs for what two tests launched apart.)"""
    import re

    quiet = run_mpi(
        3,
        ["-m", "mpips", "train", "--steps", "30", "--no-progress"],
        tmp_path,
        90,
        MPIPS_VERBOSE="0",
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "final: global_step 30 " in quiet.stdout, quiet.stdout
    assert " examples on 2 workers in " in quiet.stdout, quiet.stdout
    for word in ("pid ", "train rows", "staleness of", "] done: "):
        assert word not in quiet.stdout, quiet.stdout
    loud = run_mpi(
        3,
        ["-m", "mpips", "train", "--steps", "60", "--no-progress", "-v"],
        tmp_path,
        90,
        MPIPS_VERBOSE="0",
    )
    assert loud.returncode == 0, loud.stderr
    for word in ("rank 0, pid ", "rank 2, pid ", "train rows", "staleness of"):
        assert word in loud.stdout, loud.stdout
    done = re.findall(r"^\[/job:worker/task:(\d)\] done: \d+ updates", loud.stdout, re.M)
    assert sorted(done) == ["0", "1"], loud.stdout
    for r in (quiet, loud):  # every rank said bye to its node's watcher: nobody "died"
        assert "died without a word" not in r.stderr, r.stderr


@pytest.mark.parametrize(
    "argv,steps,epochs",
    [
        (["--epochs", "3"], 600, 3),  # the default job's steps stay: whichever comes first
        (["--epochs", "2", "--steps", "0"], 0, 2),  # by epochs alone
        (["--steps", "40"], 40, 0),
    ],
)
def test_train_overrides_steps_and_epochs(argv, steps, epochs):
    """`train --epochs N` overrides train.epochs as `--steps` overrides train.steps."""
    from mpips.cli import _resolve_job, build_parser

    job = _resolve_job(build_parser().parse_args(["train", *argv]))
    assert (job.train.steps, job.train.epochs) == (steps, epochs)


def test_train_epochs_out_of_range_is_refused():
    from mpips.cli import _resolve_job, build_parser
    from mpips.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train.epochs: must be >= 0, got -1"):
        _resolve_job(build_parser().parse_args(["train", "--epochs", "-1"]))

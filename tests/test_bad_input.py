"""The bad-input corpus, end to end under `mpiexec -n 3`: every case is one clear message,
said once (not once per rank), exit code 2, no traceback, no hang, and no file changed."""

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import dense_data_file, run_mpi

from mpips.checkpoint import LOCK_FILE

pytestmark = pytest.mark.launcher

GOOD_JOB = (
    '[data]\npath = "d.h5"\n[train]\nsteps = 20\nprogress = false\n[checkpoint]\ndir = "runs/ck"\n'
)


def write_data(path, **over):
    return dense_data_file(path, **over)


def snapshot(d: Path) -> dict[str, str]:
    """Every file's hash, but the checkpoint directory's lock file: it says who last ran
    there (a run that stops at start-up has held it), and holds no checkpoint data."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name != LOCK_FILE
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A directory with good data and a committed checkpoint at global_step 20."""
    d = tmp_path_factory.mktemp("trained")
    write_data(d / "d.h5")
    (d / "job.toml").write_text(GOOD_JOB)
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml"], cwd=d, timeout=60)
    assert r.returncode == 0, r.stderr
    assert (d / "runs/ck/ckpt-20.json").exists()
    return d


def truncate(path: Path, keep: float = 0.5) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * keep)])


def edit_manifest(path: Path) -> None:
    raw = json.loads(path.read_text())
    raw["variables"]["dense_0/kernel"]["shape"] = [4, 5]
    path.write_text(json.dumps(raw))


def external_link(d: Path) -> None:
    """The shard's kernel becomes a link to an array in a file outside the checkpoint."""
    with h5py.File(d / "outside.h5", "w") as f:
        f["kernel"] = np.zeros((4, 64), np.float32)
    with h5py.File(d / "runs/ck/ckpt-20.shard-0-of-1.h5", "a") as f:
        del f["variables/dense_0/kernel"]
        f["variables/dense_0/kernel"] = h5py.ExternalLink(str(d / "outside.h5"), "/kernel")


def huge_inputs(d: Path) -> None:
    """Data declaring 2^40 inputs per row (a tiny file: no chunk is ever written)."""
    write_data(d / "d.h5")
    with h5py.File(d / "d.h5", "a") as f:
        for split, rows in (("train", 60), ("test", 10)):
            del f[f"{split}/x"]
            f.create_dataset(f"{split}/x", (rows, 1 << 40), np.uint8, chunks=(1, 1 << 16))


NPY_JOB = GOOD_JOB.replace(
    'path = "d.h5"',
    'train_x = "x.npy"\ntrain_y = "e.npy"\ntest_x = "x.npy"\ntest_y = "y.npy"',
)


def empty_data(d: Path, job: str, name: str) -> None:
    """The job reads its data from a 0-byte file ``name`` (numpy: an EOFError, which was a
    traceback), its other arrays good .npy files."""
    (d / "job.toml").write_text(job)
    with h5py.File(d / "d.h5") as f:
        np.save(d / "x.npy", f["train/x"][()])
        np.save(d / "y.npy", f["train/y"][()])
    (d / name).write_bytes(b"")


# (what to break, extra args, the message): each case starts from a copy of `trained`
CASES = {
    "malformed TOML": (
        lambda d: (d / "job.toml").write_text("[train\nsteps = 5\n"),
        [],
        "job.toml: invalid TOML",
    ),
    "unknown key": (
        lambda d: (d / "job.toml").write_text(GOOD_JOB.replace("steps", "stepz")),
        [],
        "unknown key 'stepz' (did you mean 'steps'?)",
    ),
    "wrong type": (
        lambda d: (d / "job.toml").write_text(GOOD_JOB.replace("20", '"20"')),
        [],
        "train.steps: expected an integer, got '20'",
    ),
    "bad value": (
        lambda d: (d / "job.toml").write_text(GOOD_JOB + "[optimizer]\nkind = 'adamw'\n"),
        [],
        "optimizer.kind: 'adamw' is not one of",
    ),
    "layout does not fit": (lambda d: None, ["--ps", "3"], "needs 1 <= ps < world size 3"),
    "layout for another world size": (
        lambda d: (d / "l.toml").write_text("ps = 1\nworld_size = 8\n"),
        ["--layout", "l.toml"],
        "world_size = 8, but the job runs on 3 ranks (mpirun -n 8?)",
    ),
    "layout world_size that is not an integer": (
        lambda d: (d / "l.toml").write_text('ps = 1\nworld_size = "3"\n'),
        ["--layout", "l.toml"],
        "layout file l.toml: world_size: expected an integer, got '3'",
    ),
    "layout ps that is not a count": (
        lambda d: (d / "l.toml").write_text("ps = true\n"),
        ["--layout", "l.toml"],
        'layout file l.toml: ps: expected a count, a list of ranks or "per_node", got True',
    ),
    "layout file unknown key": (
        lambda d: (d / "l.toml").write_text("pss = 1\n"),
        ["--layout", "l.toml"],
        "unknown key 'pss' (did you mean 'ps'?)",
    ),
    "missing data": (lambda d: (d / "d.h5").unlink(), [], "data file d.h5: not found"),
    "data that is not numbers": (
        lambda d: write_data(d / "d.h5", **{"train/x": np.full((60, 4), b"a")}),
        [],
        "'train/x' must be rows of numbers",
    ),
    "data of the wrong dtype": (
        lambda d: write_data(d / "d.h5", **{"train/y": np.zeros(60, np.float32)}),
        [],
        "'train/y' must be 1-D integer labels",
    ),
    "an empty .npz file as data": (
        lambda d: empty_data(d, GOOD_JOB.replace("d.h5", "e.npz"), "e.npz"),
        [],
        "data file e.npz: not a readable .npz dataset (empty)",
    ),
    "an empty .npy file as data": (
        lambda d: empty_data(d, NPY_JOB, "e.npy"),
        [],
        "data file e.npy: not a readable .npy dataset (empty)",
    ),
    "truncated data": (lambda d: truncate(d / "d.h5", 0.3), [], "not a readable mpips HDF5"),
    "labels out of range": (
        lambda d: write_data(d / "d.h5", **{"train/y": np.full(60, 7)}),
        [],
        "train/y has label 7 outside 0..2",
    ),
    "truncated checkpoint shard": (
        lambda d: truncate(d / "runs/ck/ckpt-20.shard-0-of-1.h5"),
        [],
        "checkpoint runs/ck/ckpt-20.json: corrupt or unreadable",
    ),
    "truncated manifest": (
        lambda d: truncate(d / "runs/ck/ckpt-20.json"),
        [],
        "checkpoint runs/ck/ckpt-20.json: corrupt or unreadable",
    ),
    "manifest that lies": (
        lambda d: edit_manifest(d / "runs/ck/ckpt-20.json"),
        [],
        "variable 'dense_0/kernel' is float32[4, 5], the model expects",
    ),
    "a CTR model on dense data": (
        lambda d: (d / "job.toml").write_text(GOOD_JOB + "[model]\nkind = 'logreg'\n"),
        [],
        "model.kind = 'logreg' needs sparse (CSR ids and values) data; d.h5 is dense",
    ),
    "a shard linking to a file outside": (
        external_link,
        [],
        "'variables/dense_0/kernel' is an external link",
    ),
    "data declaring a model too big for memory": (
        huge_inputs,
        ["--no-restore", "--ckpt-dir", "runs/new"],
        "the model on this node (3 ranks; largest variable dense_0/kernel "
        "float32[1099511627776, 64], from d.h5) needs",
    ),
    "a checkpoint dir that cannot be written": (
        lambda d: (d / "afile").write_text("x"),
        ["--ckpt-dir", "afile/ck"],
        "checkpoint.dir afile/ck: cannot write checkpoints there",
    ),
    "a fresh start into another run's directory": (
        lambda d: None,
        ["--no-restore"],
        "checkpoint.dir runs/ck already holds 1 checkpoint(s) of an earlier run",
    ),
    "checkpoint of another model": (
        lambda d: (d / "job.toml").write_text(GOOD_JOB + "[model]\nhidden = [32]\n"),
        [],
        "variable 'dense_0/kernel' is float32[4, 64], the model expects float32[4, 32]",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_message_exit_2_and_changes_nothing(trained, tmp_path, case):
    breaker, args, message = CASES[case]
    d = tmp_path / "w"
    shutil.copytree(trained, d)
    breaker(d)
    before = snapshot(d)
    r = run_mpi(3, ["-m", "mpips", "train", "job.toml", "--steps", "40", *args], cwd=d, timeout=90)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count(message) == 1, r.stderr  # said once, not once per rank
    assert r.stderr.count("mpips: error") == 1 and "Traceback" not in r.stderr, r.stderr
    assert snapshot(d) == before, "a file was changed"

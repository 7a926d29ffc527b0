"""The smaller commands on a hostile tester's input: each is one `mpips: error:` line, exit 2,
no traceback, nothing written (plain processes, or `mpips.cli.main` in this one; no MPI
launch)."""

import json

import h5py
import numpy as np
import pytest
from conftest import ROOT, dense_data_file, run_py

from mpips.cli import main
from mpips.errors import DataError
from mpips.job import DataConfig
from mpips.placement.layout import MAX_WORLD_SIZE, make_layout

JOB = (
    '[data]\npath = "{data}"\n[train]\nsteps = 20\nprogress = false\n'
    '[checkpoint]\ndir = "runs/ck"\n'
)
quick = pytest.mark.launcher  # (a process of its own: the full suite, not the fast tier)


def refused(r, *said: str) -> None:
    """A subprocess that stopped on bad input: one message, exit 2, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert r.stderr.startswith("mpips: error:") and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    for text in said:
        assert text in r.stderr, r.stderr


def said_in_process(capsys, argv: list[str], *said: str) -> str:
    """``main(argv)`` in this process stops with exit 2 and one message holding ``said``."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mpips: error:") and err.count("\n") == 1, (code, err)
    for text in said:
        assert text in err, err
    return err


# -- 1. layout: world size and nodes --------------------------------------------------------


@quick
def test_layout_refuses_a_world_of_no_ranks_or_an_absurd_one(tmp_path):
    # -n 0 showed the default 8 ranks; 10^9 ran until killed
    for n in ("0", "-3", "1000000000", str(MAX_WORLD_SIZE + 1)):
        r = run_py(["-m", "mpips", "layout", "-n", n], cwd=ROOT, timeout=60)
        refused(r, f"-n {n}: the number of ranks must be in 1..{MAX_WORLD_SIZE}")
        assert not r.stdout
    (tmp_path / "job.toml").write_text("[train]\nsteps = 5\n[layout]\nworld_size = 2000000000\n")
    r = run_py(["-m", "mpips", "layout", "job.toml"], cwd=tmp_path, timeout=60)
    refused(r, "[layout] world_size = 2000000000: the number of ranks must be in 1..")
    from mpips.checkpoint import MAX_SHARDS

    assert MAX_WORLD_SIZE == MAX_SHARDS  # the limit's reason: a checkpoint shard per PS task


@quick
def test_layout_refuses_nodes_that_run_no_rank():
    for nodes in ("0", "-1", "9", "100"):
        r = run_py(["-m", "mpips", "layout", "-n", "8", "--nodes", nodes], cwd=ROOT)
        refused(r, f"--nodes {nodes}: must be in 1..8 (each node runs at least one")
    r = run_py(["-m", "mpips", "layout", "-n", "8", "--nodes", "8"], cwd=ROOT)
    assert r.returncode == 0 and "on 8 ranks on 8 nodes" in r.stdout, r.stderr


@quick
def test_layout_of_many_ranks_takes_time_linear_in_them():
    """Every rank's role was a search of all worker ranks (recomputed each time): -n 100000
    printed 32k lines in a minute. 2^18 ranks now take a few seconds."""
    n = 1 << 18
    r = run_py(["-m", "mpips", "layout", "-n", str(n)], cwd=ROOT, timeout=90)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"on {n} ranks: {n // 4} ps, {n - n // 4} workers" in r.stdout
    assert f"{n - 1:>4}  /job:worker/task:{n - n // 4 - 1}\n" in r.stdout


@pytest.mark.parametrize("ps", [None, [7, 2, 5], [0], [9, 0]])
def test_roles_are_as_before(ps):
    """Layout.role, now a lookup: PS task = place in ps_ranks, worker task = place among the
    other ranks in rank order."""
    lay = make_layout(10, ps)
    for r in range(10):
        if r in lay.ps_ranks:
            assert (lay.role(r).job, lay.role(r).task) == ("ps", lay.ps_ranks.index(r))
        else:
            assert (lay.role(r).job, lay.role(r).task) == ("worker", lay.worker_ranks.index(r))
    with pytest.raises(ValueError):
        lay.role(10)


# -- 2, 3. data with no inputs a row, or a split with no rows --------------------------------


@quick
def test_data_with_no_inputs_a_row_is_one_message_naming_the_file(tmp_path):
    dense_data_file(
        tmp_path / "d.h5",
        **{"train/x": np.zeros((60, 0), np.uint8), "test/x": np.zeros((10, 0), np.uint8)},
    )
    (tmp_path / "job.toml").write_text(JOB.format(data="d.h5"))
    r = run_py(["-m", "mpips", "train", "job.toml"], cwd=tmp_path)  # ZeroDivisionError, exit 1
    refused(r, "data file d.h5: dataset 'train/x' has shape [60, 0]: its rows hold no inputs")
    assert not (tmp_path / "runs/ck").exists() or not list((tmp_path / "runs/ck").glob("*.json"))


def test_npz_data_with_no_inputs_a_row_is_refused(tmp_path, capsys):
    y = np.arange(20) % 3
    path = str(tmp_path / "z.npz")
    np.savez(path, x_train=np.zeros((20, 0)), y_train=y, x_test=np.zeros((5, 0)), y_test=y[:5])
    from mpips.data.batches import open_data

    with pytest.raises(DataError, match=r"z\.npz: array 'x_train' has shape \[20, 0\]"):
        open_data(DataConfig(path=path))
    np.savez(tmp_path / "x.npz", x=np.zeros((20, 0), np.float32), y=y)
    said_in_process(
        capsys,
        ["data", "arrays", str(tmp_path / "o.h5"), "--src", str(tmp_path / "x.npz")],
        "x.npz: x has shape [20, 0]: its rows hold no inputs",
    )
    assert not (tmp_path / "o.h5").exists()


@quick
def test_an_empty_test_split_is_said_before_training(tmp_path):
    dense_data_file(tmp_path / "d.h5", test=0)
    (tmp_path / "job.toml").write_text(JOB.format(data="d.h5"))
    r = run_py(["-m", "mpips", "train", "job.toml"], cwd=tmp_path)  # was: cannot reshape
    refused(r, "data file d.h5: the test split has no rows (dataset 'test/x' is empty)")
    assert "reshape" not in r.stderr and not list(tmp_path.glob("runs/ck/ckpt-*"))


def test_an_empty_split_of_a_sparse_file_or_of_arrays_is_refused(tmp_path, capsys):
    import h5py
    import scipy.sparse as sp

    from mpips.data.batches import open_dataset
    from mpips.data.sparse import write_csr_chunks

    x, y = sp.csr_matrix(np.eye(4, 6, dtype=np.float32)), np.array([0, 1, 0, 1], np.int8)
    write_csr_chunks(tmp_path / "s.h5", [("train", x, y), ("test", x, y)], num_features=6)
    with h5py.File(tmp_path / "s.h5", "r+") as f:  # (the writer refuses to leave it empty)
        for key, size in (("label", 0), ("ids", 0), ("values", 0), ("indptr", 1)):
            f[f"test/{key}"].resize((size,))
    with pytest.raises(DataError, match="the test split has no rows"):
        open_dataset(str(tmp_path / "s.h5"))
    np.savez(tmp_path / "one.npz", x=np.ones((1, 3), np.float32), y=np.array([1]))
    np.savez(tmp_path / "none.npz", x=np.ones((0, 3), np.float32), y=np.zeros(0, int))
    out = str(tmp_path / "o.h5")
    said_in_process(
        capsys,
        ["data", "arrays", out, "--src", str(tmp_path / "one.npz")],
        "1 row(s) are too few to hold out 20% as the test split",
    )
    for flag in ("--src", "--test-src", "--val-src"):
        files = {"--src": "one.npz", "--test-src": "one.npz"} | {flag: "none.npz"}
        args = [a for k, v in files.items() for a in (k, str(tmp_path / v))]
        said_in_process(capsys, ["data", "arrays", out, *args], "none.npz: x has no rows")
    assert not (tmp_path / "o.h5").exists()


# -- 4, 8. predict on empty or non-finite inputs; what ckpt and eval print ---------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One process trained 20 steps: a checkpoint and the chief's summaries in runs/ck."""
    d = tmp_path_factory.mktemp("trained")
    dense_data_file(d / "d.h5")
    (d / "job.toml").write_text(JOB.format(data="d.h5"))
    r = run_py(["-m", "mpips", "train", "job.toml"], cwd=d)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "summaries in runs/ck/worker-*/" in r.stdout  # train says where they are
    assert (d / "runs/ck/ckpt-20.json").exists() and (d / "runs/ck/worker-0").is_dir()
    return d


@quick
def test_predict_refuses_no_rows_and_values_that_are_not_finite(trained):
    np.save(trained / "empty.npy", np.zeros((0, 4), np.float32))
    with h5py.File(trained / "empty.h5", "w") as f:
        f["x"] = np.zeros((0, 4))
    np.save(trained / "nan.npy", np.array([[1, 2, 3, 4], [1, 2, np.nan, 4]], np.float32))
    np.save(trained / "big.npy", np.array([[1, 2, 1e300, 4]]))  # inf as float32
    (trained / "zero.npy").write_bytes(b"")  # a file of no bytes at all
    (trained / "zero.npz").write_bytes(b"")
    np.savez(trained / "labels.npz", y=np.ones((3, 4), np.int64))  # only the labels
    for name, said in (
        ("zero.npy", "--input zero.npy: unreadable (empty)"),
        ("zero.npz", "--input zero.npz: not a readable .npz file (empty)"),
        ("labels.npz", "--input labels.npz: holds ['y']; name the inputs 'x'"),
        ("empty.npy", "--input empty.npy: holds no rows (shape [0, 4])"),
        ("empty.h5", "--input empty.h5: holds no rows (shape [0, 4])"),
        ("nan.npy", "--input nan.npy: input row 1 holds nan at input 2"),
        ("big.npy", "--input big.npy: input row 0 holds inf at input 2"),
    ):
        r = run_py(
            ["-m", "mpips", "predict", "job.toml", "--input", name, "--output", "p.npy"],
            cwd=trained,
        )
        refused(r, said)
        assert not (trained / "p.npy").exists()
    np.save(trained / "good.npy", np.ones((3, 4), np.float32))
    r = run_py(
        ["-m", "mpips", "predict", "job.toml", "--input", "good.npy", "--output", "p.npy"],
        cwd=trained,
    )
    assert r.returncode == 0 and np.load(trained / "p.npy").shape == (3, 3), r.stderr


@quick
def test_only_train_says_where_the_summaries_are(trained):
    for args in (["ckpt", "list", "runs/ck"], ["ckpt", "inspect", "runs/ck"], ["eval", "job.toml"]):
        r = run_py(["-m", "mpips", *args], cwd=trained)
        assert r.returncode == 0, r.stderr
        assert "summaries in" not in r.stdout + r.stderr, (args, r.stdout)


# -- 5. plot on garbage metrics and timelines ------------------------------------------------


def _run_dir(tmp_path, *extra: str):
    d = tmp_path / "run"
    (d / "worker-0").mkdir(parents=True)
    good = [
        json.dumps(
            {"time": 1.0 + i, "task": "/job:worker/task:0", "step": i, "name": n, "value": v}
        )
        for i in range(1, 4)
        for n, v in (("loss", 1.0 / i), ("validation/accuracy", 0.5))
    ]
    (d / "worker-0/metrics.jsonl").write_text("\n".join([*good, *extra]) + "\n")
    return d


def test_plot_skips_a_line_nested_too_deep_and_says_how_many_it_skipped(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from mpips.run.summaries import validation_at

    nested = "[" * 100_000 + "]" * 100_000  # RecursionError in json.loads
    d = _run_dir(tmp_path, nested, "garbage", '{"name": "loss"')
    assert main(["plot", str(d), "--out", str(tmp_path / "png")]) == 0
    out = capsys.readouterr().out
    assert out.count("skipped") == 1 and "skipped 3 unreadable line(s)" in out, out
    assert (tmp_path / "png/loss.png").exists()
    assert validation_at(d, 3) == {"accuracy": 0.5}  # `ckpt list` reads it the same way


def test_plot_of_a_malformed_timeline_is_one_message(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    d = _run_dir(tmp_path)
    (d / "timeline").mkdir()
    for text, said in (
        ('{"traceEvents": [1, {"ph": "X"}]}', "timeline.json: not a timeline (a malformed event"),
        ('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}", "w.json: not a timeline file"),
    ):
        (d / "timeline/w.json").write_text(text)
        said_in_process(capsys, ["plot", str(d), "--out", str(tmp_path / "png")], said)


# -- 6, 7. data: sizes and the output path ---------------------------------------------------


@pytest.mark.parametrize(
    "args,said",
    [
        (["synthetic", "--rows", "-1"], "--rows -1: synthetic needs at least 1 train row(s)"),
        (["synthetic", "--rows", "0"], "--rows 0: synthetic needs at least 1 train row(s)"),
        (["synthetic", "--rows", "100000000000"], "of memory available here"),
        (["synthetic", "--rows", str(10**21)], "more than any machine's memory"),
        (["zipf", "--features", "0"], "--features 0: the id space needs at least 1 id"),
        (["zipf", "--rows", "-1"], "--rows -1: zipf needs at least 10 train row(s)"),
        (["zipf", "--rows", "5"], "a tenth of them are its test rows"),
        (["zipf", "--rows", str(10**12)], "TiB, more than the"),  # (it filled the disk)
    ],
)
def test_data_sizes_out_of_range_are_refused(tmp_path, capsys, args, said):
    out = str(tmp_path / "o.h5")
    said_in_process(capsys, ["data", args[0], out, *args[1:]], said)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("test_file", [False, True])
def test_a_text_conversion_with_no_test_rows_is_refused_and_writes_nothing(
    tmp_path, capsys, test_file
):
    """Four libsvm rows hold none out (every fifth row is a test row), and an empty test
    file gives none: one message naming the file and why, and the output file (a good one
    there before) is left as it was (it was written, then refused by the reader)."""
    (tmp_path / "a.svm").write_text("1 1:1 5:1\n0 2:1\n1 3:1 4:0.5\n0 7:2\n")
    (tmp_path / "empty.svm").write_text("# nothing\n")
    out = tmp_path / "o.h5"
    out.write_bytes(b"a good file")
    argv = ["data", "libsvm", str(out), "--src", str(tmp_path / "a.svm")]
    argv += ["--test-src", str(tmp_path / "empty.svm")] if test_file else []
    said = "empty.svm: no rows (nothing to test on)" if test_file else "a.svm: no test rows"
    said_in_process(capsys, argv, said)
    assert out.read_bytes() == b"a good file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.svm", "empty.svm", "o.h5"]


def test_data_into_a_directory_is_one_message(tmp_path, capsys):
    (tmp_path / "ck").mkdir()
    said_in_process(
        capsys, ["data", "digits", str(tmp_path / "ck")], "ck: is a directory; give the .h5 file"
    )
    (tmp_path / "afile").write_text("x")
    said_in_process(
        capsys,
        ["data", "digits", str(tmp_path / "afile/d.h5")],
        f"cannot be written ({tmp_path / 'afile'} is not a directory)",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ck"]
    assert not list((tmp_path / "ck").iterdir())


@quick
def test_an_output_naming_the_commands_own_input_is_refused_before_anything_is_lost(tmp_path):
    """--result onto the job file, predictions onto their input, a converter's HDF5 onto its
    text or .npz source: each replaced what the command read (exit 0, the input gone)."""
    (tmp_path / "j.toml").write_text('[data]\nbuiltin = "digits"\n[train]\nsteps = 5\n')
    (tmp_path / "a.svm").write_text("1 3:1.5\n0 7:2\n" * 50)
    np.savez(tmp_path / "src.npz", x=np.zeros((40, 3), np.float32), y=np.arange(40) % 2)
    np.save(tmp_path / "in.npy", np.zeros((4, 64), np.float32))
    cases = [
        (["train", "j.toml", "--result", "j.toml", "--no-progress"], "j.toml"),
        (["eval", "j.toml", "--result", "./j.toml"], "j.toml"),
        (["predict", "--ckpt", "ck", "--input", "in.npy", "--output", "in.npy"], "in.npy"),
        (["data", "libsvm", "a.svm", "--src", "a.svm"], "a.svm"),
        (["data", "arrays", "src.npz", "--src", "src.npz"], "src.npz"),
    ]
    for argv, kept in cases:
        before = (tmp_path / kept).read_bytes()
        r = run_py(["-m", "mpips", *argv], cwd=tmp_path, timeout=120)
        refused(r, "the same file as the input", "give another output name")
        assert (tmp_path / kept).read_bytes() == before, argv

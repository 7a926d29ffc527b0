"""The command line as a user meets it (plain processes, no MPI launch)."""
import h5py
from conftest import ROOT, run_py


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


def test_layout_errors_are_one_line(tmp_path):
    r = run_py(["-m", "mpips", "layout", "-n", "1"], cwd=ROOT)
    assert r.returncode == 2 and r.stderr.startswith("mpips: error:") and "Traceback" not in r.stderr
    (tmp_path / "l.toml").write_text("ps = [7]\n")
    r = run_py(["-m", "mpips", "layout", "-n", "4", "--layout", str(tmp_path / "l.toml")], cwd=ROOT)
    assert r.returncode == 2 and "ps rank 7 is out of range for 4 ranks" in r.stderr


def test_data_synthetic(tmp_path):
    r = run_py(["-m", "mpips", "data", "synthetic", "s.h5", "--rows", "300"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "300 train + 10000 test rows, 784 inputs, 10 classes" in r.stdout
    with h5py.File(tmp_path / "s.h5") as f:
        assert f["train/x"].shape == (300, 784)


def test_data_converter_errors(tmp_path):
    r = run_py(["-m", "mpips", "data", "fashion-mnist", "f.h5", "--src", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 2 and "not found (apt-get install dataset-fashion-mnist)" in r.stderr
    assert not (tmp_path / "f.h5").exists()

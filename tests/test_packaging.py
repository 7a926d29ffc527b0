"""The built wheel carries what a fresh `pip install .` needs (the tests run from source)."""
import subprocess
import sys
import zipfile

from conftest import ROOT


def test_wheel_ships_the_default_job_and_digits(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                        str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("mpips-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("mpips/builtin/default.toml", "mpips/builtin/digits.h5", "mpips/__main__.py",
                   "mpips/store/client.py"):
        assert needed in names, needed

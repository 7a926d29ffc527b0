"""What a fresh `pip install .` gets (the other tests run from source): the built wheel's
files, and the wheel installed into a new environment running the README's commands, the
data converter, a torch job, `ckpt export` and the sbatch script's command from an empty
directory outside the checkout. Built once, installed once, for this module."""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, clean_env, mpiexec_path, need, stop_launcher

# what the build copy leaves out: anywhere, and in the checkout's top folder only (a data/
# or runs/ there is the user's, mpips/data/ is the package's)
_NOT_SOURCE = (".git", "__pycache__", ".pytest_cache", "*.egg-info")
_NOT_SOURCE_AT_TOP = {".venv", "build", "dist", "runs", "data"}


def _not_source(folder: str, names: list[str]) -> set[str]:
    top = Path(folder) == ROOT
    return {
        n
        for n in names
        if any(fnmatch(n, p) for p in _NOT_SOURCE) or (top and n in _NOT_SOURCE_AT_TOP)
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip install .` builds (with build isolation, as it does), from a clean
    copy: setuptools writes build/ and *.egg-info into the source tree."""
    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=_not_source)
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp), str(tmp / "src")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (built,) = tmp.glob("mpips-*.whl")
    return built


@pytest.mark.launcher  # a subprocess build: once, under plain pytest (not once per MPI rank)
def test_wheel_ships_the_default_job_and_digits(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in (
        "mpips/builtin/default.toml",
        "mpips/builtin/digits.h5",
        "mpips/__main__.py",
        "mpips/store/client.py",
        "mpips/data/__init__.py",
        "mpips/data/batches.py",
    ):
        assert needed in names, needed


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict[str, str]:
    """The wheel alone in a new venv, and the environment to run it in: its bin/ first on
    PATH (then this environment's mpiexec), no PYTHONPATH. Its dependencies come from this
    environment without a download: a .pth file names this environment's site-packages
    (after the venv's own, so the wheel's mpips wins) and the MPI library the mpich wheel
    put in lib/ is linked into the venv's lib/, where mpi4py looks for it."""
    new = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(new)], check=True, timeout=60
    )
    pip = [sys.executable, "-m", "pip", "--python", str(new / "bin" / "python")]
    r = subprocess.run(
        [*pip, "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    (packages,) = new.glob("lib/python*/site-packages")
    outer = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    (packages / "outer_environment.pth").write_text("\n".join(outer) + "\n")
    for lib in Path(sys.prefix, "lib").glob("*"):
        if lib.name == "mpich" or lib.name.startswith("libmpi"):
            (new / "lib" / lib.name).symlink_to(lib)
    env = clean_env()
    for var in ("PYTHONPATH", "MPIPS_LAUNCHER", "PYTHONHOME"):
        env.pop(var, None)
    env["VIRTUAL_ENV"] = str(new)
    env["PATH"] = os.pathsep.join([str(new / "bin"), str(Path(mpiexec_path()).parent), env["PATH"]])
    found = _run(["python", "-c", "import mpips; print(mpips.__file__)"], new, env)
    assert found.stdout.startswith(str(packages / "mpips")), found.stdout
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 90):
    """CMD (found on env's PATH) in cwd; a job that hangs is ended with its ranks. Any exit
    but 0 fails the test with the output."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_launcher(proc)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s\n{out}\n{err}")
    assert proc.returncode == 0, f"{' '.join(cmd)}: exit {proc.returncode}\n{out}\n{err}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.launcher
def test_installed_mpips_trains_the_default_job_in_one_process(installed, tmp_path):
    """The README's first command, without mpirun, from an empty directory."""
    r = _run(["python", "-m", "mpips", "train"], tmp_path, installed)
    assert "final: global_step 600 test_accuracy" in r.stdout, r.stdout


@pytest.mark.launcher
def test_installed_mpips_trains_by_the_sbatch_script_and_exports(installed, tmp_path):
    """slurm/train.sbatch as sbatch runs it (SLURM_NTASKS=3, from the submit directory):
    `mpiexec -n 3 python -m mpips train --no-progress`, the README's first command under
    MPI (mpirun is mpiexec); then `ckpt export` of the checkpoint it wrote."""
    env = {**installed, "SLURM_NTASKS": "3"}
    r = _run(["bash", str(ROOT / "slurm" / "train.sbatch")], tmp_path, env)
    assert "final: global_step 600 test_accuracy" in r.stdout, r.stdout
    _run(["python", "-m", "mpips", "ckpt", "export", "runs/default", "w.h5"], tmp_path, installed)
    assert (tmp_path / "w.h5").stat().st_size > 0


@pytest.mark.launcher
def test_installed_mpips_converts_arrays(installed, tmp_path):
    """`python -m mpips data arrays` from the user's .npz files."""
    rng = np.random.default_rng(0)
    for split, rows in (("train", 60), ("test", 20)):
        np.savez(tmp_path / split, x=rng.normal(size=(rows, 4)), y=rng.integers(0, 3, rows))
    cmd = ["python", "-m", "mpips", "data", "arrays", "data/own.h5", "--src", "train.npz"]
    r = _run([*cmd, "--test-src", "test.npz"], tmp_path, installed)
    assert "wrote data/own.h5: 60 train + 20 test rows" in r.stdout, r.stdout


@pytest.mark.launcher
def test_installed_mpips_trains_the_torch_job(installed, tmp_path):
    """The README's PyTorch job (jobs/torch_net.py and .toml copied, a few steps)."""
    if importlib.util.find_spec("torch") is None:
        need("torch")  # a skip (a failure under CI=true), without importing torch here
    for name in ("torch_net.py", "torch_net.toml"):
        shutil.copy(ROOT / "jobs" / name, tmp_path)
    cmd = ["python", "-m", "mpips", "train", "torch_net.toml", "--steps", "20", "--no-progress"]
    r = _run(cmd, tmp_path, installed)
    assert "final: global_step 20 test_accuracy" in r.stdout, r.stdout


@pytest.mark.launcher
def test_no_file_of_the_package_is_ignored_by_git():
    """A .gitignore line that matches a folder of the package (`data/` once matched
    mpips/data/) keeps its new files out of commits, so out of a clean clone's install."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = [str(p.relative_to(ROOT)) for p in (ROOT / "mpips").rglob("*.py")]
    r = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        input="\n".join(files),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1 and not r.stdout, f"ignored by git: {r.stdout}{r.stderr}"


def test_a_missing_framework_skips_the_module_that_needs_it(monkeypatch):
    """need() at a test module's top (test_torch_*.py, test_jax_frontend.py) skips the whole
    module where the framework is not installed: a skip that is not module-level is a
    collection error (`pytest -m "not slow"` after `pip install ".[test,ctr]"`)."""
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception) as e:
        need("mpips_no_such_framework")
    assert e.value.allow_module_level


@pytest.mark.parametrize(
    "value,strict",
    [
        ("true", True),
        ("1", True),
        ("TRUE ", True),
        ("yes", True),
        ("false", False),
        ("0", False),
        ("", False),
        ("no", False),
        (None, False),
    ],
)
def test_ci_is_read_as_true_or_false_not_as_set(monkeypatch, value, strict):
    """Under CI=true a missing Slurm or dataset fails its tests; CI=false (set, but false)
    lets them skip, like no CI at all."""
    from conftest import under_ci

    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert under_ci() is strict

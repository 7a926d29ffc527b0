"""Test harness for both `python -m pytest` and `mpirun -n 3 python -m pytest`.

* ``@pytest.mark.mpi(ranks=3)``: runs in-process on COMM_WORLD; skipped unless the suite
  runs under mpirun with at least that many ranks (test_mpi_suite.py launches them under
  plain pytest, so one command covers everything).
* ``@pytest.mark.launcher``: spawns its own ``mpiexec`` (or another subprocess that must run
  once); skipped under mpirun.
* Under mpirun every test has a hard timeout (faulthandler, outside the GIL), so the suite
  never hangs. A failed ``mpi`` test (it uses COMM_WORLD collectively: the other ranks may
  be waiting for the failed one in a collective it left) aborts the world at once. Any other
  failure is a failure of that rank alone: it is reported there, the rest of the suite runs,
  and that rank exits 1 at the end (so does mpiexec). An unmarked test that still used
  COMM_WORLD collectively is ended by the timeout.
"""

from __future__ import annotations

import ast
import contextlib
import faulthandler
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEST_TIMEOUT = float(os.environ.get("MPIPS_TEST_TIMEOUT", "120"))
pytest_plugins = ["shared_runs"]  # fixtures several test files share, made once a session


def _world_size_from_env() -> int:
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 1


WORLD_SIZE = _world_size_from_env()


def under_ci() -> bool:
    """CI=true (or 1, yes): a missing prerequisite (Slurm, a dataset) fails instead of
    skipping. CI=false, CI=0 or no CI: it skips."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def need(module: str):
    """An optional framework (an extra: torch, jax), or a skip; a failure under CI=true,
    which installs the extras. Called at a module's top it skips the whole module."""
    try:
        return __import__(module)
    except ImportError:
        if under_ci():
            pytest.fail(f"{module} is not installed: CI installs .[{module}]")
        pytest.skip(
            f"{module} is not installed (pip install '.[{module}]')", allow_module_level=True
        )


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` (e.g. "64k") mounted at ``path`` (created) for a test of a full
    disk, unmounted afterwards. Mounting needs root: CI runs as root, so there it must work
    (a refusal fails the test); elsewhere a refusal skips it."""
    path.mkdir(exist_ok=True)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        refused = r.stderr.strip() if r.returncode else None
    except OSError as e:
        refused = str(e)
    if refused is not None:
        if under_ci():
            pytest.fail(f"mount -t tmpfs refused in CI (it runs as root): {refused}")
        pytest.skip(f"mount -t tmpfs refused here: {refused}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


def _rank_from_env() -> int:
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        if os.environ.get(var):
            return int(os.environ[var])
    return 0


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    global _CONFIG
    _CONFIG = config
    if WORLD_SIZE > 1 and getattr(config.option, "xmlpath", None):
        config.option.xmlpath += f".rank{_rank_from_env()}"  # one JUnit report per rank
    config.addinivalue_line("markers", "mpi(ranks=3): runs across COMM_WORLD under mpirun")
    config.addinivalue_line(
        "markers",
        "launcher: spawns mpiexec or other subprocesses itself (plain pytest only); "
        "launcher(quick=True): the fast tier's one launch (the modes' suite)",
    )
    config.addinivalue_line(
        "markers", "gpu: needs cupy and a CUDA device (skipped without; benchmarks/gpu_check.sh)"
    )
    config.addinivalue_line(
        "markers",
        "slow: starts a process (every launcher test but the quick one, and every test that "
        'runs a command or a converter); -m "not slow" is the fast tier (in process, and one '
        "quick mpiexec of the modes)",
    )


_COLLECTIVE: set[str] = set()  # node ids of the ``mpi`` tests: they use COMM_WORLD together


def _gpu_missing() -> str:
    """Why the ``gpu`` tests cannot run here ('' when they can)."""
    try:
        import cupy

        return "" if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device"
    except Exception as e:  # not installed, no driver
        return f"no cupy/CUDA here ({type(e).__name__})"


def pytest_collection_modifyitems(config, items):
    gpu_missing = None
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            if gpu_missing is None:
                gpu_missing = _gpu_missing()
            if gpu_missing:
                item.add_marker(pytest.mark.skip(reason=f"gpu: {gpu_missing}"))
        m = item.get_closest_marker("mpi")
        if m is not None:
            _COLLECTIVE.add(item.nodeid)
            need = m.kwargs.get("ranks", 3)
            if WORLD_SIZE < need:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"needs mpirun -n {need} "
                        "(run by test_mpi_suite.py under plain pytest)"
                    )
                )
        launcher = item.get_closest_marker("launcher")
        quick = launcher is not None and launcher.kwargs.get("quick")
        if not quick and (launcher is not None or spawns_a_process(item)):
            item.add_marker(pytest.mark.slow)  # a process of its own: not the fast tier
        if launcher is not None:
            if WORLD_SIZE > 1:
                item.add_marker(pytest.mark.skip(reason="spawns mpiexec; run under plain pytest"))


# what starts a process: conftest's runners, subprocess, a pseudo-terminal's fork
SPAWNERS = frozenset({"run_py", "run_mpi", "run_train", "BackgroundJob", "subprocess", "pty"})
_SPAWNING: dict[str, frozenset[str]] = {}  # module name: its names that start a process


def _uses(module) -> dict[str, set[str]]:
    """Each function of a test module (tests, helpers, fixtures) by name: the names its body
    mentions. The module's file is parsed once."""
    try:
        tree = ast.parse(Path(module.__file__).read_text())
    except (OSError, TypeError, SyntaxError):
        return {}
    return {
        fn.name: {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        | {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _spawning(module) -> frozenset[str]:
    """SPAWNERS and the module's own functions (fixtures included) that reach one of them,
    with each function's uses (cached a module)."""
    if module.__name__ not in _SPAWNING:
        uses = _uses(module)
        found, grew = set(SPAWNERS), True
        while grew:
            more = {name for name, used in uses.items() if name not in found and used & found}
            found, grew = found | more, bool(more)
        _SPAWNING[module.__name__] = frozenset(found)
    return _SPAWNING[module.__name__]


def spawns_a_process(item) -> bool:
    """Whether a test starts a process (``python -m mpips ...``, mpiexec, a converter), by
    itself, through a helper of its module or through a fixture: the fast tier runs in
    process (and the one quick launcher test of the modes)."""
    fn, module = getattr(item, "function", None), getattr(item, "module", None)
    if fn is None or module is None:
        return False
    spawning = _spawning(module)
    return fn.__name__ in spawning or bool(set(item.fixturenames) & spawning)


_REAL_STDERR = None


def _real_stderr():
    """A file on the terminal's stderr, past pytest's fd capture (so a timeout dump is seen)."""
    global _REAL_STDERR
    if _REAL_STDERR is None:
        fd = 2
        capman = _CONFIG.pluginmanager.getplugin("capturemanager") if _CONFIG else None
        saved = getattr(
            getattr(getattr(capman, "_global_capturing", None), "err", None), "targetfd_save", None
        )
        if isinstance(saved, int):
            fd = saved
        _REAL_STDERR = os.fdopen(os.dup(fd), "w")
    return _REAL_STDERR


_CONFIG = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if WORLD_SIZE > 1:
        faulthandler.dump_traceback_later(TEST_TIMEOUT, exit=True, file=_real_stderr())
    yield
    if WORLD_SIZE > 1:
        faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report):
    """Under mpirun, end the job on the failure of a test that uses COMM_WORLD collectively
    (another rank may be waiting for this one); any other failure is this rank's alone."""
    if WORLD_SIZE > 1 and report.failed and report.nodeid in _COLLECTIVE:
        from mpi4py import MPI

        sys.stderr.write(
            f"\n[rank {MPI.COMM_WORLD.rank}] {report.nodeid} failed:\n"
            f"{report.longreprtext}\naborting all ranks\n"
        )
        sys.stderr.flush()
        time.sleep(0.5)  # MPI_Abort tears the launcher's stdio down: let the words out first
        from mpips.process.failure import ABORT, leaving

        leaving(ABORT)  # this rank speaks for itself: the node's watcher names nobody
        MPI.COMM_WORLD.Abort(1)


_SESSION_START = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Jobs the tests kill outright (kill -9, timeouts, scancel) leave MPICH's node segment
    in /dev/shm (an abort does not: mpips removes it). Plain pytest, which launches them,
    removes those made during this session that no process maps: listed first, older than
    10 s, so one a starting job has just made (and maps next) is left alone. (Under mpirun:
    the timeout dumps' stderr is closed.)"""
    global _REAL_STDERR
    if WORLD_SIZE > 1:
        if _REAL_STDERR is not None:
            faulthandler.cancel_dump_traceback_later()
            _REAL_STDERR.close()
            _REAL_STDERR = None
        return
    now = time.time()
    stale = []
    for seg in Path("/dev/shm").glob("mpich_shm_*"):
        with contextlib.suppress(OSError):
            if _SESSION_START <= seg.stat().st_mtime < now - 10:
                stale.append(seg)
    mapped: set[bytes] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):  # a process that ended meanwhile, or not ours
            mapped.update(line.split()[-1] for line in maps.read_bytes().splitlines() if line)
    for seg in stale:
        if os.fsencode(seg) not in mapped:
            with contextlib.suppress(OSError):
                seg.unlink()


def mpiexec_path() -> str:
    """The mpiexec that belongs to this Python's environment (the PyPI MPICH), else PATH's."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment minus any launcher variables (so a child mpiexec starts fresh),
    verbose (MPIPS_VERBOSE=1) unless ``extra`` says otherwise."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("PMI_", "PMIX_", "HYDRA_", "OMPI_", "PRTE_", "MPI_LOCALNRANKS", "MPI_LOCALRANKID")
        )
    }
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("MPIPS_VERBOSE", "1")  # tests read the detail lines (each rank's pid...)
    env.update(extra)
    return env


FAKE_SSH = ROOT / "tests" / "fake_ssh"  # a stand-in for ssh: "nodes" on this machine


def launch_args(n: int, nodes: Sequence[int] | None = None) -> list[str]:
    """mpiexec's arguments for N ranks: on this node (``nodes`` None), or on ``len(nodes)``
    nodes of ``nodes[i]`` ranks each, all on this machine. MPICH takes which ranks share a
    node from the hosts its launcher starts them on: the ssh launcher through FAKE_SSH (which
    runs the command here) makes each host a node of its own (node-shared memory inside it,
    TCP on loopback between them), so the job's multi-node code paths run for real."""
    if nodes is None:
        return ["-n", str(n)]
    assert sum(nodes) == n, f"{n} ranks, but nodes = {nodes}"
    hosts = ",".join(f"node{i}:{k}" for i, k in enumerate(nodes))
    return ["-hosts", hosts, "-launcher", "ssh", "-launcher-exec", str(FAKE_SSH), "-n", str(n)]


def run_mpi(
    n: int,
    args: list[str],
    cwd: Path,
    timeout: float = 90,
    nodes: Sequence[int] | None = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """``mpiexec -n N python ARGS`` with a hard timeout; output captured as text. A job that
    hangs is ended with its ranks (stop_launcher), and the test fails with its output.
    ``nodes``: ranks per node, e.g. (2, 2): two nodes on this machine (launch_args)."""
    cmd = [mpiexec_path(), *launch_args(n, nodes), sys.executable, *args]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=clean_env(**env),
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
        pytest.fail(
            f"mpiexec {' '.join(launch_args(n, nodes))} {' '.join(args)} hung for {timeout} s"
            f"\nstdout:\n{out}\nstderr:\n{err}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def stop_launcher(proc: subprocess.Popen) -> None:
    """End a background mpiexec and its ranks: SIGTERM (the launcher passes it on and cleans
    up), then SIGKILL if it is still there after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_py(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python ARGS`` as a plain process (no MPI launcher)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


RESULT = "result.json"  # where run_train has ``train --result`` write the run's result


def read_result(cwd: Path) -> dict | None:
    """The run's result in ``cwd`` as ``train --result result.json`` (or a script, from
    ``TrainResult.to_json()``) wrote it: the chief's view; None if none was written."""
    path = Path(cwd) / RESULT
    return json.loads(path.read_text()) if path.exists() else None


def run_train(
    cwd: Path,
    n: int | None,
    *args: str,
    timeout: float = 90,
    nodes: Sequence[int] | None = None,
    **env: str,
) -> subprocess.CompletedProcess:
    """``python -m mpips train --no-progress --result result.json ARGS`` in ``cwd``, under
    ``mpiexec -n N`` (N None: one plain process; ``nodes``: ranks per node, as run_mpi), the
    run's result read into ``.result`` (None if the run wrote none: it failed). A result
    left by an earlier run is removed."""
    (Path(cwd) / RESULT).unlink(missing_ok=True)
    argv = ["-m", "mpips", "train", "--no-progress", "--result", RESULT, *args]
    if n is None:
        assert not env, "run_py takes no environment"
        r = run_py(argv, cwd, timeout)
    else:
        r = run_mpi(n, argv, cwd, timeout, nodes, **env)
    r.result = read_result(cwd)
    return r


class BackgroundJob:
    """``python -m mpips train`` run in the background under mpiexec, its output in a file:
    wait for log lines, find a task's pid, signal it, and always stop the launcher.
    ``nodes``: ranks per node, as run_mpi; ``wrap``: a command mpiexec runs under
    (``("timeout", "60")``)."""

    def __init__(
        self,
        tmp_path: Path,
        ranks: int,
        *args: str,
        nodes: Sequence[int] | None = None,
        wrap: Sequence[str] = (),
    ):
        self.log = tmp_path / "out.log"
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(
            [
                *wrap,
                mpiexec_path(),
                *launch_args(ranks, nodes),
                sys.executable,
                "-m",
                "mpips",
                "train",
                "--no-progress",
                "--log-every",
                "0",
                *args,
            ],
            cwd=tmp_path,
            env=clean_env(),
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match:
        """The first match of ``pattern`` in the output; the test fails (and the job is
        stopped) if none comes within ``timeout`` s or the job ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        stop_launcher(self.proc)
        pytest.fail(f"no {pattern!r} within {timeout} s:\n{self.text()[-3000:]}")

    def pid_of(self, task: str) -> int:
        return self.rank_and_pid(task)[1]

    def rank_and_pid(self, task: str) -> tuple[int, int]:
        """A task's rank and pid, from its start-up line (a detail: the job runs verbose)."""
        m = self.wait_for(rf"\[{re.escape(task)}\] rank (\d+), pid (\d+) on ")
        return int(m.group(1)), int(m.group(2))

    def end(self, timeout: float = 60) -> int:
        """The launcher's exit code, once it ends (within ``timeout`` s)."""
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            stop_launcher(self.proc)
            self._out.close()


def dense_data_file(path: Path, train: int = 60, test: int = 10, **over) -> str:
    """A small valid dense data file (uint8 features, 3 classes); ``over`` replaces any of
    its datasets by name (e.g. ``**{"train/y": ...}``) to make it broken."""
    import h5py
    import numpy as np

    rng = np.random.default_rng(0)
    parts = {
        "train/x": rng.integers(0, 255, (train, 4), dtype=np.uint8),
        "train/y": rng.integers(0, 3, train),
        "test/x": rng.integers(0, 255, (test, 4), dtype=np.uint8),
        "test/y": rng.integers(0, 3, test),
    }
    parts.update(over)
    with h5py.File(path, "w") as f:
        for k, v in parts.items():
            f[k] = v
        f.attrs["num_classes"] = 3
    return str(path)


def streams(job, workers: int, steps: int, sync: bool):
    """The batches each of ``workers`` workers of ``job`` (on the built-in digits) trains on,
    step by step, as mpips makes them: ([x of each worker], [y of each worker]) a step.
    ``sync``: every worker makes the same full batches an epoch (sync replicas)."""
    from mpips.data.batches import (
        batches,
        full_batches,
        load_split,
        open_dataset,
        resolve_path,
        worker_rows,
    )

    info = open_dataset(resolve_path("", "digits"))
    b, rows = job.train.batch_size, info.rows["train"]
    per = full_batches(rows, workers, b) if sync else None
    its = [
        batches(
            *load_split(info, "train", worker_rows(rows, workers, k)),
            b,
            job.train.seed,
            k,
            per_epoch=per,
        )
        for k in range(workers)
    ]
    for _ in range(steps):
        parts = [next(it) for it in its]
        yield [p[1] for p in parts], [p[2] for p in parts]

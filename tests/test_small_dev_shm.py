"""A node's /dev/shm too small for the PS windows (a container's default is 64 MB): MPICH puts
every window of a node with several ranks there, and a rank that touches such memory past
its end dies of SIGBUS. Copied pulls then keep the PS memory in private memory (slower, and
said); zero copy, which needs shared memory, is refused at start-up in one line; async's
default says why it copies. The jobs run in a mount namespace of their own (``unshare -m``)
over a 64 MB tmpfs at /dev/shm, of which MPICH takes about 16 MB for itself."""

import shutil
import subprocess
import sys

import pytest
from conftest import clean_env, mpiexec_path, run_mpi, under_ci

from mpips.process.memory import SHM_SPARE
from mpips.store.window import plan_memory

MB = 1 << 20
SMALL_SHM = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
JOB = """
[model]
kind = "mlp"
hidden = [{hidden}, {hidden}]
[data]
builtin = "digits"
[train]
steps = 4
batch_size = 8
{train}
[optimizer]
kind = "{optimizer}"
[layout]
ps = 1
"""


def small_shm_train(tmp_path, hidden, train="", optimizer="sgd"):
    """``train`` of JOB on 3 ranks (1 PS, 2 workers) under a 64 MB /dev/shm of their own."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", SMALL_SHM, "sh", "true"], text=True, capture_output=True
    )
    if probe.returncode:
        if under_ci():
            pytest.fail(f"cannot mount a small /dev/shm in CI (it runs as root): {probe.stderr}")
        pytest.skip(f"cannot mount a small /dev/shm here: {probe.stderr[-200:]!r}")
    (tmp_path / "job.toml").write_text(JOB.format(hidden=hidden, train=train, optimizer=optimizer))
    cmd = ["unshare", "-m", "sh", "-c", SMALL_SHM, "sh", mpiexec_path(), "-n", "3"]
    return subprocess.run(
        [*cmd, sys.executable, "-m", "mpips", "train", "--no-progress", "job.toml"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_plan_memory_moves_copied_pulls_out_and_refuses_what_must_be_shared():
    """Per node ``[must, movable, free]``: private memory where everything does not fit with
    a quarter to spare (any node: the windows are one collective), refused where what must be
    shared does not, naming both figures and the remedy."""
    assert plan_memory([[MB, 40 * MB, 100 * MB]], False) == (False, "")
    # fits, but not with a quarter to spare: private
    assert plan_memory([[MB, 40 * MB, int(41 * MB * SHM_SPARE) - 1]], False) == (True, "")
    assert plan_memory([[0, 0, 100], [MB, 40 * MB, 48 * MB]], False) == (True, "")
    private, error = plan_memory([[68 * MB, 0, 48 * MB]], True)  # zero copy: in place
    assert error.startswith("train.zero_copy:"), error
    for said in ("48.0 MiB free", "68.0 MiB", "train.zero_copy = false", "docker run --shm-size"):
        assert said in error, error
    _, error = plan_memory([[MB, 40 * MB, MB]], False)
    assert "1.0 MiB free" in error and "docker run --shm-size" in error, error


PRIVATE = """
import sys
import time
import numpy as np
from mpi4py import MPI
from mpips.placement.layout import make_layout
from mpips.placement.table import round_robin
from mpips.store import Cluster, StoreClient, Windows, barrier
from mpips.models.variables import VariableSpec

comm = MPI.COMM_WORLD
cluster = Cluster(comm, make_layout(comm.size, 1))
specs = [VariableSpec("a", (1000,)), VariableSpec("b", (1 << 18,)), VariableSpec("c", (5,), "f8")]
placement = round_robin(specs, 1)
roomy = Windows(comm, cluster.layout, placement)  # /dev/shm has room here: MPI's memory
sys.stdout.write(f"default private {roomy.private}\\n")  # (one write: no splicing)
sys.stdout.flush()
roomy.free()
windows = Windows(comm, cluster.layout, placement, private=True)
client = StoreClient(windows, cluster.role.task)
init = {s.name: np.full(s.shape, 0.5, s.dtype) for s in specs}
if cluster.is_chief:
    client.initialise(init)
    client.control.raise_ready()
client.control.wait_ready(60)
if cluster.is_ps:  # no MPI call until the end, as a PS waits for the ready flag or serves
    deadline = time.monotonic() + 60
    while not client.control.run_ended():
        assert time.monotonic() < deadline, "the run never ended"
        time.sleep(0.01)
else:
    for g in client.grads.values():
        g[...] = 1
    for _ in range(20):
        client.push(lr=-1.0)
    barrier(cluster.workers, "the pushes")
    for name, value in client.pull().items():
        assert (value == 0.5 + 2 * 20).all(), name
    barrier(cluster.workers, "the pulls")
    if cluster.is_chief:
        client.control.end_run()
barrier(comm, "the end")
windows.free()
sys.stdout.write(f"ok {cluster.role}\\n")
sys.stdout.flush()
cluster.free()
"""


@pytest.mark.launcher
def test_private_windows_serve_pulls_and_pushes_while_the_ps_makes_no_mpi_call(tmp_path):
    """The parameter window in the PS's private memory (Alloc_mem, Win.Create): the chief's
    initial values, every worker's pushes and the pulls all land, while the PS waits in
    shared memory without an MPI call (its progress thread moves them); with room in
    /dev/shm the windows stay MPI's."""
    (tmp_path / "private.py").write_text(PRIVATE)
    r = run_mpi(3, ["private.py"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert r.stdout.count("default private False") == 3, r.stdout
    assert r.stdout.count("ok /job:") == 3, r.stdout


@pytest.mark.launcher
def test_async_under_a_small_dev_shm_copies_from_private_memory_and_says_why(tmp_path):
    """A 44 MB model with Momentum (88 MB of variables and slots, and an inbox per worker)
    where /dev/shm has about 48 MB free: async's default turns to copied pulls (a detail line
    says why, once), the PS memory goes to private memory (the chief says so, once) and the
    run trains, with no rank killed by SIGBUS."""
    r = small_shm_train(tmp_path, 3264, optimizer="momentum")
    out = r.stdout + r.stderr
    assert r.returncode == 0, (r.returncode, out[-3000:])
    assert out.count("async: /dev/shm has") == 1, out[-3000:]
    assert "copied pulls instead" in out, out[-3000:]
    assert out.count("private memory instead") == 1, out[-3000:]
    assert "final: global_step 4" in out, out[-3000:]


@pytest.mark.launcher
def test_zero_copy_without_room_in_dev_shm_is_refused_in_one_line(tmp_path):
    """train.zero_copy = true reads the PS memory in place, which must be MPI shared memory:
    with a 68 MB model (65.2 MiB) and about 48 MB free, the job stops at start-up, exit 2,
    in one line naming /dev/shm's free bytes, the bytes needed and the remedies (it was a
    SIGBUS)."""
    r = small_shm_train(tmp_path, 4096, train="zero_copy = true")
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = [line for line in r.stderr.splitlines() if line.startswith("mpips: error:")]
    assert len(lines) == 1, r.stderr[-2000:]
    for said in ("/dev/shm", "(65.2 MiB and a quarter", "MiB free", "zero_copy = false", "--shm"):
        assert said in lines[0], lines[0]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]

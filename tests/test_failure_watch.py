"""The node's watcher (mpips/process/failure.py) names a rank that died without a word, and nobody
when the launcher ends the ranks itself. (kill -9 in a real job: test_train_mpi.py.)"""

import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import clean_env, run_mpi

from mpips.process import failure

pytestmark = pytest.mark.launcher

ABORTS = """
import os, time
from mpi4py import MPI
from mpips.store import Cluster
from mpips.placement.layout import Layout
comm = MPI.COMM_WORLD
cluster = Cluster(comm, Layout(comm.size, (0,)))
comm.Barrier()
if comm.rank == 2:
    time.sleep(0.5)
    comm.Abort(5)  # not through mpips: the watcher is not told
time.sleep(30)
"""


def test_a_raw_mpi_abort_is_not_taken_for_a_death(tmp_path):
    """MPI_Abort makes the launcher SIGKILL the other ranks: every rank of the node is being
    ended, so the watcher names nobody (the aborting rank said why)."""
    (tmp_path / "aborts.py").write_text(ABORTS)
    r = run_mpi(4, ["aborts.py"], cwd=tmp_path, timeout=60)
    assert r.returncode == 5, (r.returncode, r.stderr[-3000:])
    assert "died without a word" not in r.stderr, r.stderr[-3000:]


FAKE_RANK = """
import signal, sys, time
from mpips.process import failure
pid, token, rank, ended = map(int, sys.argv[1:5])
if ended:  # a SIGTERM sent to it stays pending: as if the launcher were ending it
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
failure.join_watcher(pid, token, rank, f"/job:worker/task:{rank}")
print("joined", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("ended", [False, True], ids=["alone", "with_the_others"])
def test_the_watcher_names_a_death_only_while_another_rank_is_untouched(ended):
    """Two ranks of a node (plain processes: the watcher needs no MPI). Rank 0 is killed:
    named if rank 1 is alive and untouched; not if a signal is on its way to rank 1 too
    (the launcher's teardown marks every rank before the first is gone)."""
    pid, token = failure.start_watcher()
    assert pid, "the watcher did not start"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", FAKE_RANK, str(pid), str(token), str(rank), str(int(ended))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
        for rank in range(2)
    ]
    try:
        for p in ranks:
            assert p.stdout.readline() == "joined\n"
        if ended:
            os.kill(ranks[1].pid, signal.SIGTERM)
        os.kill(ranks[0].pid, signal.SIGKILL)
        _, said = ranks[0].communicate(timeout=30)  # its stderr ends when the watcher lets go
    finally:
        for p in ranks:
            p.kill()
            p.communicate()
    named = f"mpips: rank 0 (/job:worker/task:0, pid {ranks[0].pid} on {socket.gethostname()}) "
    assert (named + "died without a word" in said) != ended, said


RAISES_EVERYWHERE = """
import numpy as np
import mpips


class Broken(mpips.Model):
    def variables(self):
        return [mpips.Variable("w", (64, 10))]

    def initial_values(self, seed):
        return {"w": np.zeros((64, 10), np.float32)}

    def loss_and_grads(self, params, x, y, grads, ready=None):
        raise ValueError("a bug in the model")

    def evaluate(self, params, x, y):
        return {"loss": 0.0}


def build(data, **_):
    return Broken()
"""


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_same_bug_on_every_worker_prints_one_traceback(tmp_path, mode):
    """A model that raises on every worker at once (the commonest bug): the node prints one
    traceback, and every worker one line naming its rank and the error, each line whole."""
    (tmp_path / "broken.py").write_text(RAISES_EVERYWHERE)
    (tmp_path / "job.toml").write_text(
        f'[model]\nkind = "broken:build"\n[data]\nbuiltin = "digits"\n[train]\n'
        f'mode = "{mode}"\nsteps = 20\nprogress = false\n[checkpoint]\ndir = ""\n'
    )
    r = run_mpi(6, ["-m", "mpips", "train", "job.toml"], cwd=tmp_path, timeout=90)
    assert r.returncode != 0
    assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "failed with ValueError: a bug" in ln]
    workers = 5 if mode == "async" else 6  # (async: 1 PS task)
    assert 1 <= len(lines) <= workers, r.stderr
    for line in lines:  # one message a line: none runs into the next rank's
        assert line.startswith("mpips: rank ") and line.count("mpips:") == 1, line

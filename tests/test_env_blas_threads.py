"""A thread count the user set in the environment wins (issue 43, item 2): mpips gives each
rank its share of the node's cores, but a BLAS (or OpenMP) library whose own variable the
user set (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, MKL_NUM_THREADS, ...) keeps that count.
Before, the one-process debug run overrode ``OPENBLAS_NUM_THREADS=1`` with every core and ran
35x slower on a busy machine. MPIPS_BLAS_THREADS, mpips' own knob, still wins over both."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env

from mpips.device import threads


@pytest.fixture
def blas():
    """threadpoolctl's BLAS libraries, their thread counts put back afterwards."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    info = threadpoolctl.threadpool_info()
    if not any(i["user_api"] == "blas" for i in info):
        pytest.skip("no BLAS library that threadpoolctl can limit")
    before = {i["user_api"]: i["num_threads"] for i in info}
    yield threadpoolctl
    threadpoolctl.threadpool_limits(limits=before)


def blas_threads(threadpoolctl) -> dict[str, int]:
    return {
        i["internal_api"]: i["num_threads"]
        for i in threadpoolctl.threadpool_info()
        if i["user_api"] == "blas"
    }


THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
OTHERS = ("MKL_NUM_THREADS", "BLIS_NUM_THREADS", "FLEXIBLAS_NUM_THREADS", "MPIPS_BLAS_THREADS")


@pytest.mark.parametrize("variable", ["OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"])
def test_the_users_count_is_left_in_place(monkeypatch, blas, variable):
    """The library read the user's variable when it loaded (here: set to 1 by hand, as it
    would have); mpips' share (4 of 4 cores for one process) must not replace it."""
    apis = blas_threads(blas)
    if "openblas" not in apis:
        pytest.skip("the variables checked here are OpenBLAS's")
    for name in THREAD_VARIABLES + OTHERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "cpu_count", lambda: 4)
    monkeypatch.setenv(variable, "1")
    blas.threadpool_limits(limits=1)  # what OpenBLAS took from the variable at load
    threads.pin_blas_threads(1, ps_on_node=0, local_worker=0)
    assert blas_threads(blas)["openblas"] == 1


def test_the_share_applies_where_the_user_set_nothing_for_that_library(monkeypatch, blas):
    """MKL_NUM_THREADS is MKL's: OpenBLAS still gets the rank's share; MPIPS_BLAS_THREADS
    wins over the user's OpenBLAS count (it is mpips' own, more specific knob)."""
    if "openblas" not in blas_threads(blas):
        pytest.skip("the variables checked here are OpenBLAS's")
    for name in THREAD_VARIABLES + OTHERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "cpu_count", lambda: 4)
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    blas.threadpool_limits(limits=1)
    assert threads.pin_blas_threads(1, ps_on_node=0, local_worker=0) == 4
    assert blas_threads(blas)["openblas"] == 4
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "1")
    monkeypatch.setenv("MPIPS_BLAS_THREADS", "3")
    assert threads.pin_blas_threads(1, ps_on_node=0, local_worker=0) == 3
    assert blas_threads(blas)["openblas"] == 3


PROBE = """
import json

from threadpoolctl import threadpool_info

import my_model


class Probe(my_model.Softmax):
    said = False

    def loss_and_grads(self, params, x, y, grads, ready=None):
        if not self.said:  # the first step: the threads the step's matrix products use
            self.said = True
            with open("threads.json", "w") as f:
                apis = {i["internal_api"]: i["num_threads"] for i in threadpool_info()}
                json.dump(apis, f)
        return super().loss_and_grads(params, x, y, grads, ready)


def build(data, l2=0.0):
    return Probe(data.num_inputs, data.num_classes, l2)
"""
JOB = """
[model]
kind = "probe:build"
[data]
builtin = "digits"
[optimizer]
learning_rate = 0.5
[train]
steps = 5
progress = false
[checkpoint]
dir = ""
"""


def one_process_threads(tmp_path, **env: str) -> dict[str, int]:
    """The BLAS threads the first step of ``python -m mpips train`` (one process) ran with,
    ``env`` set for it (and none of the thread variables but those)."""
    shutil.copy(ROOT / "jobs/my_model.py", tmp_path / "my_model.py")
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "job.toml").write_text(JOB)
    (tmp_path / "threads.json").unlink(missing_ok=True)
    full = clean_env(**env)
    for name in THREAD_VARIABLES + OTHERS:
        if name not in env:
            full.pop(name, None)
    r = subprocess.run(
        [sys.executable, "-m", "mpips", "train", "job.toml"],
        cwd=tmp_path,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((tmp_path / "threads.json").read_text())


@pytest.mark.launcher
def test_the_one_process_run_keeps_the_users_thread_count(tmp_path):
    """The issue's case, end to end: ``OPENBLAS_NUM_THREADS=1 python -m mpips train JOB``
    computes with 1 BLAS thread (mpips' share for one process is every core: 2 or more
    here, so the old code's override shows); ``OMP_NUM_THREADS=1`` likewise."""
    if threads.cpu_count() < 2:
        pytest.skip("one core: the share is 1 thread as well, nothing to tell apart")
    mine = one_process_threads(tmp_path)
    if "openblas" not in mine:
        pytest.skip("the variables checked here are OpenBLAS's")
    assert mine["openblas"] > 1  # the share: every core
    assert one_process_threads(tmp_path, OPENBLAS_NUM_THREADS="1")["openblas"] == 1
    assert one_process_threads(tmp_path, OMP_NUM_THREADS="1")["openblas"] == 1
    both = one_process_threads(tmp_path, OPENBLAS_NUM_THREADS="1", MPIPS_BLAS_THREADS="2")
    assert both["openblas"] == 2

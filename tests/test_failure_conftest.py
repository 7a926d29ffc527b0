"""The suite's own harness under ``mpiexec -n 3 python -m pytest`` (tests/conftest.py): a test
that fails on one rank without using MPI is reported there and the rest of the suite still
runs (that rank exits 1); only a failed ``mpi`` test, which may leave the other ranks waiting
in a collective, ends the job, at once."""

import shutil
import xml.etree.ElementTree as ET

import pytest
from conftest import ROOT, run_mpi

pytestmark = pytest.mark.launcher

SESSION = """
import pytest
from mpi4py import MPI

def test_a_local_failure():
    assert MPI.COMM_WORLD.rank != 1, "fails on rank 1 alone, no MPI call"

@pytest.mark.mpi(ranks=3)
def test_a_collective_after_it():
    assert MPI.COMM_WORLD.allreduce(1) == 3

@pytest.mark.mpi(ranks=3)
def test_a_collective_that_fails_on_one_rank():
    if {fail} and MPI.COMM_WORLD.rank == 1:
        assert False, "rank 1 leaves; the others wait for it in the allreduce"
    assert MPI.COMM_WORLD.allreduce(1) == 3

def test_the_last():
    pass
"""


def outcomes(report, rank):
    """{test name: 'passed' | 'failed' | 'skipped'} from a rank's JUnit report."""
    out = {}
    for case in ET.parse(f"{report}.rank{rank}").getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        out[case.get("name")] = "failed" if failed else "skipped" if skipped else "passed"
    return out


def session(tmp_path, fail):
    shutil.copy(ROOT / "tests/conftest.py", tmp_path / "conftest.py")
    shutil.copy(ROOT / "tests/shared_runs.py", tmp_path / "shared_runs.py")  # its plugin
    (tmp_path / "test_session.py").write_text(SESSION.format(fail=fail))
    report = tmp_path / "junit.xml"
    r = run_mpi(
        3,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_session.py", f"--junitxml={report}"],
        cwd=tmp_path,
        timeout=120,
        MPIPS_TEST_TIMEOUT="60",
    )
    return r, report


def test_a_failure_on_one_rank_alone_lets_the_suite_run_on(tmp_path):
    r, report = session(tmp_path, fail=False)
    assert r.returncode == 1, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    assert "aborting all ranks" not in r.stderr, r.stderr[-3000:]
    every = {
        "test_a_local_failure": "passed",
        "test_a_collective_after_it": "passed",
        "test_a_collective_that_fails_on_one_rank": "passed",
        "test_the_last": "passed",
    }
    assert outcomes(report, 0) == every == outcomes(report, 2)
    assert outcomes(report, 1) == {**every, "test_a_local_failure": "failed"}


def test_a_failed_collective_test_ends_the_job_at_once(tmp_path):
    r, report = session(tmp_path, fail=True)
    assert r.returncode != 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "test_a_collective_that_fails_on_one_rank failed:" in r.stderr, r.stderr[-3000:]
    assert "rank 1 leaves" in r.stderr and "aborting all ranks" in r.stderr, r.stderr[-3000:]
    assert "Timeout" not in r.stderr, r.stderr[-3000:]  # the abort, not the per-test deadline
    assert "test_the_last" not in r.stdout

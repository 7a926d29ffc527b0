"""Runs the in-process multi-rank tests (test_store_mpi.py) under mpiexec -n 3."""
import pytest
from conftest import ROOT, run_mpi


@pytest.mark.launcher
def test_store_contracts_under_mpiexec():
    r = run_mpi(3, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_store_mpi.py"],
                cwd=ROOT, timeout=180, MPIPS_TEST_TIMEOUT="60")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "9 passed" in r.stdout, r.stdout[-2000:]

"""Runs the in-process multi-rank tests (test_store_mpi.py: the store's contracts;
test_modes_mpi.py: each mode trained in process) under mpiexec at two layouts (1 PS + 2
workers on 3 ranks, 2 PS + 2 workers on 4; the modes on 3), and checks from each rank's JUnit
XML report that every collected test ran and passed there."""

import ast
import xml.etree.ElementTree as ET

import pytest
from conftest import ROOT, run_mpi

STORE, MODES = "tests/test_store_mpi.py", "tests/test_modes_mpi.py"


@pytest.mark.launcher
@pytest.mark.parametrize("ranks,ps", [(3, ""), (4, "2")], ids=str)
def test_the_store_suite_under_mpiexec(tmp_path, ranks, ps):
    run_suite(tmp_path, ranks, ps, STORE)


@pytest.mark.launcher(quick=True)
def test_the_modes_suite_under_mpiexec(tmp_path):
    """Quick (about 15 s): the fast tier trains every mode in process through it."""
    run_suite(tmp_path, 3, "", MODES)


def count_tests(path) -> int:
    """The test functions a file defines (each collected once or more: parameters)."""
    tree = ast.parse(path.read_text())
    return sum(isinstance(n, ast.FunctionDef) and n.name.startswith("test_") for n in tree.body)


def run_suite(tmp_path, ranks: int, ps: str, suite: str) -> None:
    least = count_tests(ROOT / suite)
    assert least >= 4, suite
    report = tmp_path / "junit.xml"
    r = run_mpi(
        ranks,
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", suite, f"--junitxml={report}"],
        cwd=ROOT,
        timeout=240,
        MPIPS_TEST_TIMEOUT="60",
        MPIPS_TEST_PS=ps,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for rank in range(ranks):  # conftest gives each rank its own report
        suite = ET.parse(f"{report}.rank{rank}").getroot().find("testsuite")
        counts = {k: int(suite.get(k)) for k in ("tests", "failures", "errors", "skipped")}
        ran = counts.pop("tests")  # every test of the file ran there and passed
        assert ran >= least and counts == {"failures": 0, "errors": 0, "skipped": 0}, (
            rank,
            ran,
            counts,
        )

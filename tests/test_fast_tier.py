"""The fast tier (``python -m pytest -m "not slow"``) runs in process: conftest.py marks
``slow`` every test that starts a process, by itself, through a helper of its module or
through a fixture, and every launcher test but the quick one."""

import types

import conftest
import test_hostile_cli
import test_mpi_suite

SOURCE = """
import subprocess
import pytest
from conftest import run_py

def helper(args):
    return run_py(args, cwd=".")

def indirect():
    return helper(["-m", "mpips"])

@pytest.fixture
def trained(tmp_path):
    return indirect()

def test_in_process():
    assert 1 + 1 == 2

def test_through_a_helper():
    indirect()

def test_through_a_fixture(trained):
    assert trained

def test_subprocess_itself():
    subprocess.run(["true"])
"""


class Item:
    """What spawns_a_process reads of a collected test."""

    def __init__(self, module, name: str, fixtures: tuple[str, ...] = ()):
        self.module, self.function, self.fixturenames = module, getattr(module, name), fixtures


def test_a_process_started_anyhow_makes_a_test_slow(tmp_path):
    path = tmp_path / "test_sample.py"
    path.write_text(SOURCE)
    module = types.ModuleType("test_sample_spawning")
    module.__file__ = str(path)
    exec(
        compile(
            "def test_in_process(): pass\ndef test_through_a_helper(): pass\n"
            "def test_through_a_fixture(trained): pass\ndef test_subprocess_itself(): pass\n",
            str(path),
            "exec",
        ),
        module.__dict__,
    )
    spawns = {
        name: conftest.spawns_a_process(Item(module, name, fixtures))
        for name, fixtures in (
            ("test_in_process", ()),
            ("test_through_a_helper", ()),
            ("test_through_a_fixture", ("trained", "tmp_path")),
            ("test_subprocess_itself", ()),
        )
    }
    assert spawns == {
        "test_in_process": False,
        "test_through_a_helper": True,
        "test_through_a_fixture": True,
        "test_subprocess_itself": True,
    }


def test_the_repositorys_own_tests_are_told_apart():
    spawning = conftest._spawning(test_hostile_cli)
    assert "test_layout_refuses_nodes_that_run_no_rank" in spawning  # run_py
    assert "test_predict_refuses_no_rows_and_values_that_are_not_finite" in spawning  # fixture
    assert "test_roles_are_as_before" not in spawning  # in process
    assert "run_suite" in conftest._spawning(test_mpi_suite)

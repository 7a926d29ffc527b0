"""Fixtures that several test files share, made once a session (conftest registers this
module as a plugin): what is costly to make and only read afterwards, such as a converted
dataset. A test copies what it changes into its own directory."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import run_py, under_ci

FASHION = "/usr/share/datasets/fashion-mnist"  # apt-get install dataset-fashion-mnist


@pytest.fixture(scope="session")
def fashion_mnist(tmp_path_factory) -> Path:
    """Fashion-MNIST converted once, as a user converts it (`python -m mpips data
    fashion-mnist data/fashion_mnist.h5`): 3-4 s of the converter a test saved. Missing
    data skips, and fails under CI=true."""
    if not os.path.isdir(FASHION):
        if under_ci():
            pytest.fail(f"{FASHION} missing: .ci/run must apt-get install dataset-fashion-mnist")
        pytest.skip("apt-get install dataset-fashion-mnist")
    d = tmp_path_factory.mktemp("fashion_mnist")
    r = run_py(["-m", "mpips", "data", "fashion-mnist", "data/fashion_mnist.h5"], d, timeout=120)
    assert r.returncode == 0, r.stderr
    return d / "data/fashion_mnist.h5"


def place_fashion_mnist(converted: Path, cwd: Path) -> None:
    """Put a copy of the converted file where the shipped jobs read it (data/, relative to
    the working directory), so a run cannot change the session's file."""
    (cwd / "data").mkdir(exist_ok=True)
    shutil.copyfile(converted, cwd / "data/fashion_mnist.h5")


# A script that trains the jobs ``NAME.toml`` named on its command line one after another in
# one launch (each into its own checkpoint directory; the chief writes each run's result to
# ``NAME.json``), saying ``in turn: NAME`` before each: for cases that prove one thing, a
# launch's start-up (most of a small job's time) is paid once, not once a case. Launch it
# with run_in_turn, from a module fixture that calls run_mpi itself (so that conftest marks
# its tests slow).
JOBS_IN_TURN = """
import json, sys
import mpips
with mpips.abort_on_error():
    for name in sys.argv[1:]:
        print(f"in turn: {name}", flush=True)
        result = mpips.train(mpips.load_job(f"{name}.toml"))
        if result.role.is_chief:
            with open(f"{name}.json", "w") as f:
                json.dump(result.to_json(), f)
"""


@dataclass
class Case:
    """One case of a shared launch: the launch that ran it (or failed in it) and whether
    that launch failed in this case."""

    name: str
    cwd: Path
    launch: subprocess.CompletedProcess
    failed_here: bool = False

    def result(self) -> dict:
        """The case's run result (``NAME.json``). A case its launch failed in, or that wrote
        none, fails here, alone and by name, with the launch's exit code and output."""
        out = self.cwd / f"{self.name}.json"
        r = self.launch
        begun = re.findall(r"^in turn: (.+)$", r.stdout + r.stderr, re.M)  # (a hang: stderr)
        assert out.exists() and not self.failed_here, (
            f"case {self.name}: the shared launch exited {r.returncode} "
            f"{'after writing' if out.exists() else 'without'} {out.name} "
            f"(last case begun: {begun[-1] if begun else 'none'})"
            f"\nstdout:\n{r.stdout[-2000:]}\nstderr:\n{r.stderr[-3000:]}"
        )
        return json.loads(out.read_text())


def run_in_turn(
    cwd: Path, names: list[str], launch: Callable[[list[str]], subprocess.CompletedProcess]
) -> dict[str, Case]:
    """Each of ``names`` trained by JOBS_IN_TURN (written to ``cwd/in_turn.py``), where
    ``launch(todo)`` runs ``in_turn.py *todo`` under run_mpi. A launch that fails is made
    again for the cases after the one it failed in (the first without its NAME.json; the
    last if each wrote one), so a broken case fails alone. A launch that hangs (run_mpi's
    timeout) is not: the cases it never reached fail with it rather than wait again."""
    (cwd / "in_turn.py").write_text(JOBS_IN_TURN)
    cases: dict[str, Case] = {}
    todo = list(names)
    while todo:
        try:
            r = launch(todo)
        except pytest.fail.Exception as hung:  # run_mpi ended the hung job
            r, hang = subprocess.CompletedProcess(todo, -1, "", str(hung)), True
        else:
            hang = False
        cases.update({n: Case(n, cwd, r) for n in todo})
        if r.returncode == 0:
            break
        missing = [n for n in todo if not (cwd / f"{n}.json").exists()]
        broken = missing[0] if missing else todo[-1]
        cases[broken].failed_here = True
        todo = [] if hang else todo[todo.index(broken) + 1 :]
    return cases

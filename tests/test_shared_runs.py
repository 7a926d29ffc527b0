"""The shared launches' runner (shared_runs.run_in_turn), in process with a stand-in launch:
a case that breaks fails alone and by name, the cases after it run in a launch of their
own, and a hang is not launched again."""

import re
from subprocess import CompletedProcess

import pytest
from shared_runs import run_in_turn


def launcher(cwd, breaks="", hangs=""):
    """A stand-in for run_mpi on JOBS_IN_TURN: says each case, writes its NAME.json, fails
    (exit 1) in case ``breaks`` or hangs (run_mpi's pytest.fail) in case ``hangs``; the
    list of launches it made."""
    launches = []

    def launch(todo):
        launches.append(list(todo))
        said = ""
        for name in todo:
            said += f"in turn: {name}\n"
            if name == hangs:
                pytest.fail(f"mpiexec hung for 90 s\nstdout:\n{said}\nstderr:\n")
            if name == breaks:
                return CompletedProcess(todo, 1, said, f"{name}: Traceback ... boom")
            (cwd / f"{name}.json").write_text('{"global_step": 20}')
        return CompletedProcess(todo, 0, said, "")

    return launch, launches


def failure(case) -> str:
    with pytest.raises(AssertionError) as e:
        case.result()
    return str(e.value)


def test_a_broken_case_fails_alone_and_the_cases_after_it_run_anew(tmp_path):
    launch, launches = launcher(tmp_path, breaks="b")
    cases = run_in_turn(tmp_path, ["a", "b", "c"], launch)
    assert launches == [["a", "b", "c"], ["c"]]
    assert (tmp_path / "in_turn.py").exists()
    assert cases["a"].result() == cases["c"].result() == {"global_step": 20}
    said = failure(cases["b"])
    assert re.match(r"case b: the shared launch exited 1 without b\.json", said), said
    assert "(last case begun: b)" in said and "b: Traceback ... boom" in said


def test_a_launch_that_fails_after_its_last_case_fails_that_case(tmp_path):
    """Every case wrote its result, but the launch exited 1 (say, in its teardown)."""
    launch, launches = launcher(tmp_path)

    def late(todo):
        r = launch(todo)
        return CompletedProcess(todo, 1, r.stdout, "b: leaked a shared memory segment")

    cases = run_in_turn(tmp_path, ["a", "b"], late)
    assert launches == [["a", "b"]]
    assert cases["a"].result() == {"global_step": 20}
    said = failure(cases["b"])
    assert "case b: the shared launch exited 1 after writing b.json" in said, said
    assert "leaked a shared memory segment" in said, said


def test_a_hung_case_is_not_launched_again_and_the_rest_name_it(tmp_path):
    launch, launches = launcher(tmp_path, hangs="b")
    cases = run_in_turn(tmp_path, ["a", "b", "c"], launch)
    assert launches == [["a", "b", "c"]]
    assert cases["a"].result() == {"global_step": 20}
    for name in ("b", "c"):
        said = failure(cases[name])
        assert f"case {name}: the shared launch exited -1 without {name}.json" in said, said
        assert "(last case begun: b)" in said and "hung for 90 s" in said, said

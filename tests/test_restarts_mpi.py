"""``python -m mpips.launch --restarts N``: what cannot be survived in place (a PS task, a
sync replica) runs again from the latest checkpoint; the restarts used up end the job,
named; a preempted run (exit 3) is not run again (docs/guide/failures.md, "Restarts")."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import RESULT, ROOT, BackgroundJob, read_result

from mpips import launch

STEPS = {"async": 12000, "sync": 600}  # digits: a few seconds on the loaded 2 cores
SAVED = re.compile(r"saved checkpoint \S+ \(global_step (\d+),")
RESTART = "mpips.launch: restart "
FAILED = "mpips.launch: the run failed "


def _job(tmp_path, mode: str, restarts: int = 2, steps: int = 0) -> BackgroundJob:
    (tmp_path / "job.toml").write_text(
        f'[data]\nbuiltin = "digits"\n[train]\nmode = "{mode}"\nsteps = {steps or STEPS[mode]}\n'
        '[checkpoint]\ndir = "ckpt"\nevery_secs = 0.5\n'
    )
    wrap = (sys.executable, "-m", "mpips.launch", "--restarts", str(restarts))
    return BackgroundJob(tmp_path, 3, "job.toml", "--result", RESULT, wrap=wrap)


def _pid_after(job: BackgroundJob, task: str, start: int, timeout: float = 90) -> int:
    """The pid ``task`` says at start-up, after output offset ``start`` (its attempt's)."""
    return _rank_and_pid(job, task, start, timeout)[1]


def _wait_after(job: BackgroundJob, pattern: str, start: int, timeout: float = 90) -> None:
    """Until ``pattern`` shows after output offset ``start``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        if re.search(pattern, job.text()[start:]):
            return
        time.sleep(0.1)
    job.end(10)
    pytest.fail(f"no {pattern!r}:\n{job.text()[-3000:]}")


def _rank_and_pid(job: BackgroundJob, task: str, start: int, timeout: float = 90) -> tuple:
    """The rank and pid ``task`` says at start-up, after output offset ``start``."""
    pattern = re.compile(rf"\[{re.escape(task)}\] rank (\d+), pid (\d+) on ")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.proc.poll() is None:
        m = pattern.search(job.text(), start)
        if m:
            return int(m.group(1)), int(m.group(2))
        time.sleep(0.1)
    job.end(10)
    pytest.fail(f"no start-up line of {task}:\n{job.text()[-3000:]}")


@pytest.mark.launcher
@pytest.mark.parametrize(
    "mode,victim", [("async", "/job:ps/task:0"), ("sync", "/job:worker/task:1")]
)
def test_a_rank_killed_mid_run_restarts_the_job_from_its_checkpoint(tmp_path, mode, victim):
    """kill -9 a PS task (async) or a replica (sync) after a checkpoint past step 1: the
    run fails once, runs again from the latest checkpoint, and reaches its target: at most
    one checkpoint interval of work is lost."""
    job = _job(tmp_path, mode)
    rank, pid = _rank_and_pid(job, victim, 0)
    job.wait_for(r"saved checkpoint \S+ \(global_step [1-9]\d{2,},", 120)
    os.kill(pid, signal.SIGKILL)
    rc = job.end(180)
    text = job.text()
    assert rc == 0, text[-3000:]
    result = read_result(tmp_path)
    assert result is not None and result["global_step"] == STEPS[mode], text[-3000:]
    failed = [line for line in text.splitlines() if line.startswith(FAILED)]
    restarts = [line for line in text.splitlines() if line.startswith(RESTART)]
    assert len(failed) == 1 and len(restarts) == 1, text[-3000:]
    assert "(attempt 1 of 3)" in failed[0] and "killed by signal 9 (SIGKILL)" in failed[0]
    assert f"rank {rank} (" in failed[0] and f", pid {pid} on " in failed[0]  # (sync: task unknown)
    assert "restart 1 of 2" in restarts[0]
    before, after = text.split(restarts[0], 1)
    last_saved = max(int(s) for s in SAVED.findall(before))
    resumed = re.search(r"restored global_step (\d+) from", after)
    assert resumed and int(resumed.group(1)) >= last_saved, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not list(tmp_path.glob(".mpips-launch-*"))


@pytest.mark.launcher
def test_a_lost_node_is_left_out_of_the_restart(tmp_path, monkeypatch):
    """Two emulated nodes (2 ranks each); the second one lost for good (its ranks and its
    MPI proxy killed, and its ssh no longer answers: tests/fake_ssh's MPIPS_FAKE_SSH_DOWN;
    two workers killed alone would be survived in place, test_survive_mpi): the restart runs
    on the node left, with 2 ranks instead of 4, from the latest checkpoint (any layout),
    and reaches the target."""
    down = tmp_path / "down"
    down.write_text("")
    monkeypatch.setenv("MPIPS_FAKE_SSH_DOWN", str(down))
    steps = STEPS["async"]
    (tmp_path / "job.toml").write_text(
        f'[data]\nbuiltin = "digits"\n[train]\nsteps = {steps}\n'
        '[checkpoint]\ndir = "ckpt"\nevery_secs = 0.5\n'
    )
    wrap = (sys.executable, "-m", "mpips.launch", "--restarts", "1")
    job = BackgroundJob(tmp_path, 4, "job.toml", "--result", RESULT, nodes=(2, 2), wrap=wrap)
    node1 = [_rank_and_pid(job, f"/job:worker/task:{k}", 0)[1] for k in (1, 2)]  # ranks 2, 3
    job.wait_for(r"saved checkpoint \S+ \(global_step [1-9]\d{2,},", 120)
    down.write_text("node1\n")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import chaos

    for pid in [*node1, chaos.node_proxy(node1[0])]:  # (a lost node takes its proxy along)
        os.kill(pid, signal.SIGKILL)
    rc = job.end(180)
    text = job.text()
    assert rc == 0, text[-3000:]
    assert (
        "mpips.launch: node1 did not answer" in text
        and "the restart runs on node0 with 2 ranks instead of 4" in text
    ), text[-3000:]
    after = text.split("did not answer", 1)[1]
    assert re.search(r"restored global_step [1-9]\d* from", after), after[-3000:]
    assert "on 1 worker in" in after, after[-3000:]  # 1 PS + 1 worker, on node0
    result = read_result(tmp_path)
    assert result is not None and result["global_step"] == steps, text[-3000:]


def test_the_hosts_left_for_a_restart(tmp_path, monkeypatch):
    """Without MPI: the -hosts (or host file) and -n of an mpiexec command rewritten for the
    hosts that answer; unchanged where every host answers, none does, or it names no hosts."""
    from mpips.process import hosts

    shell = str(ROOT / "tests/fake_ssh")
    cmd = ["mpiexec", "-hosts", "a:2,b:1,c:2", "-launcher-exec", shell, "-n", "5", "python"]
    down = tmp_path / "down"
    monkeypatch.setenv("MPIPS_FAKE_SSH_DOWN", str(down))
    down.write_text("")
    assert hosts.on_what_is_left(cmd, "x") == (cmd, "")
    down.write_text("b\n")
    new, line = hosts.on_what_is_left(cmd, "x")
    assert new[2] == "a:2,c:2" and new[6] == "4" and new[7:] == ["python"], new
    assert line.startswith("x: b did not answer") and "with 4 ranks instead of 5" in line
    down.write_text("a\nb\nc\n")
    assert hosts.on_what_is_left(cmd, "x") == (cmd, "")
    plain = ["mpiexec", "-n", "4", "python"]
    assert hosts.on_what_is_left(plain, "x") == (plain, "")
    # a host file: the restart gets a new one of the hosts that answer
    listed = tmp_path / "hosts.txt"
    listed.write_text("# the nodes\na:2\nb:1 ifhn=10.0.0.2  # a comment\n\nc:2\n")
    cmd = ["mpiexec", "-f", str(listed), "-launcher-exec", shell, "-n", "5", "python"]
    down.write_text("c\n")
    new, line = hosts.on_what_is_left(cmd, "x")
    assert new[1] == "-f" and new[2] != str(listed) and new[6] == "3", new
    assert open(new[2]).read() == "a:2\nb:1 ifhn=10.0.0.2\n" and "c did not answer" in line
    down.write_text("")
    assert hosts.on_what_is_left(cmd, "x") == (cmd, "")


@pytest.mark.launcher
def test_restarts_used_up_end_the_job_naming_the_rank(tmp_path):
    """The PS task killed in each run (once it has trained: a rank killed during start-up
    can leave the others waiting for it up to MPIPS_START_TIMEOUT): --restarts 1 gives two
    runs, then exit not 0, the last lines saying the restarts are used up and which rank
    failed."""
    job = _job(tmp_path, "async", restarts=1, steps=10**9)
    first = _pid_after(job, "/job:ps/task:0", 0)
    job.wait_for(r"saved checkpoint \S+ \(global_step [1-9]\d{2,},", 120)
    os.kill(first, signal.SIGKILL)
    restart = job.wait_for(re.escape(RESTART), 60)
    second = _pid_after(job, "/job:ps/task:0", restart.end())
    _wait_after(job, r"saved checkpoint \S+ \(global_step [1-9]\d{2,},", restart.end())
    os.kill(second, signal.SIGKILL)
    rc = job.end(60)
    text = job.text()
    assert rc != 0, text[-3000:]
    said = ("mpips.launch: the run failed", "mpips.launch: rest")
    lines = [line for line in text.splitlines() if line.startswith(said)]
    assert len(lines) == 4, text[-3000:]
    assert text.rstrip().splitlines()[-1] == lines[-1]
    assert "(attempt 2 of 2)" in lines[-2] and f"pid {second} on " in lines[-2]
    assert lines[-1].startswith("mpips.launch: restarts used up (1 of 1): rank 0 (")
    assert f", pid {second} on " in lines[-1]  # (killed at start-up: its task unknown)
    assert lines[-1].endswith(f"exit code {rc}"), lines[-1]


@pytest.mark.launcher
def test_a_preempted_run_is_not_restarted(tmp_path):
    """SIGTERM to a worker: the job stops with its checkpoint, exit 3, and is not run
    again (not a failure)."""
    job = _job(tmp_path, "async", steps=10**9)
    pid = _pid_after(job, "/job:worker/task:1", 0)
    job.wait_for(r"saved checkpoint \S+ \(global_step [1-9]\d{2,},", 120)
    os.kill(pid, signal.SIGTERM)
    rc = job.end(60)
    text = job.text()
    assert rc == 3, text[-3000:]
    assert "mpips.launch: " not in text, text[-3000:]


# -- without MPI ---------------------------------------------------------------------------


def test_the_launcher_takes_restarts_before_the_command(capsys):
    command = ["mpirun", "-n", "3", "python", "-m", "mpips", "train", "job.toml"]
    assert launch.parse(command) == (0, command)
    assert launch.parse(["--restarts", "2", *command]) == (2, command)
    assert launch.parse(["--restarts=0", *command]) == (0, command)
    # after the launcher's name it is the launcher's (or the job's) argument
    assert launch.parse([*command, "--restarts", "2"]) == (0, [*command, "--restarts", "2"])
    for bad in (["--restarts", "x", *command], ["--restarts=-1", *command], ["--restarts"]):
        with pytest.raises(ValueError, match="whole number"):
            launch.parse(bad)
    with pytest.raises(ValueError, match="no launcher command"):
        launch.parse(["--restarts", "1"])
    assert launch.main(["--restarts", "many", *command]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--restarts takes a whole number" in err


def test_which_runs_are_restarted():
    again = launch.should_restart
    assert again(137, None, 0, 2) and again(1, None, 1, 2) and again(9, None, 0, 1)
    assert not again(137, None, 2, 2)  # used up
    assert not again(137, None, 0, 0)  # none asked for
    for code in (0, 2, 3):  # done, bad input, stopped with a checkpoint
        assert not again(code, None, 0, 2)
    assert not again(137, signal.SIGTERM, 0, 2)  # the launcher was told to stop


def test_the_failure_lines_name_the_rank(tmp_path):
    assert launch.failed_rank(None) == "" and launch.failed_rank(str(tmp_path)) == ""
    (tmp_path / "exit-2.json").write_text('{"rank": 2, "task": "", "pid": 7, "code": 9}')
    assert "rank 2 (task unknown, pid 7 on None) was the first to exit with a failure code (9)" in (
        launch.failed_rank(str(tmp_path))
    )
    (tmp_path / "lost-0.json").write_text(
        '{"rank": 0, "task": "/job:ps/task:0", "pid": 5, "host": "n1", "signal": 9}'
    )
    who = launch.failed_rank(str(tmp_path))  # a death by a signal comes first
    assert who == "rank 0 (/job:ps/task:0, pid 5 on n1) was killed by signal 9 (SIGKILL)"
    lines = launch.failure_lines(137, 0, 2, who)
    assert len(lines) == 2 and "(attempt 1 of 3): exit code 137; rank 0" in lines[0]
    assert lines[1].startswith("mpips.launch: restart 1 of 2 in 1 s")
    lines = launch.failure_lines(137, 2, 2, who)
    assert lines[1] == (
        "mpips.launch: restarts used up (2 of 2): rank 0 (/job:ps/task:0, pid 5 on n1) "
        "failed the last run; exit code 137"
    )
    assert "the output above says which" in launch.failure_lines(1, 1, 1, "")[1]


def test_the_supervisor_records_a_failure_code(tmp_path):
    """A rank that exits with a failure code leaves exit-RANK.json (its name for the
    restart lines); one that exits 0 leaves nothing."""
    script = (
        "import os, sys\nfrom mpips.process.supervise import shim\nr, w = os.pipe()\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(int(sys.argv[1]))\nshim(pid, r)\n"
    )
    env = {**os.environ, "PMI_RANK": "2", "MPIPS_OUTCOME_DIR": str(tmp_path)}
    for code in (0, 9):
        done = subprocess.run([sys.executable, "-c", script, str(code)], env=env, timeout=30)
        assert done.returncode == code
    assert [p.name for p in tmp_path.iterdir()] == ["exit-2.json"]
    record = json.loads((tmp_path / "exit-2.json").read_text())
    assert record["rank"] == 2 and record["code"] == 9 and "signal" not in record


def test_a_death_the_run_cannot_survive_is_aborted_if_the_job_stays(tmp_path):
    """MPICH's proxy does not always end the job when a supervisor dies by the signal: the
    launcher aborts it once the note is ABORT_AFTER s old; survived deaths never."""
    lost = tmp_path / "lost-0.json"
    lost.write_text('{"rank": 0, "task": "/job:ps/task:0", "signal": 9, "survivable": true}')
    os.utime(lost, (0, 0))
    assert launch._fatal_death(str(tmp_path), 5.0) == ""
    lost.write_text('{"rank": 0, "task": "/job:ps/task:0", "signal": 9, "survivable": false}')
    assert launch._fatal_death(str(tmp_path), 5.0) == ""  # just now: MPICH may end it yet
    os.utime(lost, (0, 0))
    assert launch._fatal_death(str(tmp_path), 5.0) == "rank 0 (/job:ps/task:0)"

"""Ctrl-C pressed twice in quick succession, typed into a real terminal (a pseudo-terminal
whose foreground process group gets SIGINT from the kernel, as a shell's job does): MPICH's
mpiexec takes any second SIGINT as a forced abort (exit 255, even after every rank committed
its checkpoint and chose exit 3), and ``srun -X`` kills the tasks; under ``python -m
mpips.launch`` the job stops as after one Ctrl-C, with exit 3, and Ctrl-C pressed again
later still reaches the launcher. The srun case needs a Slurm controller (as
tests/test_slurm.py: it skips without one, and fails under CI=true)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from conftest import clean_env, mpiexec_path, run_py, under_ci

from mpips.launch import DROPPED
from mpips.process.preemption import DUPLICATE_SECONDS

TWICE = 0.05  # s between the two presses: well inside "within 0.2 s"


def _take_the_terminal() -> None:
    """In the child, after setsid: the pseudo-terminal on fd 0 becomes its controlling
    terminal, so its process group is the terminal's foreground group."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A command run as a shell runs a foreground job in a terminal: its own session, with a
    pseudo-terminal as its controlling terminal and its stdin, stdout and stderr."""

    def __init__(self, argv: list[str], cwd: Path):
        self.master, slave = os.openpty()
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=clean_env(),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
            preexec_fn=_take_the_terminal,
        )
        os.close(slave)
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()  # (a terminal nobody reads would block the job's output)

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace").replace("\r\n", "\n")

    def wait_for(self, pattern: str, timeout: float = 90) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.end(0)
        pytest.fail(f"no {pattern!r} within {timeout} s:\n{self.text()[-3000:]}")

    def ctrl_c(self, times: int = 1) -> None:
        """Ctrl-C typed ``times`` times, TWICE s apart: the kernel's SIGINT to the foreground
        process group, each time."""
        for i in range(times):
            if i:
                time.sleep(TWICE)
            os.write(self.master, b"\x03")

    def end(self, timeout: float = 60) -> int | None:
        """The command's exit status, once it ends (None: it did not within ``timeout`` s,
        and it was killed with its process group)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self._reader.join(10)
            os.close(self.master)


def train_command(wrapped: bool, launcher: tuple[str, ...] = ()) -> list[str]:
    """The default job (endless) under ``launcher`` (default: this Python's mpiexec -n 3),
    under mpips.launch if ``wrapped``."""
    launcher = launcher or (mpiexec_path(), "-n", "3")
    train = [*launcher, sys.executable, "-m", "mpips", "train"]
    train += ["--no-progress", "--log-every", "0", "--steps", str(10**9)]
    return [sys.executable, "-m", "mpips.launch", *train] if wrapped else train


def stopped_once_with_a_checkpoint(code: int | None, text: str, cwd: Path) -> None:
    """Exit 3, the repeat dropped (said once), no forced abort, the checkpoint named there."""
    assert code == 3, (code, text[-3000:])
    assert text.count(DROPPED) == 1, text[-3000:]
    assert "cleaning up processes" not in text and "assert" not in text, text[-3000:]
    assert "forcing job termination" not in text, text[-3000:]
    m = re.search(r"stopped early by SIGINT: checkpoint at global_step (\d+)", text)
    assert m and (cwd / f"runs/default/ckpt-{m.group(1)}.json").exists(), text[-3000:]


@pytest.mark.launcher
@pytest.mark.parametrize("wrapped", [True, False], ids=["mpips.launch", "bare-mpiexec"])
def test_ctrl_c_twice_in_a_terminal(tmp_path, wrapped):
    """Under mpips.launch: one request, a committed checkpoint, exit 3, no launcher noise.
    Bare mpiexec: its forced abort (what docs/guide/failures.md describes), whatever the
    ranks chose; if MPICH ever stops doing this, that page must change."""
    term = Terminal(train_command(wrapped), tmp_path)
    term.wait_for(r"saved checkpoint")  # training is under way
    term.ctrl_c(times=2)
    code = term.end(timeout=90)
    text = term.text()
    assert code is not None, f"the job did not end:\n{text[-3000:]}"
    if wrapped:
        stopped_once_with_a_checkpoint(code, text, tmp_path)
    else:
        assert code != 3 and "Ctrl-C caught... cleaning up processes" in text, (code, text[-3000:])


@pytest.fixture
def slurm() -> None:
    """A Slurm controller that answers (slurm/one-node-slurm.sh up), as tests/test_slurm.py."""
    import test_slurm

    if not test_slurm.slurm_up():
        if under_ci():
            pytest.fail("no Slurm controller: .ci/run must start slurm/one-node-slurm.sh up")
        pytest.skip("no Slurm controller (slurm/one-node-slurm.sh up, then export SLURM_CONF)")


@pytest.mark.launcher
def test_ctrl_c_twice_to_srun_x_under_the_wrapper(slurm, tmp_path):
    """``srun -X`` passes one Ctrl-C on to the tasks, but at a second within a second it
    kills them (exit 137, no checkpoint); under mpips.launch it gets one: exit 3."""
    srun = ("srun", "-X", "-n", "3", "--mpi=pmi2")
    term = Terminal(train_command(True, srun), tmp_path)
    term.wait_for(r"saved checkpoint", timeout=120)
    term.ctrl_c(times=2)
    code = term.end(timeout=90)
    stopped_once_with_a_checkpoint(code, term.text(), tmp_path)


COUNTER = """
import os, signal, sys, time
def got(signum, frame):
    print("got", signal.Signals(signum).name, flush=True)
    if signum == signal.SIGTERM:
        sys.exit(3)
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, got)
print("stdin", repr(sys.stdin.read()), flush=True)  # a terminal's would stop it (SIGTTIN)
print("group", os.getpgrp(), "parent's", os.getpgid(os.getppid()), flush=True)
time.sleep(120)  # (signals do not cut it short; a bound, should the test fail)
"""


@pytest.mark.launcher
def test_the_wrapper_passes_ctrl_c_on_once_per_window_and_the_rest_as_they_come(tmp_path):
    """A stand-in launcher that counts what reaches it: Ctrl-C twice is one SIGINT; Ctrl-C
    again after the window is passed on (with mpiexec: its forced abort, as the user asked);
    SIGUSR1 and SIGTERM pass as they come; the launcher's exit code is the wrapper's. In its
    own process group, the launcher does not read the terminal (a background group that
    reads its terminal is stopped), so its stdin is empty."""
    (tmp_path / "counter.py").write_text(COUNTER)
    term = Terminal([sys.executable, "-m", "mpips.launch", sys.executable, "counter.py"], tmp_path)
    group, parents = map(int, term.wait_for(r"group (\d+) parent's (\d+)", timeout=30).groups())
    assert "stdin ''" in term.text()
    assert group != parents  # its own process group: the terminal's Ctrl-C does not reach it
    term.ctrl_c(times=2)
    term.wait_for(re.escape(DROPPED), timeout=30)
    time.sleep(DUPLICATE_SECONDS + 0.5)
    term.ctrl_c()
    term.wait_for(r"(?s)got SIGINT.*got SIGINT")
    os.kill(term.proc.pid, signal.SIGUSR1)
    term.wait_for(r"got SIGUSR1")
    os.kill(term.proc.pid, signal.SIGTERM)
    assert term.end(timeout=30) == 3, term.text()
    got = re.findall(r"got (\w+)", term.text())
    assert got == ["SIGINT", "SIGINT", "SIGUSR1", "SIGTERM"], term.text()


@pytest.mark.launcher
def test_the_wrapper_ends_as_its_launcher_does(tmp_path):
    """Exit codes pass through, a death by signal is the wrapper's own death by it; a
    missing or unknown launcher is one line and exit 2."""
    launch = ["-m", "mpips.launch"]
    r = run_py([*launch, sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path)
    assert (r.returncode, r.stderr) == (3, ""), r
    r = run_py([*launch, sys.executable, "-c", "import os; os.kill(os.getpid(), 15)"], tmp_path)
    assert r.returncode == -signal.SIGTERM, r
    for args, said in (([], "no launcher command given"), (["no-such-launcher"], "cannot run")):
        r = run_py([*launch, *args], tmp_path)
        assert r.returncode == 2 and said in r.stderr, r
        assert len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr


ORPHAN = """
import os, signal, sys, time
from pathlib import Path
def term(signum, frame):
    Path("terminated").write_text("yes")
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
print("ready", os.getpid(), flush=True)
time.sleep(120)
"""


@pytest.mark.launcher
def test_a_launcher_whose_wrapper_is_killed_gets_sigterm(tmp_path):
    """kill -9 of the wrapper: the launcher, in a process group no Ctrl-C reaches any more,
    gets SIGTERM (for mpiexec: passed to the ranks, a checkpoint, exit 3), not left running."""
    (tmp_path / "orphan.py").write_text(ORPHAN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mpips.launch", sys.executable, "orphan.py"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    try:
        assert ready.startswith("ready "), ready
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not (tmp_path / "terminated").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "terminated").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if ready.startswith("ready "):  # the stand-in, should it still be there
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(ready.split()[1]), signal.SIGKILL)

"""``python -m mpips.launch mpirun -n 8 python -m mpips train ...``: the launcher, run so that
Ctrl-C pressed twice in quick succession stops the job as one Ctrl-C does (a checkpoint,
exit 3).

MPICH's mpiexec (hydra) takes any second SIGINT for "force abort": it kills every rank and
exits 255 with assertion lines of its own, even when the ranks have already committed their
checkpoint and chosen exit 3; no option or environment variable changes that. Slurm's
``srun -X`` (which passes one Ctrl-C on to the tasks) kills them at a second one within a
second. A terminal sends Ctrl-C to its whole foreground process group, so the launcher gets
every press. Here the launcher runs in a process group of its own, which the terminal's
Ctrl-C does not reach, and this process passes the signals on: SIGINT once, dropping a
repeat within signals.DUPLICATE_SECONDS of it (the ranks too take one that soon for the
same request); one after that is passed on, so Ctrl-C pressed again later still aborts the
job. The other signals (SIGTERM, SIGUSR1, ...) are passed on as they come. Exits with the
launcher's status. (What the ranks themselves do with each signal, phase by phase:
mpips/process/signals.py.)

It imports the standard library and that constant only: this process holds no MPI.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from .process.signals import DUPLICATE_SECONDS

PROG = "mpips.launch"
USAGE = (
    f"python -m {PROG} LAUNCHER [ARG...]   "
    f"(e.g. python -m {PROG} mpirun -n 8 python -m mpips train)"
)
RELAYED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
DROPPED = (
    f"{PROG}: a second Ctrl-C within {DUPLICATE_SECONDS:g} s is the same request: not passed "
    "on (the launcher would abort the job); press it again later to abort"
)
HELP = (
    "Runs the launcher in a process group of its own and passes signals on to it: Ctrl-C "
    f"once (a repeat within {DUPLICATE_SECONDS:g} s is the same request; a later one aborts "
    "the job), the others as they come. Exits with the launcher's status."
)
_PR_SET_PDEATHSIG = 1


class Relay:
    """Passes the signals this process receives on to the launcher (its pid: the launcher
    forwards them to the ranks itself), SIGINT once per DUPLICATE_SECONDS."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []  # received before the launcher started
        self.first_interrupt: float | None = None
        self.told = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and not self._pass_interrupt():
            return
        if self.child is None:
            self.pending.append(signum)
        else:
            self.child.send_signal(signum)  # (nothing once the launcher has been reaped)

    def _pass_interrupt(self) -> bool:
        """Whether this SIGINT goes on: the first does, a repeat within the window not."""
        now = time.monotonic()
        if self.first_interrupt is None:
            self.first_interrupt = now
            return True
        if now - self.first_interrupt >= DUPLICATE_SECONDS:
            return True
        if not self.told:
            self.told = True
            print(DROPPED, file=sys.stderr, flush=True)
        return False

    def started(self, child: subprocess.Popen[bytes]) -> None:
        """The launcher runs: pass on what came while it started."""
        self.child = child
        while self.pending:
            child.send_signal(self.pending.pop(0))


def _ends_with_this_process() -> None:
    """In the launcher, before exec: SIGTERM to it if this process dies first (kill -9), so
    the job, in a process group of its own, never runs on out of Ctrl-C's reach."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _stdin() -> int | None:
    """The launcher's stdin: none from a terminal (a process group in the background that
    reads its terminal is stopped by SIGTTIN), else this process's own."""
    try:
        return subprocess.DEVNULL if os.isatty(0) else None
    except OSError:
        return subprocess.DEVNULL


def _exit_status(returncode: int) -> int:
    """The launcher's status as ours: its exit code, or death by the same signal."""
    if returncode >= 0:
        return returncode
    signum = -returncode
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return 128 + signum  # (a signal whose default action does not end a process)


HYDRA = ("mpirun", "mpiexec", "mpiexec.hydra")
SEVERAL_NODES = ("-hosts", "-host", "--host", "-f", "-hostfile", "--hostfile", "-machinefile")
NO_CLEANUP = "-disable-auto-cleanup"
NOT_SURVIVING = (
    f"{PROG}: a rank that dies ends the job here: {{why}} (a lost worker costs only its step "
    "with MPICH's mpirun on one node)"
)


def _is_hydra(program: str) -> bool:
    """Whether ``program`` is MPICH's hydra launcher (it says so in its --version)."""
    try:
        out = subprocess.run(
            [program, "--version"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in out.stdout


def prepare(
    command: Sequence[str], env: dict[str, str], hydra: bool | None = None
) -> tuple[list[str], dict[str, str], str | None]:
    """Survive mode (a worker killed outright costs its step, not the job): for MPICH's
    hydra on one node, the command gets -disable-auto-cleanup and the ranks MPIPS_SURVIVE=1
    and MPIPS_OUTCOME_DIR (a new folder here, returned: the verdict reads it). Elsewhere, or
    with MPIPS_SURVIVE=0 set, the command as given (and one line saying why, where the
    launcher is not hydra). ``hydra``: whether it is (None: ask it)."""
    command, env = list(command), dict(env)
    if env.get("MPIPS_SURVIVE", "").strip().lower() in ("0", "false", "no", "off"):
        return command, env, None
    if os.path.basename(command[0]) not in HYDRA:
        return command, env, None
    why = ""
    if not (_is_hydra(command[0]) if hydra is None else hydra):
        why = f"{command[0]} is not MPICH's hydra"
    elif any(a in SEVERAL_NODES for a in command) or _slurm_nodes(env) > 1:
        why = "the job runs on several nodes"
    if why:
        print(NOT_SURVIVING.format(why=why), file=sys.stderr, flush=True)
        return command, env, None
    folder = tempfile.mkdtemp(prefix=".mpips-launch-", dir=os.getcwd())
    if NO_CLEANUP not in command:
        command.insert(1, NO_CLEANUP)
    env.update(MPIPS_SURVIVE="1", MPIPS_OUTCOME_DIR=folder)
    return command, env, folder


def _slurm_nodes(env: dict[str, str]) -> int:
    text = env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")).strip()
    return int(text) if text.isdigit() else 1


def verdict(returncode: int, folder: str | None) -> tuple[int, list[str]]:
    """The job's exit status and what to say of it, from the launcher's status and, in
    survive mode, the run's outcome (written by the chief) and the supervisors' records
    of the ranks that died: 0 when the run reached its target and every rank that died
    is one it went on without; else the launcher's status."""
    if folder is None:
        return returncode, []
    path = Path(folder)
    outcome = _json(path / "outcome.json")
    died = {int(r["rank"]) for r in map(_json, sorted(path.glob("lost-*.json"))) if "rank" in r}
    if not outcome or not isinstance(outcome.get("lost"), list):
        return returncode, []
    lost = {int(r["rank"]) for r in outcome["lost"]}
    if not lost or not died <= lost:
        return returncode, []
    if outcome.get("reached"):
        code, how = 0, "reached its target"
    elif outcome.get("stopped_by"):
        code, how = 3, "was stopped by a signal, with a checkpoint,"
    else:
        return returncode, []
    return code, [
        f"{PROG}: the run {how} at global_step {outcome.get('global_step')} with "
        f"{len(lost)} rank(s) lost (rank {', '.join(map(str, sorted(lost)))}: the chief's "
        f"report names them); exit code {code} (the launcher's: {returncode})"
    ]


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run(command: Sequence[str]) -> int:
    """Run the launcher ``command`` in its own process group, relaying signals (see the
    module's docstring); returns its exit status (survive mode: see ``verdict``), 2 if it
    cannot be started."""
    command, env, folder = prepare(command, dict(os.environ))
    try:
        returncode = _launch(command, env)
        if returncode is None:
            return 2
        code, lines = verdict(_exit_code(returncode), folder)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        if lines:
            return code
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return _exit_status(returncode)


def _exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _launch(command: list[str], env: dict[str, str]) -> int | None:
    """The launcher run to its end, signals relayed; its returncode (None: not started)."""
    relay = Relay()
    previous = {sig: signal.signal(sig, relay.handle) for sig in RELAYED}
    try:
        try:
            child = subprocess.Popen(
                command,
                process_group=0,
                stdin=_stdin(),
                preexec_fn=_ends_with_this_process,
                env=env,
            )
        except OSError as e:
            print(f"{PROG}: error: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
            return None
        relay.started(child)
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpips.launch LAUNCHER [ARG...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n{HELP}")
        return 0
    if not args:
        print(f"{PROG}: error: no launcher command given; {USAGE}", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

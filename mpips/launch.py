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

``--restarts N`` (before the launcher command): a run that fails is run again, up to N
times, 1 s apart: the same command resumes from the job's latest checkpoint (see
``should_restart`` for what counts as a failure; docs/guide/failures.md, "Restarts").

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

from .process import hosts
from .process.signals import DUPLICATE_SECONDS
from .process.supervise import RELAYED  # the signals passed on, as a rank's supervisor does

PROG = "mpips.launch"
USAGE = (
    f"python -m {PROG} [--restarts N] LAUNCHER [ARG...]   "
    f"(e.g. python -m {PROG} --restarts 2 mpirun -n 8 python -m mpips train job.toml)"
)
DROPPED = (
    f"{PROG}: a second Ctrl-C within {DUPLICATE_SECONDS:g} s is the same request: not passed "
    "on (the launcher would abort the job); press it again later to abort"
)
HELP = (
    "Runs the launcher in a process group of its own and passes signals on to it: Ctrl-C "
    f"once (a repeat within {DUPLICATE_SECONDS:g} s is the same request; a later one aborts "
    "the job), the others as they come. Exits with the launcher's status.\n"
    "  --restarts N  run the command again after a failure, up to N times (default 0), 1 s "
    "apart: the run resumes from the job's latest checkpoint (from scratch if it has none). "
    "Not after exit 0, 2 (bad input), 3 (stopped by a signal, with a checkpoint) or a signal "
    f"sent to {PROG} itself. Each failure and restart is one line; when the restarts are "
    "used up, the last line says so, names the rank that failed, and the exit code is the "
    "failed run's."
)
RESTART_PAUSE = 1.0  # seconds between a failure and the restart
NOT_RESTARTED = (0, 2, 3)  # done, bad input (fails again), stopped with a checkpoint
_PR_SET_PDEATHSIG = 1


class Relay:
    """Passes the signals this process receives on to the launcher (its pid: the launcher
    forwards them to the ranks itself), SIGINT once per DUPLICATE_SECONDS."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []  # received before the launcher started
        self.first_interrupt: float | None = None
        self.told = False
        self.received: int | None = None  # the first signal (the user's stop: no restart)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
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
NO_CLEANUP = "-disable-auto-cleanup"
NOT_SURVIVING = (
    f"{PROG}: a rank that dies ends the job here: {{why}} (a lost worker costs only its step "
    "with MPICH's mpirun)"
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
    hydra, on one node or several, the command gets -disable-auto-cleanup and the ranks
    MPIPS_SURVIVE=1 and MPIPS_OUTCOME_DIR (a new folder here, returned: the verdict reads
    it; on several nodes the working directory must be one they all see). Elsewhere, or
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
    if why:
        print(NOT_SURVIVING.format(why=why), file=sys.stderr, flush=True)
        return command, env, None
    folder = tempfile.mkdtemp(prefix=".mpips-launch-", dir=os.getcwd())
    if NO_CLEANUP not in command:
        command.insert(1, NO_CLEANUP)
    env.update(MPIPS_SURVIVE="1", MPIPS_OUTCOME_DIR=folder)
    return command, env, folder


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


def run(command: Sequence[str], restarts: int = 0) -> int:
    """Run the launcher ``command`` in its own process group, relaying signals (see the
    module's docstring), and again after a failure, up to ``restarts`` times (see
    ``should_restart``); returns its exit status (survive mode: see ``verdict``), 2 if it
    cannot be started."""
    command, env, folder = prepare(command, dict(os.environ))
    relay = Relay()
    previous = {sig: signal.signal(sig, relay.handle) for sig in RELAYED}
    try:
        return _attempts(command, env, folder, relay, restarts)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _attempts(
    command: list[str], env: dict[str, str], folder: str | None, relay: Relay, restarts: int
) -> int:
    """The runs, one after another while ``should_restart`` says so; the last one's status."""
    for attempt in range(restarts + 1):
        returncode = _launch(command, env, relay, folder)
        if returncode is None:
            return 2
        code, lines = verdict(_exit_code(returncode), folder)
        for line in lines:
            _say(line)
        code = code if lines else _exit_code(returncode)
        again = should_restart(code, relay.received, attempt, restarts)
        if restarts and code not in NOT_RESTARTED and relay.received is None:
            for line in failure_lines(code, attempt, restarts, failed_rank(folder)):
                _say(line)
        if again:
            _clear(folder)
            time.sleep(RESTART_PAUSE)
            command, line = hosts.on_what_is_left(command, PROG)  # (a node lost for good)
            if line:
                _say(line)
            if relay.received is not None:
                _say(f"{PROG}: not restarted: stopped by signal {relay.received}")
        if not again or relay.received is not None:
            return code if lines else _exit_status(returncode)
    raise AssertionError("unreachable: the last attempt is never restarted")


def should_restart(code: int, signalled: int | None, attempt: int, restarts: int) -> bool:
    """Whether the run that ended with exit ``code`` (attempt 0, 1, ...) runs again: on a
    failure only (not 0; not 2, bad input, which would fail again; not 3, stopped by a
    signal with its checkpoint), not after a signal to this process (``signalled``: the
    user's or the scheduler's stop), and while restarts are left."""
    return code not in NOT_RESTARTED and signalled is None and attempt < restarts


def failure_lines(code: int, attempt: int, restarts: int, who: str) -> list[str]:
    """What to say of a failed run (``attempt`` 0, 1, ...; ``who``: the rank that failed,
    or ""): one line for the failure, one for the restart or, the last time, for the
    restarts used up."""
    why = f"exit code {code}" + (f"; {who}" if who else " (the output above says which rank)")
    lines = [f"{PROG}: the run failed (attempt {attempt + 1} of {restarts + 1}): {why}"]
    if attempt < restarts:
        lines.append(
            f"{PROG}: restart {attempt + 1} of {restarts} in {RESTART_PAUSE:g} s: the same "
            "command, resuming from the job's latest checkpoint (from scratch if it has none)"
        )
    else:
        last = who.split(" was ")[0] if who else "a rank (the output above says which)"
        lines.append(
            f"{PROG}: restarts used up ({restarts} of {restarts}): {last} failed the last "
            f"run; exit code {code}"
        )
    return lines


def failed_rank(folder: str | None) -> str:
    """The rank that failed first, from its supervisor's record in ``folder`` (survive
    mode): one killed by a signal (``lost-R.json``), else one that exited with a failure
    code (``exit-R.json``); "" when none is known."""
    if folder is None:
        return ""
    for pattern in ("lost-*.json", "exit-*.json"):
        records = []
        for path in Path(folder).glob(pattern):
            with contextlib.suppress(OSError):
                records.append((path.stat().st_mtime, _json(path)))
        records = [(t, r) for t, r in records if "rank" in r]
        if records:
            return _who(min(records, key=lambda tr: tr[0])[1])
    return ""


def _who(record: dict) -> str:
    task = record.get("task") or "task unknown"
    name = f"rank {record['rank']} ({task}, pid {record.get('pid')} on {record.get('host')})"
    signum = record.get("signal")
    if isinstance(signum, int):
        with contextlib.suppress(ValueError):
            return f"{name} was killed by signal {signum} ({signal.Signals(signum).name})"
        return f"{name} was killed by signal {signum}"
    return f"{name} was the first to exit with a failure code ({record.get('code')})"


def _clear(folder: str | None) -> None:
    """The outcome folder emptied for the next run (its records are the last run's)."""
    if folder is not None:
        for path in Path(folder).iterdir():
            with contextlib.suppress(OSError):
                path.unlink()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def _launch(
    command: list[str], env: dict[str, str], relay: Relay, folder: str | None = None
) -> int | None:
    """The launcher run to its end, signals relayed; its returncode (None: not started)."""
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
    return _wait(child, folder)


ABORT_AFTER = 5.0  # seconds a job may run on after a death it cannot go on without


def _wait(child: subprocess.Popen[bytes], folder: str | None) -> int:
    """The launcher's returncode, once it ends. In survive mode, where a rank the run
    cannot go on without has died (its supervisor's note) and the job is still there
    ABORT_AFTER s later (MPICH's proxy does not always end it), it is aborted: SIGINT
    twice, hydra's forced abort, which kills every rank."""
    aborting = 0.0
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout=0.5)
        if folder is None:
            continue
        if not aborting and (who := _fatal_death(folder, ABORT_AFTER)):
            _say(f"{PROG}: {who} died and the job did not end: aborting it")
            child.send_signal(signal.SIGINT)
            aborting = time.monotonic()
        elif aborting and time.monotonic() - aborting > DUPLICATE_SECONDS + 0.5:
            child.send_signal(signal.SIGINT)  # (the second: forced abort)
            aborting = time.monotonic()


def _fatal_death(folder: str, age: float) -> str:
    """The rank whose death (a note older than ``age`` s) the run cannot survive, or ""."""
    for path in Path(folder).glob("lost-*.json"):
        with contextlib.suppress(OSError):
            record = _json(path)
            if record.get("survivable") is False and time.time() - path.stat().st_mtime > age:
                return f"rank {record.get('rank')} ({record.get('task') or 'task unknown'})"
    return ""


def parse(args: Sequence[str]) -> tuple[int, list[str]]:
    """``[--restarts N] LAUNCHER [ARG...]``: N and the launcher command; ValueError (its
    text the one line to say) for a bad N or no command."""
    args, restarts = list(args), 0
    if args and (args[0] == "--restarts" or args[0].startswith("--restarts=")):
        if "=" in args[0]:
            value, args = args[0].split("=", 1)[1], args[1:]
        else:
            value, args = (args[1] if len(args) > 1 else ""), args[2:]
        if not value.isdigit():
            raise ValueError(f"--restarts takes a whole number, 0 or more (got {value!r})")
        restarts = int(value)
    if not args:
        raise ValueError("no launcher command given")
    return restarts, args


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mpips.launch [--restarts N] LAUNCHER [ARG...]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        print(f"usage: {USAGE}\n{HELP}")
        return 0
    try:
        restarts, command = parse(args)
    except ValueError as e:
        print(f"{PROG}: error: {e}; {USAGE}", file=sys.stderr)
        return 2
    return run(command, restarts)


if __name__ == "__main__":
    sys.exit(main())

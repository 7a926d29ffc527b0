"""A supervisor per rank, so that a worker killed outright (kill -9, the out-of-memory
killer) costs its step, not the job (``python -m mpips.launch``, MPICH's hydra).

MPICH's node proxy SIGKILLs every rank of its node when one of its children dies by a
signal, whatever ``-disable-auto-cleanup`` says. So under ``MPIPS_SURVIVE=1`` (set by
mpips.launch) ``python -m mpips train`` forks before MPI starts: the child goes on as the
rank, and the parent, a small loop of the standard library (``shim``), stays the proxy's
child: it passes signals on, waits for the rank, and exits with its code, or with 128 +
the signal that killed it, as a plain exit the proxy does not answer by killing the node.
It also records the death (``lost-RANK.json`` in MPIPS_OUTCOME_DIR) for mpips.launch's
verdict, and a failure code (``exit-RANK.json``) for its restart lines. Where the run
cannot go on without a rank (``tell`` said so, or said nothing yet: start-up), the
supervisor dies by the same signal instead, and the launcher ends the job as without it.

Standard library only: the supervisor runs this module alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
from pathlib import Path

FD_VARIABLE = "MPIPS_SUPERVISOR_FD"  # in the rank: where it tells its supervisor
RELAYED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
_PR_SET_PDEATHSIG = 1


def wanted(env: dict[str, str] | None = None) -> bool:
    """Whether this process is a rank to supervise: MPIPS_SURVIVE on, started by hydra
    (PMI_RANK set), not yet supervised, and MPI not yet started."""
    env = dict(os.environ) if env is None else env
    on = env.get("MPIPS_SURVIVE", "").strip().lower() in ("1", "true", "yes", "on")
    return on and "PMI_RANK" in env and FD_VARIABLE not in env and "mpi4py.MPI" not in sys.modules


def supervise() -> None:
    """``python -m mpips train``, before MPI starts: where ``wanted()``, fork; this process
    goes on as the rank (returns), and the parent becomes its supervisor (never returns)."""
    if not wanted():
        return
    read, write = os.pipe()
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(read)
        with contextlib.suppress(OSError, AttributeError):  # the rank dies with its supervisor
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # (it died before prctl)
            os._exit(1)
        os.environ[FD_VARIABLE] = str(write)
        return
    os.close(write)
    os.set_inheritable(read, True)
    with contextlib.suppress(ValueError, OSError):  # hydra sees the rank's connection close
        os.close(int(os.environ.get("PMI_FD", "")))
    package = str(Path(__file__).resolve().parents[1])  # mpips/
    code = (
        "import sys, types; p = types.ModuleType('mpips'); p.__path__ = [sys.argv[1]]; "
        "sys.modules['mpips'] = p; "
        "from mpips.process.supervise import shim; shim(int(sys.argv[2]), int(sys.argv[3]))"
    )
    args = [sys.executable, "-I", "-S", "-c", code, package, str(child), str(read)]
    os.execv(sys.executable, args)


def tell(task: str, survivable: bool) -> None:
    """The rank: tell its supervisor its task, and whether the run goes on without it
    (``survivable``) should it die by a signal. Nothing where it is not supervised."""
    fd = os.environ.get(FD_VARIABLE, "")
    if not fd.isdigit():
        return
    with contextlib.suppress(OSError):
        os.write(int(fd), json.dumps({"task": task, "survivable": survivable}).encode() + b"\n")


def supervised() -> bool:
    """Whether this rank runs under a supervisor (see supervise)."""
    return os.environ.get(FD_VARIABLE, "").isdigit()


def shim(child: int, told: int) -> None:
    """The supervisor's loop: pass signals on to the rank ``child``, wait for it, and exit
    as it did (see the module's docstring); ``told``: the pipe the rank tells it on."""

    def relay(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            os.kill(child, signum)

    for sig in RELAYED:
        signal.signal(sig, relay)
    _, status = os.waitpid(child, 0)  # (PEP 475: retried after each relayed signal)
    code = os.waitstatus_to_exitcode(status)
    said = _said(told) if code != 0 else {}
    record = {
        "rank": int(os.environ.get("PMI_RANK", "-1")),
        "task": said.get("task", ""),
        "pid": child,
        "host": socket.gethostname(),
    }
    if code >= 0:
        if code != 0:  # for mpips.launch --restarts, to name the rank that failed
            _record({**record, "code": code}, "exit")
        os._exit(code)
    signum = -code
    record.update(signal=signum, survivable=bool(said.get("survivable")))
    _record(record)
    if said.get("survivable"):
        os._exit(128 + signum)
    task = record["task"] or "task unknown"
    who = f"rank {record['rank']} ({task}, pid {child} on {record['host']})"
    _say(f"mpips: {who} was killed by signal {signum} ({_signal_name(signum)}); the job ends")
    with contextlib.suppress(OSError, ValueError):  # (SIGKILL's is the default already)
        signal.signal(signum, signal.SIG_DFL)  # the launcher ends the job, as without this
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _said(fd: int) -> dict:
    """What the rank told (its last line), {} if nothing."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(fd, 4096):
            data += chunk
    lines = [line for line in data.splitlines() if line.strip()]
    try:
        said = json.loads(lines[-1]) if lines else {}
    except ValueError:
        return {}
    return said if isinstance(said, dict) else {}


def _record(record: dict, kind: str = "lost") -> None:
    """``lost-RANK.json`` (killed by a signal) or ``exit-RANK.json`` (a failure code) in
    MPIPS_OUTCOME_DIR, for mpips.launch (best effort)."""
    folder = os.environ.get("MPIPS_OUTCOME_DIR", "")
    if not folder:
        return
    path = Path(folder) / f"{kind}-{record['rank']}.json"
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, (text + "\n").encode(errors="backslashreplace"))

"""What is left of a launcher's hosts after a node is lost (``python -m mpips.launch
--restarts N``): before a restart, each host of an ``mpiexec -hosts a:2,b:2`` command (or of
its host file, ``-f FILE``) is asked whether it still answers, through the launcher's own
remote shell (``ssh``, or its ``-launcher-exec``); the restart runs on the hosts that do
(named the same way: a new host file for ``-f``), with as many fewer ranks as the others
had. Checkpoints restore on any layout, so the run resumes there; a job whose
layout does not fit fewer ranks says so and stops (exit 2, not restarted).

Standard library only: mpips.launch holds no MPI.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

HOST_FLAGS = ("-hosts", "-host")
FILE_FLAGS = ("-f", "-hostfile", "-machinefile")
COUNT_FLAGS = ("-n", "-np")
# mpiexec's options that take values (how many), to find where its own options end
TAKES = {
    **dict.fromkeys(HOST_FLAGS + COUNT_FLAGS, 1),
    **dict.fromkeys(("-launcher", "-launcher-exec", "-f", "-hostfile", "-machinefile"), 1),
    **dict.fromkeys(("-ppn", "-wdir", "-bind-to", "-map-by", "-iface", "-genvlist"), 1),
    **dict.fromkeys(("-envlist", "-configfile"), 1),
    **dict.fromkeys(("-genv", "-env"), 2),
}
ANSWER_SECONDS = 10.0  # a host that does not answer within this is lost


def options(command: Sequence[str]) -> dict[str, int]:
    """The launcher's own options (before the program it runs): flag -> index of its value."""
    out, i = {}, 1
    while i < len(command) and command[i].startswith("-"):
        out[command[i]] = i + 1
        i += 1 + TAKES.get(command[i], 0)
    return out


def answers(shell: str, host: str) -> bool:
    """Whether ``host`` runs a command through ``shell`` (ssh, or the launcher's own)."""
    probe = [shell, "-o", "BatchMode=yes", "-o", "ConnectTimeout=5", host, "true"]
    try:
        r = subprocess.run(
            probe, stdin=subprocess.DEVNULL, capture_output=True, timeout=ANSWER_SECONDS
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def on_what_is_left(command: Sequence[str], prog: str) -> tuple[list[str], str]:
    """``command`` for a restart on the hosts that still answer, and the line that says so;
    the command as it was and "" where it names no hosts (-hosts, or a host file it can
    read), every host answers, none does, or the count of ranks (-n) cannot be made
    smaller."""
    command = list(command)
    found = options(command)
    at = next((found[f] for f in HOST_FLAGS if f in found), None)
    listed = next((found[f] for f in FILE_FLAGS if f in found), None)
    count = next((found[f] for f in COUNT_FLAGS if f in found), None)
    if count is None or count >= len(command) or not command[count].isdigit():
        return command, ""
    if at is not None and at < len(command):
        hosts = [h for h in command[at].split(",") if h]
    elif listed is not None and listed < len(command):
        hosts = _host_file(command[listed])
    else:
        return command, ""
    if len(hosts) < 2:
        return command, ""
    shell = command[found["-launcher-exec"]] if "-launcher-exec" in found else "ssh"
    with ThreadPoolExecutor(min(len(hosts), 32)) as pool:  # (each may take ANSWER_SECONDS)
        answered = list(pool.map(lambda h: answers(shell, _host(h)), hosts))
    alive = [h for h, ok in zip(hosts, answered, strict=True) if ok]
    if not alive or len(alive) == len(hosts):
        return command, ""
    ranks = int(command[count])
    left = _ranks_on(alive, hosts, ranks)
    if left < 1:
        return command, ""
    lost = ", ".join(_host(h) for h in hosts if h not in alive)
    if at is not None:
        command[at] = ",".join(alive)
    else:
        assert listed is not None
        command[listed] = _write_host_file(alive)
    command[count] = str(left)
    return command, (
        f"{prog}: {lost} did not answer ({shell}): the restart runs on "
        f"{', '.join(_host(h) for h in alive)} with {left} ranks instead of {ranks} "
        f"(checkpoints restore on any layout)"
    )


def _host(entry: str) -> str:
    """The host of a -hosts entry or a host file's line (``host[:slots] [options]``)."""
    return entry.split()[0].split(":")[0]


def _slots(entry: str) -> str:
    """The slots of such an entry ("" where it gives none)."""
    first = entry.split()[0]
    return first.split(":", 1)[1] if ":" in first else ""


def _host_file(path: str) -> list[str]:
    """The lines of an MPICH host file that name a host (``host[:slots] [options]``; #
    comments dropped); none if it is not a regular file or cannot be read."""
    if not os.path.isfile(path):  # (a FIFO would block the restart)
        return []
    try:
        with open(path) as f:
            lines = f.read(1 << 20).splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [kept for line in lines if (kept := line.split("#", 1)[0].strip())]


def _write_host_file(hosts: list[str]) -> str:
    """A new host file of ``hosts`` (in the temporary directory: only mpiexec reads it)."""
    fd, path = tempfile.mkstemp(prefix="mpips-hosts-left-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{h}\n" for h in hosts))
    return path


def _ranks_on(alive: list[str], hosts: list[str], ranks: int) -> int:
    """How many ranks the hosts ``alive`` take: their slots (``host:slots``, at most
    ``ranks``), or an equal share of ``ranks`` each where the hosts give none."""
    if all(_slots(h).isdigit() for h in hosts):
        return min(ranks, sum(int(_slots(h)) for h in alive))
    return ranks * len(alive) // len(hosts)

"""Survive mode (``python -m mpips.launch``): find the ranks that died, and let the run go
on without a dead worker where it can.

A rank killed outright under a supervisor (mpips/process/supervise.py) leaves the others
running. MPICH then lists it in ``MPIX_Comm_get_failed`` (called here through ctypes: mpi4py
does not wrap it), at once and for ~0.2 ms a call, so the watchdogs ask at most every
CHECK_SECONDS. A dead worker is declared lost in the control words (RunControl.declare_lost:
its claimed step is issued again to a survivor; a lost chief's duties pass to the lowest
live worker, ``acting_chief``); any other death (a PS task), or any death where the run
cannot go on in place, ends the job
(RankLost). In place means async or sync_replicas training: on one node with zero copy (the
updates applied in place, the control words in shared memory: MPI's own atomics into a
same-node window can stay locked for good when a rank dies inside one, so copied pulls on
one node are not survived), or on several nodes, where the updates and the control words
move through MPI (a dead worker's claims and last step are marked there too: two more MPI
atomics a step, in survive mode only).

After a loss no rank may enter a collective over a communicator with the dead member, nor
free a window or communicator, nor call MPI_Finalize: each would wait for the dead rank
forever. The survivors gather over a communicator of their own (``survivors``), then leave
with ``os._exit`` (mpips/cli.py). Hydra answers each death, and each such departure, with a
SIGUSR1 to the node's other ranks: ``notice`` tells it from a preemption request.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from mpi4py import MPI

from ..errors import MpipsError
from ..placement.layout import Layout
from ..process import failure, signals, supervise
from ..process.log import log
from .cluster import allgather_json, start_timeout, wait

CHECK_SECONDS = 0.5  # MPIX_Comm_get_failed at most this often from a watchdog
NOTICE_SECONDS = 5.0  # a SIGUSR1 this soon after a death was seen is hydra's notice of it


class RankLost(MpipsError):
    """A rank died, and the run cannot go on without it."""

    exit_code = 1


class Survival:
    """This process's survive mode: on (``active``) once ``begin`` found the rank supervised;
    ``survivable``: a dead worker other than the chief costs its step, not the job."""

    def __init__(self) -> None:
        self.active = False
        self.survivable = False
        self.comm: MPI.Intracomm | None = None
        self.layout: Layout | None = None
        self.lib: Any = None
        self.who: list[Any] = []  # [host, pid] of each rank
        self.seen: dict[int, float] = {}  # dead rank -> when it was first seen
        self.judged: set[int] = set()  # dead ranks a watchdog has dealt with (check)
        self.next_check = 0.0
        self.departing = False  # after a loss: leave without MPI_Finalize

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


SURVIVAL = Survival()  # this process's: never rebound


def _library() -> Any:
    """libmpi with MPIX_Comm_get_failed, or None (not MPICH, or too old)."""
    paths = []
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "/libmpi" in line})
    except OSError:
        pass
    found = ctypes.util.find_library("mpi")
    for path in [*paths, *([found] if found else [])]:
        try:
            lib = ctypes.CDLL(path)
            lib.MPIX_Comm_get_failed  # noqa: B018 (raises AttributeError if missing)
            return lib
        except (OSError, AttributeError):
            continue
    return None


def refused(mode: str, one_node: bool, in_place: bool, shared_control: bool, lib: Any) -> str:
    """Why a dead worker would end this run even in survive mode ('' where it does not)."""
    if lib is None:
        return "this MPI cannot list dead ranks (MPIX_Comm_get_failed: MPICH only)"
    if mode not in ("async", "sync_replicas"):
        return f"train.mode = {mode!r} (async and sync_replicas only)"
    if one_node and mode == "async" and not in_place:
        return "the workers do not apply their updates in place (zero copy)"
    if one_node and not shared_control:
        return "MPIPS_SHARED_MEMORY=0"
    return ""


def begin(comm: MPI.Intracomm, layout: Layout, mode: str, windows: Any) -> None:
    """Every rank, once the windows exist (collective): survive mode on where this rank is
    supervised; rank 0 says, in one line, when a death would still end the job."""
    state = SURVIVAL
    state.reset()
    if not supervise.supervised():
        return
    state.active, state.comm, state.layout = True, comm, layout
    state.lib = _library()
    why = refused(
        mode, windows.one_node, windows.updates_in_place, windows.control_shared, state.lib
    )
    state.survivable = not why
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:  # (the lowest rank of each node names it)
        first = node.allreduce(comm.rank, op=MPI.MIN)
    finally:
        node.Free()
    ranks = allgather_json(
        comm, [socket.gethostname(), os.getpid(), first], "survive mode", start_timeout()
    )
    state.who = [r[:2] for r in ranks]
    role = layout.role(comm.rank)
    near = near_a_ps(layout, [r[2] for r in ranks]) if not windows.one_node else set()
    supervise.tell(str(role), state.survivable and role.job == "worker" and comm.rank not in near)
    if why and comm.rank == 0:
        log(role, f"survive mode off: {why}; a rank that dies ends the job")
    elif state.survivable and near and comm.rank == 0:
        log(
            role,
            f"survive mode: a worker on a PS task's node (rank {', '.join(map(str, sorted(near)))})"
            f" ends the job if it dies (MPICH's lock for one-sided calls within a node could "
            f"stay held); any other worker's death costs its step",
        )
    if state.survivable:
        signals.STATE.notice = notice


def near_a_ps(layout: Layout, nodes: list[int]) -> set[int]:
    """The workers on a node that holds a PS task (``nodes``: each rank's node, as the
    lowest rank on it). Their one-sided calls to that PS go through MPICH's shared-memory
    path, whose lock a rank killed inside a call can leave held (one node, copied pulls:
    5 of 8 trials stalled): such a worker's death is not survived in place."""
    ps_nodes = {nodes[r] for r in layout.ps_ranks}
    return {r for r in range(len(nodes)) if layout.role(r).job == "worker" and nodes[r] in ps_nodes}


def failed() -> set[int]:
    """The ranks of the run's communicator that MPI knows to be dead (or gone without
    MPI_Finalize)."""
    state = SURVIVAL
    if state.lib is None or state.comm is None:
        return set()
    lib, group = state.lib, ctypes.c_int(0)
    lib.MPIX_Comm_get_failed(ctypes.c_int(MPI._handleof(state.comm)), ctypes.byref(group))
    size = ctypes.c_int(0)
    lib.MPI_Group_size(group, ctypes.byref(size))
    out: set[int] = set()
    if size.value:
        mine = MPI._handleof(state.comm.Get_group())
        ranks = (ctypes.c_int * size.value)(*range(size.value))
        world = (ctypes.c_int * size.value)()
        lib.MPI_Group_translate_ranks(group, size, ranks, ctypes.c_int(mine), world)
        out = {r for r in world if r >= 0}
    lib.MPI_Group_free(ctypes.byref(group))
    return out


def name(rank: int) -> str:
    """``rank R (/job:worker/task:K, pid P on HOST)``."""
    state = SURVIVAL
    role = state.layout.role(rank) if state.layout else "?"
    host, pid = state.who[rank] if rank < len(state.who) else ("?", "?")
    return f"rank {rank} ({role}, pid {pid} on {host})"


def _due(state: Survival) -> bool:
    """Whether survive mode is on and a look at the dead ranks is due (at most every
    CHECK_SECONDS: a look costs ~0.2 ms); if so, the next one is CHECK_SECONDS away."""
    now = time.monotonic()
    if not state.active or now < state.next_check:
        return False
    state.next_check = now + CHECK_SECONDS
    return True


def check(control: Any) -> None:
    """A watchdog's look (at most every CHECK_SECONDS): a dead worker (the chief too) is
    declared lost (said once over the job) where the run can go on without it; any other
    death raises RankLost. Nothing outside survive mode."""
    state = SURVIVAL
    if not _due(state):
        return
    now, dead = time.monotonic(), failed()
    for rank in dead:
        state.seen.setdefault(rank, now)
    for rank in sorted(dead - state.judged):
        state.judged.add(rank)
        assert state.layout is not None
        role = state.layout.role(rank)
        if not (state.survivable and role.job == "worker"):
            what = "its PS memory" if role.job == "ps" else "it"
            raise RankLost(
                f"{name(rank)} died (killed or crashed): the run cannot go on without {what}; "
                f"ending the job"
            )
        step = control.global_step()
        if control.declare_lost(role.task):
            log(
                state.layout.role(state.comm.rank) if state.comm else role,
                f"lost {name(rank)} at global_step {step}: the job goes on without it",
            )


def chief_alive(chief_rank: int) -> None:
    """While the ranks wait for the chief to raise ready (at most every CHECK_SECONDS):
    RankLost if it died meanwhile (survive mode). A chief lost before training started
    cannot be taken over (it was initialising the variables): the job ends at once, not
    at the start-up limit, and ``mpips.launch --restarts N`` runs it again."""
    state = SURVIVAL
    if not _due(state):
        return
    if chief_rank in failed():
        raise RankLost(
            f"{name(chief_rank)}, the chief, died before training started (killed or "
            f"crashed): the run cannot go on without it; ending the job"
        )


def notice() -> bool:
    """For a SIGUSR1: whether it is hydra's notice of a death or departure (a rank was
    first seen dead within NOTICE_SECONDS, or is now), not a preemption request."""
    state = SURVIVAL
    now = time.monotonic()
    for rank in failed() - set(state.seen):
        state.seen.setdefault(rank, now)
    return any(now - t < NOTICE_SECONDS for t in state.seen.values())


def acting_chief(control: Any, num_workers: int) -> int:
    """The worker task that does the chief's duties: the lowest one not declared lost (0
    until the chief is lost; outside survive mode, always 0)."""
    if not SURVIVAL.survivable:
        return 0
    lost = set(control.lost_tasks())
    return next((t for t in range(num_workers) if t not in lost), 0)


def lost_ranks(control: Any) -> list[int]:
    """The world ranks of the workers declared lost (read from the control words)."""
    state = SURVIVAL
    if not state.survivable or state.layout is None:
        return []
    return [state.layout.rank_of("worker", t) for t in control.lost_tasks()]


def lost_rank(control: Any, task: int) -> dict[str, Any]:
    """What the run knows of lost worker ``task``: its rank, task, pid, host, the last
    global step it counted and its signal or exit code (from its supervisor's record in
    MPIPS_OUTCOME_DIR, where it can be read; else None: killed or crashed)."""
    state = SURVIVAL
    assert state.layout is not None
    rank = state.layout.rank_of("worker", task)
    host, pid = state.who[rank] if rank < len(state.who) else (None, None)
    said: dict[str, Any] = {}
    folder = os.environ.get("MPIPS_OUTCOME_DIR", "")
    if folder:
        with contextlib.suppress(OSError, ValueError):
            said = json.loads((Path(folder) / f"lost-{rank}.json").read_text())
    return {
        "rank": rank,
        "task": f"/job:worker/task:{task}",
        "pid": pid,
        "host": host,
        "last_step": control.last_step(task),
        "signal": said.get("signal"),
    }


def survivors(comm: Any, dead: list[int], dead_ranks: list[int]) -> MPI.Intracomm:
    """A communicator of ``comm``'s ranks but ``dead`` (collective over the survivors only:
    a dead member would hang any collective over ``comm``). ``dead_ranks``: the same, as
    ranks of the run's communicator; any other rank dead by now (one that died after its
    last step) ends the job, RankLost, rather than hang the survivors."""
    late = sorted(failed() - set(dead_ranks))
    if late:
        raise RankLost(
            f"{', '.join(map(name, late))} died at the end of the run (killed or crashed); "
            f"ending the job"
        )
    group = comm.Get_group()
    alive = group.Excl(sorted(dead)) if dead else group
    try:
        return comm.Create_group(alive, tag=7103)
    finally:
        if alive is not group:
            alive.Free()
        group.Free()


def ending() -> None:
    """Every rank, at the end of the run, before the end barrier: a supervised rank ignores
    SIGUSR1 from now on. Under -disable-auto-cleanup hydra raises one on the node whenever
    a rank's connection closes, even after MPI_Finalize, and Python puts a signal's default
    action (the end of the process) back before mpi4py finalizes MPI."""
    if supervise.supervised():
        signals.STATE.depart()


def last_meeting(comm: MPI.Intracomm, dead: list[int], timeout: float) -> None:
    """Every survivor, at the end of a run that lost ranks ``dead``: SIGUSR1 ignored from
    now on (hydra raises one at each rank that leaves without MPI_Finalize), then a barrier
    of the survivors (within ``timeout`` s), so that nobody leaves before all are done.
    The rank then leaves with os._exit (``leave``: mpips/cli.py)."""
    survivors_comm = survivors(comm, dead, dead)
    SURVIVAL.departing = True
    signals.STATE.depart()
    wait(survivors_comm.Ibarrier(), "the end of the run", timeout)


def write_outcome(result: Any, target: int | None) -> None:
    """The chief, survive mode: ``outcome.json`` in MPIPS_OUTCOME_DIR for mpips.launch's
    verdict (the global step reached, the target, the workers lost). Best effort."""
    folder = os.environ.get("MPIPS_OUTCOME_DIR", "")
    if not folder:
        return
    outcome = {
        "global_step": result.global_step,
        "target": target,
        "reached": not result.stopped_by and (target is None or result.global_step >= target),
        "stopped_by": result.stopped_by,
        "lost": result.lost or [],
    }
    path = Path(folder) / "outcome.json"
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(outcome))
        tmp.replace(path)


def leave(code: int) -> NoReturn:
    """After a loss: end this rank now, with ``code``, its output flushed, without
    MPI_Finalize, which would wait for the dead rank forever (atexit handlers do not run)."""
    failure.leaving(failure.BYE)
    failure.unlink_runtime_shm()  # (MPICH removes its node's file in MPI_Finalize only)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code)

"""PS memory: one byte-addressed ``MPI.Win.Allocate`` window per PS rank, plus small int64
windows for the mailboxes (one per PS) and the control counters (on ps task 0).

A PS window holds ``[variables | table partitions | optimizer slots | one gradient inbox per
worker]``; the inboxes exist only for stateful optimizers, which the PS applies itself (plain
SGD is Accumulated). What an inbox holds, and the mail window's words, are laid out in
inbox.py (the mailbox protocol, mailbox.py, uses them). With zero copy (``shared``) the
windows are MPI shared memory and the workers apply every update in place under lock
words (stripes.py): no inboxes. Those words are a shared-memory window of their own,
LOCKS_PER_PS int64 words on each PS rank, taken and given back with the CPU's atomics
(atomics.py), never through MPI.

Every rank opens one ``Lock_all`` epoch per window for the whole run and completes each
operation with ``Flush``: with MPICH a Lock/Unlock per operation waits for the (sleeping)
PS to make an MPI call, 300-500 us per op instead of ~2 us.

MPICH puts every window a node's ranks allocate in its /dev/shm, copied pulls' too, and a
process that touches such memory past the end of /dev/shm dies of SIGBUS. Where a node's
/dev/shm cannot hold its windows with a quarter to spare, the parameter windows of copied
pulls are in each PS's private memory instead (``Alloc_mem``, ``Win.Create``): MPI then
moves their bytes only while the PS is inside an MPI call (a thread of its own enters it,
_Progress), 2-8x slower, so only then. Zero copy reads the PS memory in place and needs
MPI's shared memory: without room, it is refused at start-up (``plan_memory``).
"""

from __future__ import annotations

import atexit
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from mpi4py import MPI

from ..errors import AgreedError
from ..placement.layout import Layout, Role
from ..placement.table import Placement, views
from ..process import settings
from ..process.log import log
from ..process.memory import (
    SHM_DIR,
    SHM_REMEDY,
    SHM_SPARE,
    human,
    shared_memory_fits,
    shared_memory_free,
)
from . import atomics
from .cluster import allgather_json, barrier, check_arrival

if TYPE_CHECKING:
    from .lookups import Lookups
from .inbox import Inbox, mail_words

# control window on ps task 0: int64 counters, then per PS task the number of the last
# checkpoint request it wrote its shard for, then the per-worker words (WORDS_PER_WORKER
# arrays of one word a worker) and the count of steps to issue again (survive mode)
GLOBAL_STEP, TICKETS, READY, STOP, CKPT_SEQ, CKPT_STEP, ENDED, FAILED, SHARDS = range(9)
# per worker: its clock, done flag, steps claimed and not yet counted, last step counted
WORDS_PER_WORKER = 4
LOCKS_PER_PS = 16  # lock words per PS task (stripes.py: word 0 for small pieces and rows)
# a PS whose window is in private memory enters MPI PROGRESS_CALLS times in a row every
# PROGRESS_SECONDS, and again at once while they take BUSY times their idle cost (a pull or
# push under way: each call moves a few KB of it). Measured, a 16 MiB pull by one worker:
# 0.02 GB/s with one call a wake, 0.23 with eight, 4-5 going on while busy (10-11 from
# /dev/shm); idle, the thread takes ~8% of a core (_Progress)
PROGRESS_SECONDS, PROGRESS_CALLS, BUSY = 2e-4, 8, 2.0
_PROGRESS_TAG = 7102  # never sent: the Iprobe only lets MPI make progress


def updates_in_place(placement: Placement, shared: bool) -> bool:
    """Whether the workers apply their own updates in the PS tasks' memory (stripes.py):
    zero copy (``shared`` windows), unless a dense variable is split over PS tasks (those keep
    the PS path: Accumulate, or the mailbox for stateful optimizers)."""
    return shared and all(e.whole is None or e.table for e in placement)


def has_inboxes(placement: Placement, shared: bool, ps_applies: bool) -> bool:
    """Whether the PS windows hold a gradient inbox per worker: where a PS task applies the
    updates (``ps_applies``: stateful optimizers, sync_replicas), unless the workers apply
    them in place (zero copy)."""
    return ps_applies and not updates_in_place(placement, shared)


class WindowPlan:
    """What the windows hold and where, from the placement alone (no MPI): sizes and offsets
    every rank computes identically, and what each rank will allocate."""

    def __init__(self, placement: Placement, slots: Placement | None = None, row_capacity: int = 0):
        self.placement = placement
        self.slots = slots
        self.row_capacity = row_capacity

    def state_bytes(self, task: int) -> int:
        """Bytes of variables plus slots on PS ``task``."""
        end = self.placement.ps_bytes(task)
        return max(end, self.slots.ps_bytes(task)) if self.slots else end

    def inbox(self, task: int) -> Inbox:
        """The layout of a worker's gradient inbox on PS ``task`` (inbox.py)."""
        return Inbox(self.placement, task, self.row_capacity)

    def inbox_offset(self, task: int, worker: int) -> int:
        """Byte offset of worker ``worker``'s gradient inbox in PS ``task``'s window."""
        return self.state_bytes(task) + worker * self.inbox(task).nbytes

    def window_bytes(self, task: int, workers: int, inboxes: bool) -> int:
        """The parameter window of PS ``task``: its state, then (``inboxes``) one inbox per
        worker."""
        return self.inbox_offset(task, workers) if inboxes else self.state_bytes(task)

    def rank_bytes(self, layout: Layout, inboxes: bool, shared: bool = False) -> list[int]:
        """What each rank allocates for the store: a PS its window, a worker its pull and
        push buffers (two copies of every whole variable; ``shared``, zero copy: the push
        buffers only, as it reads the PS's memory in place)."""
        dense = sum(self.placement.dense_bytes(p) for p in range(self.placement.num_ps))
        return [
            self.window_bytes(role.task, layout.num_workers, inboxes)
            if role.job == "ps"
            else dense * (1 if shared else 2)
            for role in map(layout.role, range(layout.world_size))
        ]


class Windows(WindowPlan):
    """The parameter, mailbox and control windows; created and freed collectively."""

    def __init__(
        self,
        comm: MPI.Intracomm,
        layout: Layout,
        placement: Placement,
        slots: Placement | None = None,
        inboxes: bool = False,
        row_capacity: int = 0,
        shared: bool = False,
        private: bool | None = None,
    ):
        """``shared``: the parameter windows are MPI shared memory (every rank of ``comm``
        on one node), so a worker can read a PS task's memory in place (``shared_memory``).
        ``private`` (copied pulls only): the parameter windows in the PS tasks' private
        memory, not MPI's; None: only where a node's /dev/shm lacks room (plan_memory)."""
        super().__init__(placement, slots, row_capacity)
        self.layout = layout
        self.shared = shared
        self.inboxes = inboxes  # the PS tasks apply the updates posted there
        self.updates_in_place = updates_in_place(placement, shared)
        self.clocks_at = SHARDS + layout.num_ps  # index of worker 0's clock
        role = layout.role(comm.rank)
        size, mail, control, locks = self._own_bytes(comm.rank)
        check_arrival(comm, "window creation")  # Allocate is a blocking collective
        # what MPICH puts in /dev/shm: the windows but the parameters of copied pulls,
        # which can go to private memory (the locks exist with zero copy only)
        must = mail + control + (size + locks if shared else 0)
        private = self._on_the_node(comm, role, must, 0 if shared else size, private)
        self.params = self._params_window(comm, size, private)
        self.mail = MPI.Win.Allocate(mail, disp_unit=8, comm=comm)
        if self.control_shared:
            self.control = _aligned_shared(comm, control)
        else:
            self.control = MPI.Win.Allocate(control, disp_unit=8, comm=comm)
        self.control_rank = layout.ps_ranks[0]
        self.locks = _aligned_shared(comm, locks) if shared else None
        self._open_epochs()
        self._open = True
        self.lookups: Lookups | None = None  # dynamic tables' window, if any (open_store)
        barrier(comm, "window creation")  # nobody reads a counter before its owner zeroed it

    def _own_bytes(self, rank: int) -> tuple[int, int, int, int]:
        """What ``rank`` allocates of each window, in bytes: its parameter window, its
        mailbox, the control counters and its lock words."""
        layout = self.layout
        role = layout.role(rank)
        workers = layout.num_workers
        is_ps = role.job == "ps"
        size = self.window_bytes(role.task, workers, self.inboxes) if is_ps else 0
        mail = mail_words(workers) * 8 if is_ps and self.inboxes else 0
        words = self.clocks_at + WORDS_PER_WORKER * workers + 1  # (+ the reissued steps)
        control = words * 8 if rank == layout.ps_ranks[0] else 0
        locks = LOCKS_PER_PS * 8 if is_ps else 0
        return size, mail, control, locks

    def _on_the_node(
        self, comm: MPI.Intracomm, role: Role, must: int, movable: int, private: bool | None
    ) -> bool:
        """What this rank's node allows (collective): ``one_node`` and ``control_shared``
        set, and whether the parameter windows go to private memory (``private`` None: as
        the nodes' /dev/shm says, from the bytes that ``must`` go there and those that are
        ``movable``)."""
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.one_node = node.size == comm.size  # every rank shares this node's memory
        # on one node the counters are shared memory, moved with the CPU's atomics (control.py);
        # every rank must agree (MPIPS_SHARED_MEMORY is read by each)
        mine = self.one_node and settings.current().shared_memory
        self.control_shared = bool(comm.allreduce(int(mine), op=MPI.MIN))
        try:
            if private is None:
                private = _private_params(comm, node, role, must, movable, self.shared)
        finally:
            node.Free()
        return private

    def _open_epochs(self) -> None:
        """Every window zeroed here and its one ``Lock_all`` epoch for the run opened."""
        for win in self._wins:
            self.local(win)[:] = 0
            win.Lock_all(MPI.MODE_NOCHECK)
        if self.control_shared or self.shared:
            # loaded before the barrier (where numba is the path, compiled: ~1 s on a cold
            # cache), so no rank starts training while another still compiles, and none
            # compiles while holding a lock word. (A fused optimizer kernel may start loading
            # in the background while a worker holds one, once a process: its numba import
            # holds the GIL, so that stripe's holder can take ~0.1 s longer; optim.py)
            atomics.warm()

    def _params_window(self, comm: MPI.Intracomm, size: int, private: bool) -> MPI.Win:
        """The parameter window, ``size`` bytes on this rank: MPI shared memory (zero copy),
        MPI's memory, or (``private``, copied pulls) this process's own, whose bytes MPI
        moves only in its MPI calls (_Progress makes them)."""
        self.private = private and not self.shared
        self._memory = MPI.Alloc_mem(size) if self.private and size else None
        self._progress = _Progress(comm, bool(size)) if self.private else None
        if self.private:
            return MPI.Win.Create(self._memory, disp_unit=1, comm=comm)
        allocate = MPI.Win.Allocate_shared if self.shared else MPI.Win.Allocate
        return allocate(size, disp_unit=1, comm=comm)

    @property
    def _wins(self) -> tuple[MPI.Win, ...]:
        locks = [] if self.locks is None else [self.locks]
        return self.params, self.mail, self.control, *locks

    def control_words(self) -> atomics.Words:
        """The control counters, in this process's address space (``control_shared`` only;
        touched only through the CPU's atomics)."""
        assert self.control_shared
        return _words(self.control, self.control_rank)

    def lock_words(self, ps_task: int) -> atomics.Words:
        """PS task ``ps_task``'s LOCKS_PER_PS lock words, in this process's address space
        (zero copy only; touched only through the CPU's atomics)."""
        assert self.locks is not None
        return _words(self.locks, self.layout.ps_ranks[ps_task])

    def local(self, win: MPI.Win) -> np.ndarray:
        """This rank's own memory of ``win`` as bytes (empty where it holds none)."""
        # mpi4py's stub gives MPI.buffer its __buffer__ only for Python >= 3.12
        return np.frombuffer(win.tomemory(), dtype=np.uint8)  # type: ignore[call-overload]

    def shared_memory(self, rank: int) -> np.ndarray:
        """The bytes of ``rank``'s parameter window, in this process's address space
        (shared windows only): loads and stores there reach that rank's memory."""
        assert self.shared
        return _shared_bytes(self.params, rank)

    def held(self, task: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """PS ``task`` (this rank): views of the variables and slots in its own memory, by
        variable name (a partition by its whole variable's name)."""
        bufs = [self.local(self.params)] * self.placement.num_ps
        return views(self.placement, bufs, only_ps=task, by_name=True), views(
            self.slots, bufs, only_ps=task, by_name=True
        ) if self.slots else {}

    def fill_own(self, task: int, values: dict[str, Any]) -> None:
        """PS ``task`` (this rank): write ``values`` (by variable or slot name: an array, or
        a callable that fills the view it is given) into its own memory before training,
        made visible to every later access."""
        for held in self.held(task):
            for name, view in held.items():
                if name not in values:
                    continue
                if callable(values[name]):
                    values[name](view)
                else:
                    view[...] = values[name]
        self.params.Sync()

    def free(self) -> None:
        """Close the epochs and free the windows (collective). Safe to call twice."""
        if not self._open:
            return
        self._open = False
        if self.lookups is not None:
            self.lookups.free()
        if self._progress is not None:
            self._progress.close()
        for win in self._wins:
            win.Unlock_all()
            win.Free()
        if self._memory is not None:  # (after the window that exposed it)
            MPI.Free_mem(self._memory)
            self._memory = None


def plan_memory(nodes: list[list[int]], shared: bool) -> tuple[bool, str]:
    """Where the windows go, from each rank's ``[must, movable, free]``: the bytes its
    node's ranks put in /dev/shm in all (``must``: what has to be MPI shared memory;
    ``movable``: the parameters of copied pulls, which private memory can hold instead) and
    the bytes free there. Returns whether the parameter windows go to private memory, and
    why it cannot work at all ('' where it can): a node's /dev/shm lacks room for what must
    be shared (``shared``: zero copy's parameters among them)."""
    private = any(not shared_memory_fits(m + v, free) for m, v, free in nodes)
    short = [(m, free) for m, _, free in nodes if not shared_memory_fits(m, free)]
    if not short:
        return private, ""
    must, free = short[0]
    if not shared:
        return private, f"{_short_of('the store counters need', must, free)}: {SHM_REMEDY}"
    what = "train.zero_copy: the PS memory the workers read in place needs"
    fix = f"set train.zero_copy = false for copied pulls, or {SHM_REMEDY}"
    return private, f"{_short_of(what, must, free)}: {fix}"


def _short_of(what: str, need: int, free: int) -> str:
    """``what`` (with its verb) lacks ``need`` bytes in /dev/shm, as every message says it."""
    return (
        f"{what} {human(need * SHM_SPARE)} of MPI shared memory in a node's {SHM_DIR} "
        f"({human(need)} and a quarter to spare), which has {human(free)} free"
    )


def _private_params(
    comm: MPI.Intracomm, node: MPI.Comm, role: Role, must: int, movable: int, shared: bool
) -> bool:
    """Every rank of ``comm`` alike (the windows are created by the same collective):
    whether the parameter windows go to the PS tasks' private memory, as every node's
    /dev/shm says (plan_memory); refused on every rank (AgreedError) where nothing can
    work. The chief says so where they go there (pulls and pushes are slower there). A
    rank alone on its node puts nothing in /dev/shm."""
    rows = allgather_json(node, [must, movable], "the /dev/shm check")
    need = [sum(r[i] for r in rows) if node.size > 1 else 0 for i in (0, 1)]
    free = shared_memory_free(sum(need))
    nodes = allgather_json(comm, [*need, free], "the /dev/shm check")
    private, error = plan_memory(nodes, shared)
    short = next((n for n in nodes if not shared_memory_fits(n[0] + n[1], n[2])), None)
    said = short and _short_of("the PS memory needs", short[0] + short[1], short[2])
    if said and not error and MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        error = f"{said}, and private memory needs MPI_THREAD_MULTIPLE: {SHM_REMEDY}"
    if error:
        raise AgreedError(error)
    if said and role.is_chief:
        log(
            role,
            f"{said}: it is in the PS tasks' private memory instead, where pulls and pushes "
            f"are several times slower ({SHM_REMEDY})",
        )
    return private


class _Progress:
    """Where the parameter windows are in private memory, a PS task's thread that enters
    MPI every PROGRESS_SECONDS, and on at once while a pull or push is under way (``active``:
    a rank that holds such memory): MPICH moves the bytes of such a window only in its
    owner's MPI calls, and a PS waits for the ready flag, and does its chores, in shared
    memory without one."""

    def __init__(self, comm: MPI.Comm, active: bool):
        self.comm = comm.Dup()  # (collective)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mpips-ps-progress", daemon=True)
        if active:
            self._thread.start()
            atexit.register(self._halt)  # before MPI_Finalize (mpi4py's, registered earlier)

    def _run(self) -> None:
        idle = min(self._calls() for _ in range(5))  # (no window yet: nothing to move)
        while not self._closed.is_set():
            if self._calls() < BUSY * idle:
                time.sleep(PROGRESS_SECONDS)

    def _calls(self) -> float:
        """Enter MPI PROGRESS_CALLS times; the seconds it took."""
        began = time.perf_counter()
        for _ in range(PROGRESS_CALLS):
            self.comm.Iprobe(MPI.ANY_SOURCE, _PROGRESS_TAG)
        return time.perf_counter() - began

    def _halt(self) -> None:
        self._closed.set()
        if self._thread.is_alive():
            self._thread.join()

    def close(self) -> None:
        """Stop the thread and free its communicator (collective)."""
        self._halt()
        atexit.unregister(self._halt)
        self.comm.Free()


class Exposed:
    """Arrays of this rank that the other ranks of ``comm`` read one-sided, when they need
    them, while this rank goes on with its own work (its MPI calls make the progress): a sync
    replica's parts of the optimizer slots, which the chief fetches for a checkpoint. Every
    rank exposes arrays of the same layout."""

    def __init__(self, comm: MPI.Intracomm, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.windows = [MPI.Win.Create(a, a.itemsize, comm=comm) for a in arrays]

    def fetch(self, rank: int, ranges: list[tuple[int, int]]) -> None:
        """Copy elements ``[start, stop)`` of each array of ``rank`` into this rank's own."""
        for win, a in zip(self.windows, self.arrays, strict=True):
            win.Lock(rank, MPI.LOCK_SHARED)
            for start, stop in ranges:
                if stop > start:
                    win.Get(a[start:stop], rank, start)
            win.Unlock(rank)

    def free(self) -> None:
        """Free the windows (collective)."""
        for win in self.windows:
            win.Free()
        self.windows = []


class NodeShared:
    """MPI shared memory on one node: each rank of ``comm`` allocates a segment of its own,
    and every rank loads and stores every segment in place (``segment``). ``sync`` is the
    memory barrier to put on both sides of the barrier that orders one rank's stores before
    another's loads. A sync replica's gradients, and the one copy of the variables and
    slots the replicas of a node share."""

    def __init__(self, comm: MPI.Intracomm, nbytes: int):
        self.win = MPI.Win.Allocate_shared(nbytes, disp_unit=1, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # Win_sync needs a passive-target epoch
        self.segment(comm.rank)[:] = 0

    def segment(self, rank: int) -> np.ndarray:
        """The bytes of ``rank``'s segment, in this process's address space."""
        return _shared_bytes(self.win, rank)

    def sync(self) -> None:
        self.win.Sync()

    def free(self) -> None:
        """Free the memory (collective); no view of it may be used after."""
        self.win.Unlock_all()
        self.win.Free()


def _aligned_shared(comm: MPI.Intracomm, nbytes: int) -> MPI.Win:
    """A shared-memory window of int64 words, ``nbytes`` on this rank, each rank's part on
    pages of its own (so the words are aligned for the CPU's atomics)."""
    info = MPI.Info.Create()
    info.Set("alloc_shared_noncontig", "true")
    win = MPI.Win.Allocate_shared(nbytes, disp_unit=8, info=info, comm=comm)
    info.Free()
    return win


def _words(win: MPI.Win, rank: int) -> atomics.Words:
    """``rank``'s part of a window made by ``_aligned_shared``, as int64 words for the CPU's
    atomics (aligned: each rank's part is on pages of its own)."""
    return atomics.Words(_shared_bytes(win, rank).view(np.int64))


def _shared_bytes(win: MPI.Win, rank: int) -> np.ndarray:
    """``rank``'s memory of the shared-memory window ``win``, in this process's address space:
    loads and stores there reach that rank's memory."""
    buf, _ = win.Shared_query(rank)
    return np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]

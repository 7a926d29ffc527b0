"""PS side of the store.

Plain SGD needs no PS code: Accumulate is atomic per element, so the PS only keeps its window
alive, asleep, until the chief ends the run. For stateful optimizers the PS applies the rule
itself: it watches its mailbox, applies each posted gradient to its own variables and slots
(in place, in window memory), and clears the flag. Busy, it polls every 50-200 us; idle for
0.1 s, it backs off to 1 ms sleeps; it never blocks the workers' windows (MPI progress
happens in the poll).

With ``train.zero_copy`` the workers apply every update themselves, in the PS's shared
memory (stripes.py), and the PS serves as for plain SGD.

In every case the PS also answers the chief's checkpoint requests (it writes the shard it
holds, in parallel with the other PS tasks), forwards a preemption signal it receives, and
watches the workers' clocks: a worker hung mid-run, or a chief that never ends the run, ends
the job with a message naming it (the PS waits for the whole run, so its wait is policed by
this watchdog rather than a fixed deadline).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
from mpi4py import MPI

from ..errors import AlreadyReported, NonFinite
from ..process.log import log
from ..process.waits import poll
from . import liveness
from .cluster import POLL_SECONDS, Cluster, start_limit, unreachable
from .control import RunControl
from .lookups import DynamicServer
from .mailbox import PsMail
from .rules import Apply, apply_rows
from .watchdog import Watchdog
from .window import Windows

BUSY_POLL_SECONDS = 5e-5  # right after an update
WARM_POLL_SECONDS = 2e-4  # busy within the last WARM_SECONDS: the next push is coming soon
WARM_SECONDS = 0.1
_PROGRESS_TAG = 7999  # never sent: an Iprobe for it only lets MPI make progress
CHORE_SECONDS = 5e-3  # how often a PS looks for a checkpoint request or the end of the run

WriteShard = Callable[[int, dict[str, np.ndarray], dict[str, np.ndarray]], None]


def serve(
    cluster: Cluster,
    windows: Windows,
    apply: Apply | None = None,
    slot_names: Sequence[str] = (),
    write_shard: WriteShard | None = None,
    stop_requested: Callable[[], int] = lambda: 0,
    aggregate: StepPolicy | None = None,
    on_applied: Callable[[int], None] | None = None,
    dynamic: DynamicServer | None = None,
) -> int:
    """Serve this PS task from the chief's ready flag until the chief ends the run
    (RunControl.end_run); returns the updates applied.

    ``apply``: the rule of a stateful optimizer, applied here to every update a worker posts
    to the mailbox (None: plain SGD, which the workers Accumulate themselves), with the
    slots ``slot_names`` of each variable (``<variable>/<slot>`` in the window).
    ``write_shard(step, variables, slots)`` writes this PS's checkpoint shard when the chief
    asks for one; ``stop_requested()``, a signal number (0: none), is passed on to the whole
    job as a stop at the next step (preemption). ``aggregate`` (sync_replicas): hand it
    each gradient posted for this PS's current step, and advance the step once it applied
    the step's; gradients that come later for an older step are dropped.
    ``on_applied(step)`` is called after each update this PS applies (summaries).
    ``dynamic``: this task's dynamic tables, whose lookups and pushes it answers too.
    """
    control = RunControl(windows)
    task = cluster.role.task
    watchdog = Watchdog(control, cluster.layout, cluster.layout.num_workers + task, chief_ends=True)
    control.wait_ready(
        start_limit(cluster.layout.num_workers + task),
        lambda: _forward_signal(control, stop_requested),
    )
    chores = _Chores(control, windows, task, write_shard, watchdog, stop_requested)
    chores.dynamic = dynamic
    if apply is None and dynamic is not None:  # plain SGD: only the dynamic tables to serve
        return _dynamic_loop(chores, dynamic)
    if apply is None:
        # plain SGD: the workers' Gets and Accumulates need no PS code, but across nodes
        # (no shared memory) MPICH moves them only while the PS is inside MPI: enter it
        # every WARM_POLL_SECONDS (an Iprobe), not only at the chores' 5 ms (measured
        # over TCP at 10 Gbit/s, one worker: 2,855 -> 10,154 examples/s; docs/scaling.md)
        remote = not cluster.one_node

        def progress() -> None:
            cluster.comm.Iprobe(MPI.ANY_SOURCE, _PROGRESS_TAG)

        poll(
            chores.run,
            math.inf,
            unreachable,  # policed by the watchdog in chores.run
            progress,  # (on one node nearly free, and no MPI is ever left without progress)
            # on one node nothing waits for this PS but its chores: wake only for them
            max_sleep=WARM_POLL_SECONDS if remote else CHORE_SECONDS,
        )
        return 0
    if aggregate is not None:
        return _aggregate_loop(cluster, windows, aggregate, chores, on_applied or _nothing)
    return _apply_loop(cluster, windows, apply, slot_names, chores, on_applied or _nothing, dynamic)


class StepPolicy(Protocol):
    """What a PS does with the gradients posted for one step (sync_replicas: the mode's
    averaging, mpips.modes.sync_replicas); the store only moves and counts them."""

    per_step: int  # gradients a step takes (said in the log at the end)

    def add(self, grads: dict[str, np.ndarray]) -> bool:
        """Take one worker's gradients for the current step; True once the step has all."""
        ...

    def apply(self, lr: float, step: int) -> None:
        """Apply the step's update (the PS's variables go from ``step`` to ``step + 1``)."""
        ...

    def shrink(self, live: int) -> bool:
        """Only ``live`` workers are left (the others died): a step takes at most that many
        gradients from now on; True if the current step has all it takes now."""
        ...


def _nothing(step: int) -> None:
    pass


def _forward_signal(control: RunControl, stop_requested: Callable[[], int]) -> None:
    """A signal on a PS stops the job like one on a worker."""
    signum = stop_requested()
    if signum and not control.stop_signal():
        control.request_stop(signum)


class _Chores:
    """What a PS does between updates: forward a signal it received to the whole job, write
    checkpoint shards, watch the workers, and notice the end of the run."""

    def __init__(
        self,
        control: RunControl,
        windows: Windows,
        task: int,
        write_shard: WriteShard | None,
        watchdog: Watchdog,
        stop_requested: Callable[[], int],
    ):
        self.control, self.windows, self.task = control, windows, task
        self.stop_requested = stop_requested
        self.write_shard = write_shard
        self.watchdog = watchdog
        self.served = 0  # checkpoint requests answered
        self.next_look = 0.0
        # applies every update already posted (async, stateful): run before a shard is
        # written, as a worker counts its update in global_step once it is posted
        self.drain: Callable[[], object] = lambda: None
        self.dynamic: DynamicServer | None = None  # told the global step (row ages)

    def run(self) -> bool:
        """Do what is due; True once the chief has ended the run."""
        _forward_signal(self.control, self.stop_requested)
        now = time.monotonic()
        if now < self.next_look:
            return False
        self.next_look = now + CHORE_SECONDS
        if self.dynamic is not None:
            self.dynamic.tick(self.control.global_step())
        if self.write_shard is not None:
            number, step = self.control.checkpoint_request()
            if number > self.served:
                self.drain()  # every update counted before the request is in the shard
                self._write(step)
                self.served = number
                self.control.shard_written(self.task, number)
        if self.control.run_ended():
            return True
        self.watchdog.check()
        return False

    def _write(self, step: int) -> None:
        """This PS's shard at ``step``. With zero copy the workers update its memory in
        place, so it holds every lock word of it meanwhile; where a copy fits in memory
        (SNAPSHOT_SHARE of what is available) it holds them only while it copies, and
        writes the copy with the workers training on (a CTR table's shard: ~150 ms of
        writing, a few ms of copying)."""
        write, held = self.write_shard, self.windows.updates_in_place
        assert write is not None
        if held:
            from .stripes import hold_ps, release_ps  # (zero copy only)

            hold_ps(self.windows, self.task)
        self.windows.params.Sync()  # see every Put and Accumulate that has landed
        try:
            variables, slots = self.windows.held(self.task)
            if held and _fits(variables, slots):
                variables = {k: v.copy() for k, v in variables.items()}
                slots = {k: v.copy() for k, v in slots.items()}
                release_ps(self.windows, self.task)
                held = False
            write(step, variables, slots)
        except NonFinite as e:  # said once, even if several PS tasks find it
            if self.control.claim_failure():
                raise
            raise AlreadyReported(str(e)) from e
        finally:
            if held:
                release_ps(self.windows, self.task)


SNAPSHOT_SHARE = 0.25  # a shard is copied to be written if it takes at most this share


def _fits(variables: dict[str, np.ndarray], slots: dict[str, np.ndarray]) -> bool:
    """Whether a copy of a PS's variables and slots fits in SNAPSHOT_SHARE of the memory
    available now (else it is written in place, the workers held meanwhile)."""
    from ..process.memory import available_bytes

    nbytes = sum(v.nbytes for v in variables.values()) + sum(v.nbytes for v in slots.values())
    return nbytes <= SNAPSHOT_SHARE * available_bytes()


class _Pace:
    """How a PS waits between two looks at its mail: right after an update it looks again
    soon (the next push is coming), backing off to WARM_POLL_SECONDS while pushes keep
    coming and to POLL_SECONDS (1 ms) when none came for WARM_SECONDS. (Yielding the core
    instead of sleeping while warm was measured: the CTR job lost 15%.)"""

    def __init__(self) -> None:
        self.sleep, self.last_busy = BUSY_POLL_SECONDS, 0.0

    def wait(self, busy: bool) -> None:
        now = time.monotonic()
        if busy:
            self.sleep, self.last_busy = BUSY_POLL_SECONDS, now
        else:
            cap = WARM_POLL_SECONDS if now - self.last_busy < WARM_SECONDS else POLL_SECONDS
            self.sleep = min(cap, self.sleep * 2)
        time.sleep(self.sleep)


def _dynamic_loop(chores: _Chores, dynamic: DynamicServer) -> int:
    """Plain SGD with dynamic tables: answer their lookups and pushes until the run ends."""
    chores.drain = dynamic.sweep
    pace = _Pace()
    while not chores.run():
        pace.wait(dynamic.sweep())
    return 0


def _apply_loop(
    cluster: Cluster,
    windows: Windows,
    apply: Apply,
    slot_names: Sequence[str],
    chores: _Chores,
    on_applied: Callable[[int], None],
    dynamic: DynamicServer | None,
) -> int:
    task = cluster.role.task
    variables, slot_views = windows.held(task)
    slots = {name: {s: slot_views[f"{name}/{s}"] for s in slot_names} for name in variables}
    mail, applied = PsMail(windows, task, cluster.rank), 0
    # t continues from the restored global_step, as published before the start barrier:
    # global_step itself counts updates when they are posted, maybe before this loop
    t = mail.published_step()
    workers = range(cluster.layout.num_workers)
    pace = _Pace()

    def sweep() -> bool:
        """Apply every update posted now; whether there was one."""
        nonlocal t, applied
        busy = dynamic.sweep() if dynamic is not None else False
        for k in workers:
            posted = mail.take(k)
            if posted is None:
                continue
            lr, grads, rows = posted
            t += 1
            for name, grad in grads.items():
                apply(variables[name], grad, slots[name], lr, t)
            for name, local, grad in rows:
                apply_rows(apply, variables[name], slots[name], local, grad, lr, t)
            mail.applied(k)
            on_applied(t)
            applied += 1
            busy = True
        return busy

    chores.drain = sweep
    while not chores.run():
        pace.wait(sweep())
    return applied


def _alive(control: RunControl) -> int:
    """How many workers are alive (survive mode; outside it, every worker is counted)."""
    if not liveness.SURVIVAL.survivable:
        return control.num_workers
    return control.num_workers - len(control.lost_tasks())


def _aggregate_loop(
    cluster: Cluster,
    windows: Windows,
    policy: StepPolicy,
    chores: _Chores,
    on_applied: Callable[[int], None],
) -> int:
    """SyncReplicasOptimizer's PS, the mechanism: each gradient posted for this PS's current
    step goes to ``policy`` (the mode's: it sums them, and applies their mean once a step
    has all it takes), then the step advances (PS task 0 also advances global_step); a
    gradient for an older step is dropped (and counted). Returns the steps aggregated; logs
    the gradients dropped per worker at the end."""
    task = cluster.role.task
    mail, steps = PsMail(windows, task, cluster.rank), 0
    # the step this task published before the start barrier (the restored global_step):
    # not global_step, which another PS task may already have advanced
    step = mail.published_step()
    dropped = [0] * cluster.layout.num_workers  # the step word was published before ready
    pace = _Pace()
    lr = 0.0  # the learning rate posted with the step's last gradient
    workers = live = cluster.layout.num_workers

    def advance() -> None:
        nonlocal step, steps
        policy.apply(lr, step)
        step, steps = step + 1, steps + 1
        if task == 0:
            chores.control.advance_step()
        mail.publish_step(step)
        on_applied(step)

    while not chores.run():
        busy = False
        for k in range(workers):
            posted = mail.take(k)
            if posted is None:
                continue
            busy = True
            if mail.tag != step:  # late: this PS has moved on
                dropped[k] += 1
                mail.applied(k, dropped=True)
                continue
            lr, grads, _ = posted
            complete = policy.add(grads)
            mail.applied(k)
            if complete:
                advance()
        if (now := _alive(chores.control)) < live:  # survive mode: a worker was lost
            live = now
            if policy.shrink(live):  # a step takes at most what is left
                advance()
        pace.wait(busy)
    late = ", ".join(f"worker {k}: {d}" for k, d in enumerate(dropped) if d) or "none"
    log(
        cluster.role,
        f"aggregated {steps} steps of {policy.per_step} gradients each; late gradients "
        f"dropped: {late}",
    )
    return steps

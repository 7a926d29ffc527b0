"""Notice a task that hangs in the middle of a run (alive, so MPI cannot tell).

Dead ranks end the job by themselves (the launcher sees them go; in survive mode the
watchdog finds them too: store/liveness.py); a rank stuck in a deadlock,
a hung file system or an endless loop does not. Every worker publishes its clock (updates
pushed) after each update; a watchdog on the workers that wait for others (at the end of
the run, or for the slowest under bounded staleness) and on the PS tasks (which wait for the
whole run) raises Stalled, naming the task and rank, when the slowest running worker's clock
has not moved for MPIPS_STALL_TIMEOUT seconds (default 600). The error aborts the whole job
like any other.
"""

from __future__ import annotations

import time

from ..errors import Stalled
from ..placement.layout import Layout
from . import liveness
from .cluster import stall_limit, stall_timeout
from .control import RunControl

CHECK_SECONDS = 0.5


class Watchdog:
    """Tracks when each worker's clock last moved; ``check`` raises Stalled if one is stuck."""

    def __init__(self, control: RunControl, layout: Layout, index: int, chief_ends: bool = False):
        """``index``: this waiter's place in line (worker task; PS tasks come after them), so
        that the first waiter alone reports a hang (see stall_limit). ``chief_ends``: also
        report a chief that does not end the run (RunControl.end_run) once every worker is done
        (a PS task, which serves until then)."""
        self.control, self.layout = control, layout
        self.timeout = stall_limit(index)
        self.chief_ends = chief_ends
        now = time.monotonic()
        self.last: list[int] | None = None
        self.moved = [now] * layout.num_workers
        self.all_done: float | None = None  # when every worker was first seen done
        self.next_check = now

    def check(self) -> None:
        """Cheap to call often: looks at the clocks at most every CHECK_SECONDS."""
        liveness.check(self.control)  # survive mode: the dead found (at most every 0.5 s)
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_SECONDS
        clocks, done = self.control.clocks()
        for task, clock in enumerate(clocks.tolist()):
            if self.last is None or clock != self.last[task] or done[task]:
                self.moved[task] = now
        self.last = clocks.tolist()
        # waiting workers do not move either, but they are ahead of the one they wait for
        running = [t for t in range(len(self.moved)) if not done[t]]
        slowest = min((self.last[t] for t in running), default=0)
        stuck = [
            t for t in running if self.last[t] == slowest and now - self.moved[t] > self.timeout
        ]
        if self.chief_ends and not running:
            self.all_done = self.all_done or now
            if now - self.all_done > self.timeout:
                raise Stalled(
                    f"every worker finished {now - self.all_done:.0f} s ago, but "
                    f"/job:worker/task:0 (rank {self.layout.chief_rank}), the chief, "
                    f"did not end the run: hung in its last checkpoint or evaluation? "
                    f"(MPIPS_STALL_TIMEOUT sets the limit); aborting the job"
                )
        if stuck:
            names = ", ".join(
                f"/job:worker/task:{t} (rank {self.layout.rank_of('worker', t)})" for t in stuck
            )
            raise Stalled(
                f"{names} made no update for {stall_timeout():.0f} s while the others "
                f"wait: hung? (MPIPS_STALL_TIMEOUT sets the limit); aborting the job"
            )

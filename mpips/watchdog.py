"""Notice a task that hangs in the middle of a run (alive, so MPI cannot tell).

Dead ranks end the job by themselves (the launcher sees them go); a rank stuck in a deadlock,
a hung file system or an endless loop does not. Every worker publishes its clock (updates
pushed) after each update; a watchdog on the workers that wait for others (at the end of
the run, or for the slowest under bounded staleness) raises Stalled, naming the task and
rank, when the slowest running worker's clock has not moved for MPIPS_STALL_TIMEOUT seconds
(default 600). The error aborts the whole job like any other.
"""
from __future__ import annotations

import time

from .errors import Stalled
from .layout import Layout
from .store import Counters
from .store.cluster import STALL_TIMEOUT, stall_limit

CHECK_SECONDS = 0.5


class Watchdog:
    """Tracks when each worker's clock last moved; ``check`` raises Stalled if one is stuck."""

    def __init__(self, counters: Counters, layout: Layout, task: int):
        self.counters, self.layout = counters, layout
        self.timeout = stall_limit(task)
        now = time.monotonic()
        self.last: list[int] | None = None
        self.moved = [now] * layout.num_workers
        self.next_check = now

    def check(self) -> None:
        """Cheap to call often: looks at the clocks at most every CHECK_SECONDS."""
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_SECONDS
        clocks, done = self.counters.clocks()
        for task, clock in enumerate(clocks.tolist()):
            if self.last is None or clock != self.last[task] or done[task]:
                self.moved[task] = now
        self.last = clocks.tolist()
        # waiting workers do not move either, but they are ahead of the one they wait for
        running = [t for t in range(len(self.moved)) if not done[t]]
        slowest = min((self.last[t] for t in running), default=0)
        stuck = [t for t in running
                 if self.last[t] == slowest and now - self.moved[t] > self.timeout]
        if stuck:
            names = ", ".join(f"/job:worker/task:{t} (rank {self.layout.rank_of('worker', t)})"
                              for t in stuck)
            raise Stalled(f"{names} made no update for {STALL_TIMEOUT:.0f} s while the other "
                          f"workers wait: hung? (MPIPS_STALL_TIMEOUT sets the limit); "
                          f"aborting the job")

"""The one way mpips waits: poll a condition with a deadline, backing off to short sleeps.

Every wait in the package (ready flag, checkpoint shards, PS acknowledgements, staleness,
start-up and end-of-run collectives, replica collectives) goes through :func:`poll`, so none
can hang silently and none burns a core: after an optional short spin (``sched_yield``, for
waits that usually end within microseconds, such as a replica's allreduce) and an optional
stretch of short sleeps, it sleeps, the sleep doubling from ``MIN_SLEEP`` up to
``MAX_SLEEP``. When the deadline passes it calls
``on_timeout``, which raises an error naming the task that did not arrive.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import NoReturn

from ..errors import DeadlineMissed

MIN_SLEEP = 5e-5  # first sleep after the spin
MAX_SLEEP = 1e-3  # idle ranks wake at most every millisecond (MPICH progresses only in calls)


def poll(
    done: Callable[[], bool],
    timeout: float,
    on_timeout: Callable[[float], NoReturn],
    meanwhile: Callable[[], None] | None = None,
    spin: float = 0.0,
    fast: float = 0.0,
    max_sleep: float = MAX_SLEEP,
) -> None:
    """Return as soon as ``done()`` is true.

    ``timeout``: seconds until ``on_timeout(waited)`` is called (it must raise); ``math.inf``
    only where ``meanwhile`` polices the wait instead (a watchdog that raises).
    ``meanwhile``: called between polls. ``spin``: seconds of yielding the core before the
    first sleep; ``fast``: seconds after that of MIN_SLEEP sleeps (a wait that usually ends
    within milliseconds, e.g. for a PS to apply an update); then sleeps double up to
    ``max_sleep``.
    """
    if done():
        return
    start = time.monotonic()
    deadline = start + timeout if math.isfinite(timeout) else math.inf
    sleep = MIN_SLEEP
    while True:
        now = time.monotonic()
        if now > deadline:
            on_timeout(now - start)
            raise DeadlineMissed("on_timeout must raise")
        if meanwhile is not None:
            meanwhile()
        elapsed = now - start
        if elapsed < spin:
            os.sched_yield()
        elif elapsed < spin + fast:
            time.sleep(MIN_SLEEP)
        else:
            time.sleep(sleep)
            sleep = min(max_sleep, sleep * 2)
        if done():
            return

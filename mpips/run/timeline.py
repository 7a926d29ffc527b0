"""An opt-in trace of each task's phases (``summary.timeline = true``), like Horovod's timeline.

Each task records complete events (start, duration) of its phases: a worker's wait for a
ticket and for the slowest worker, pull, compute, push; a sync replica's compute, agreement
and reduce and update; a PS task's optimizer applies and checkpoint writes. At the end it
writes ``<summary.dir>/timeline/<job>-<task>.json``; ``python -m mpips plot`` merges them into
one Chrome trace (``timeline.json``: open it in Perfetto or chrome://tracing). When off, a
step's ``Phases`` marks cost one test each and nothing is recorded.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..process.files import atomic_write
from ..process.log import log

MAX_EVENTS = 500_000  # per task (~40 MB at most); later phases are counted, not kept


class Timeline:
    """One task's events, timed with perf_counter and stamped on the wall clock, so that
    the tasks of one node line up."""

    def __init__(self, directory: str | Path, job: str, task: int):
        self.path = Path(directory) / "timeline" / f"{job}-{task}.json"
        self.pid = (0 if job == "ps" else 1 << 16) + task  # workers after the PS tasks
        self.name = f"/job:{job}/task:{task}"
        self.offset = time.time() - time.perf_counter()
        self.events: list[tuple[str, float, float]] = []
        self.dropped = 0

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def span(self, name: str, start: float) -> float:
        """Record phase ``name`` from ``start`` to now; returns now (the next phase's start)."""
        end = time.perf_counter()
        if len(self.events) < MAX_EVENTS:
            self.events.append((name, start, end))
        else:
            self.dropped += 1
        return end

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with each call recorded as phase ``name``."""

        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.span(name, start)

        return call

    def write(self) -> Path | None:
        """This task's Chrome trace events (a complete file, written atomically). A failed
        write (a full disk) is a warning, not the run's failure: the timeline is a trace
        (None then)."""
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.pid,
                "tid": 0,
                "args": {"name": self.name},
            },
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": self.pid,
                "tid": 0,
                "args": {"sort_index": self.pid},
            },
        ]
        events = [
            {
                "name": n,
                "ph": "X",
                "pid": self.pid,
                "tid": 0,
                "ts": round((s + self.offset) * 1e6, 1),
                "dur": round((e - s) * 1e6, 1),
            }
            for n, s, e in self.events
        ]
        trace = {
            "traceEvents": meta + events,
            "displayTimeUnit": "ms",
            "otherData": {
                "task": self.name,
                "dropped_events": self.dropped,
                "host": os.uname().nodename,
            },
        }
        try:
            atomic_write(self.path, lambda tmp: tmp.write_text(json.dumps(trace)))
        except OSError as e:
            log(self.name, f"warning: cannot write the timeline {self.path} ({e.strerror or e})")
            return None
        return self.path


def merge(run_dir: str | Path) -> Path | None:
    """Every task's timeline under ``run_dir`` as one Chrome trace, ``run_dir/timeline.json``
    (None if no task recorded one)."""
    parts = sorted((Path(run_dir) / "timeline").glob("*.json"))
    if not parts:
        return None
    events: list[dict[str, Any]] = []
    for part in parts:
        try:
            events += json.loads(part.read_text())["traceEvents"]
        except (ValueError, KeyError, TypeError, RecursionError):  # (JSON nested too deep)
            raise DataError(f"{part}: not a timeline file") from None
    out = Path(run_dir) / "timeline.json"
    atomic_write(
        out,
        lambda tmp: tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})),
    )
    return out


class Phases:
    """A step's phases on a task's timeline, one after another: ``mark(name)`` ends the phase
    that began at the previous mark (or at ``begin``). Without a timeline (the default) a
    mark is one test, so a step function marks its phases unconditionally."""

    def __init__(self, timeline: Timeline | None):
        self.timeline = timeline
        self.t = 0.0

    def begin(self) -> None:
        if self.timeline is not None:
            self.t = time.perf_counter()

    def mark(self, name: str, when: bool = True) -> None:
        """Phase ``name`` ends now (when ``when``: else the next mark's phase includes it)."""
        if self.timeline is not None and when:
            self.t = self.timeline.span(name, self.t)

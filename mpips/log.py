"""Log lines that name the task: ``[/job:worker/task:3] step 120 ...``."""

from __future__ import annotations

import sys


def log(role: object, message: str) -> None:
    """Print one whole line in a single write, so mpirun never splices two ranks' lines."""
    sys.stdout.write(f"[{role}] {message}\n")
    sys.stdout.flush()

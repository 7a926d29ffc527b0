"""Never hang: an error on any rank ends the whole job, naming the rank and its task.

Errors every rank knows about (bad job or layout, agreed collectively) are printed once by
rank 0 and every rank exits 2. Anything else on one rank prints there and aborts the world,
the way ``python -m mpi4py`` does, so no other rank waits forever in a collective; a rank
whose failure another rank reports (AlreadyReported) aborts quietly, a little later.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from .errors import AgreedError, AlreadyReported, MpipsError

_role: str | None = None


def set_role(role: object) -> None:
    """Record this rank's task so failure messages can name it."""
    global _role
    _role = str(role)


def _world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def where() -> str:
    rank = _world().rank
    return f"rank {rank} ({_role})" if _role else f"rank {rank}"


@contextmanager
def abort_on_error() -> Iterator[None]:
    """Run a rank's work; turn any exception into a clean exit (agreed) or a world abort."""
    try:
        yield
    except AgreedError as e:
        if _world().rank == 0:
            print(f"mpips: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except AlreadyReported as e:
        time.sleep(QUIET_GRACE_SECONDS)  # let the reporting rank's abort (and message) come first
        _abort(e.exit_code)
    except MpipsError as e:
        print(f"mpips: error on {where()}: {e}", file=sys.stderr, flush=True)
        _abort(e.exit_code)
    except KeyboardInterrupt:
        print(f"mpips: {where()} interrupted; aborting the job", file=sys.stderr, flush=True)
        _abort(130)
    except Exception as e:
        tb = "".join(traceback.format_exception(e))
        print(
            f"mpips: {where()} failed:\n{tb}mpips: {where()} failed with "
            f"{type(e).__name__}: {e}; aborting the job",
            file=sys.stderr,
            flush=True,
        )
        _abort(1)


ABORT_GRACE_SECONDS = 0.5
QUIET_GRACE_SECONDS = 4 * ABORT_GRACE_SECONDS  # a quiet rank aborts later than the speaker


def _abort(code: int) -> None:
    comm = _world()
    if comm.size > 1:
        # MPI_Abort tears the launcher's stdio forwarding down at once; without a moment's
        # grace the message just written (the one that names this rank) was sometimes lost
        time.sleep(ABORT_GRACE_SECONDS)
        try:
            _unlink_runtime_shm()
        finally:
            comm.Abort(code)
    sys.exit(code)


RUNTIME_SHM = b"/dev/shm/mpich_shm_"  # MPICH's node segment, named until MPI_Finalize


def _unlink_runtime_shm() -> None:
    """Best effort: remove the names of the MPI runtime's shared-memory files this process
    maps. MPICH (5.x) keeps one per node named until MPI_Finalize, so a job ended by
    MPI_Abort would leave it in /dev/shm (a few MB of memory each) until someone deletes it;
    the ranks' mappings stay valid until they exit. Never raises: the abort must follow."""
    try:
        with open("/proc/self/maps", "rb") as f:  # bytes: any path, whatever its encoding
            paths = {line.split(maxsplit=5)[-1].rstrip(b"\n") for line in f}
        for path in paths:
            if path.startswith(RUNTIME_SHM) and b"(deleted)" not in path:
                with suppress(OSError):  # another rank of the node was first
                    os.unlink(path)
    except Exception:  # noqa: BLE001 (whatever /proc says, the job must still abort)
        pass

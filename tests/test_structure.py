"""The package's shape, checked from its source: no import cycles, only store/ touches MPI
windows, and only store/ and allreduce/ move data over MPI (the store boundary the README
describes)."""

import ast
import collections
import functools
from pathlib import Path

import mpips

ROOT = Path(mpips.__file__).parent
WINDOW_CALLS = {
    "Win",
    "Put",
    "Get",
    "Rput",
    "Rget",
    "Raccumulate",
    "Get_accumulate",
    "Accumulate",
    "Fetch_and_op",
    "Lock_all",
    "Unlock_all",
    "Flush",
    "Sync",
    "Compare_and_swap",
}

# every MPI call that communicates (point-to-point, collectives, one-sided): only store/ and
# allreduce/ make them (process/failure.py's Abort is no communication)
COMMUNICATION_CALLS = WINDOW_CALLS | {
    "Barrier",
    "Ibarrier",
    "Allreduce",
    "Iallreduce",
    "Reduce",
    "Ireduce",
    "Bcast",
    "Ibcast",
    "Allgather",
    "Iallgather",
    "Allgatherv",
    "Iallgatherv",
    "Gather",
    "Igather",
    "Gatherv",
    "Scatter",
    "Iscatter",
    "Alltoall",
    "Ialltoall",
    "Reduce_scatter",
    "Scan",
    "Exscan",
    "Send",
    "Recv",
    "Isend",
    "Irecv",
    "Ssend",
    "Issend",
    "Bsend",
    "Rsend",
    "Sendrecv",
    "Probe",
    "Iprobe",
    "Mprobe",
    "Improbe",
    "isend",
    "irecv",
    "bcast",
    "allreduce",
    "allgather",
    "sendrecv",
    "alltoall",
}
MAY_COMMUNICATE = ("mpips.store", "mpips.allreduce")


@functools.cache
def modules() -> dict[str, ast.Module]:
    """Every module of mpips, parsed once a session (callers only read the trees)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text())
    return out


# Import cycles, type hints included: tests/test_code_shape.py.


def test_only_the_store_touches_windows():
    offenders = collections.defaultdict(set)
    for name, tree in modules().items():
        if name.startswith("mpips.store"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in WINDOW_CALLS:
                offenders[name].add(node.attr)
    assert not offenders, dict(offenders)


def mpi_calls(tree: ast.Module, names: set[str]) -> set[str]:
    """The ``names`` a module calls as methods (``comm.Ibarrier()``, ``win.Get(...)``) or
    imports from mpi4py (``from mpi4py.MPI import Win``)."""
    found = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in names
        ):
            found.add(node.func.attr)
        elif isinstance(node, ast.Attribute) and node.attr in WINDOW_CALLS & names:
            found.add(node.attr)  # MPI.Win itself, and window methods passed around
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpi4py"):
            found |= {a.name for a in node.names} & names
    return found


def test_only_the_store_and_allreduce_communicate():
    mods = modules()
    offenders = {
        name: calls
        for name, tree in mods.items()
        if not name.startswith(MAY_COMMUNICATE) and (calls := mpi_calls(tree, COMMUNICATION_CALLS))
    }
    assert not offenders, f"MPI communication outside store/ and allreduce/: {offenders}"
    # the check sees the calls where they are allowed (so it would see them elsewhere)
    assert {"Ibarrier", "Iallgather", "Isend", "Irecv"} <= mpi_calls(
        mods["mpips.store.cluster"], COMMUNICATION_CALLS
    )
    assert {"Iallreduce", "Send", "Recv"} <= mpi_calls(
        mods["mpips.allreduce.agreement"], COMMUNICATION_CALLS
    )
    assert {"Put", "Fetch_and_op"} <= mpi_calls(mods["mpips.store.mailbox"], COMMUNICATION_CALLS)
    caught = mpi_calls(
        ast.parse("wait(self.cluster.workers.Ibarrier(), 'x')\nfrom mpi4py.MPI import Win\n"),
        COMMUNICATION_CALLS,
    )
    assert caught == {"Ibarrier", "Win"}

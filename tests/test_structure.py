"""The package's shape, checked from its source: no import cycles, only store/ touches MPI
windows, and only store/ and allreduce.py move data over MPI (the store boundary the README
describes)."""

import ast
import collections
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
# allreduce.py make them (failure.py's Abort is no communication)
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


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text())
    return out


def runtime_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """mpips modules ``name`` imports when it runs (module level or inside functions; not
    under ``if TYPE_CHECKING``)."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    package = (
        name
        if (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()
        else name.rpartition(".")[0]
    )
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
        subs = {f"{target}.{a.name}" for a in node.names} & known
        out |= subs or ({target} & known)
    return out - {name}


def test_no_import_cycles():
    mods = modules()
    graph = {n: runtime_imports(n, t, set(mods)) for n, t in mods.items()}
    # Tarjan's strongly connected components: any with two or more modules is a cycle
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


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
    assert not offenders, f"MPI communication outside store/ and allreduce.py: {offenders}"
    # the check sees the calls where they are allowed (so it would see them elsewhere)
    assert {"Ibarrier", "Iallgather", "Isend", "Irecv"} <= mpi_calls(
        mods["mpips.store.cluster"], COMMUNICATION_CALLS
    )
    assert {"Iallreduce", "Send", "Recv"} <= mpi_calls(mods["mpips.allreduce"], COMMUNICATION_CALLS)
    assert {"Put", "Fetch_and_op"} <= mpi_calls(mods["mpips.store.mailbox"], COMMUNICATION_CALLS)
    caught = mpi_calls(
        ast.parse("wait(self.cluster.workers.Ibarrier(), 'x')\nfrom mpi4py.MPI import Win\n"),
        COMMUNICATION_CALLS,
    )
    assert caught == {"Ibarrier", "Win"}

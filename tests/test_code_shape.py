"""The code's shape, checked from its source (issue 32): short functions, no import cycle even
through type hints, mechanism (the store, the allreduce) that imports no policy (optimizers,
jobs, modes), and the training mode asked of its object, never compared as a string outside
the modes and the config that validates it."""

from __future__ import annotations

import ast

from test_structure import ROOT, modules

LONGEST = 60  # lines, from ``def`` to the function's last line
MECHANISM = ("mpips.store", "mpips.allreduce")
POLICY = ("mpips.optim", "mpips.job", "mpips.schema", "mpips.modes", "mpips.placement.plan")
MAY_NAME_MODES = ("mpips.modes", "mpips.job", "mpips.schema")
# The wings, lowest first: a module imports its own wing and the wings below, never one
# above (the file list shows the architecture; docs/guide/how-it-works.md walks it).
WINGS = (
    ("errors", ("mpips.errors",)),
    ("process", ("mpips.process",)),
    ("config", ("mpips.schema", "mpips.job")),
    ("device", ("mpips.device",)),
    ("data", ("mpips.data",)),
    ("models", ("mpips.models", "mpips.layers")),
    ("placement", ("mpips.placement",)),
    ("optim", ("mpips.optim",)),
    ("mechanism", ("mpips.store", "mpips.allreduce")),
    ("checkpoint", ("mpips.checkpoint",)),
    ("frontends", ("mpips.torch", "mpips.jax")),
    ("run", ("mpips.run",)),
    ("modes", ("mpips.modes",)),
    ("entry", ("mpips.training", "mpips.cli", "mpips.launch", "mpips.__main__", "mpips")),
)
TOP_LEVEL_MOST = 15  # modules directly in mpips/ (wings are packages)
OVERRIDE_POINTS_MOST = 4  # a class's methods that a subclass overrides (engines compose)
# the contracts users implement (a model, a layer, a hook): their methods are the API
PUBLIC_CONTRACTS = ("mpips.models.contract.Model", "mpips.layers.Layer", "mpips.run.hooks.Hook")


def long_functions(tree: ast.Module, limit: int = LONGEST) -> list[tuple[str, int]]:
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_over_60_lines():
    found = {n: f for n, t in modules().items() if (f := long_functions(t))}
    assert not found, f"functions over {LONGEST} lines: {found}"
    assert long_functions(ast.parse("def f():\n" + "    x = 1\n" * LONGEST)) == [("f", 61)]


def package_of(name: str) -> str:
    is_package = (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()
    return name if is_package else name.rpartition(".")[0]


def imported_from(name: str, node: ast.ImportFrom) -> str:
    """The module an ``from ... import`` in module ``name`` reads from, relative or not."""
    if not node.level:
        return node.module or ""
    parts = package_of(name).split(".")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def class_table(mods: dict[str, ast.Module]) -> dict[str, tuple[set[str], set[str]]]:
    """Every class by qualified name: the methods it defines (but dunders) and its bases,
    resolved through its module's imports."""
    out = {}
    for name, tree in mods.items():
        local = {n.name: f"{name}.{n.name}" for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for a in node.names:
                    local.setdefault(a.asname or a.name, f"{imported_from(name, node)}.{a.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = {
                    f.name
                    for f in node.body
                    if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                    and not f.name.startswith("__")
                }
                bases = {local.get(b.id, b.id) for b in node.bases if isinstance(b, ast.Name)}
                out[f"{name}.{node.name}"] = (methods, bases)
    return out


def override_points(classes: dict[str, tuple[set[str], set[str]]]) -> dict[str, set[str]]:
    """Each class's methods that a subclass (direct or not) defines again."""

    def ancestors(q: str, seen: tuple[str, ...] = ()) -> set[str]:
        found = set()
        for b in classes.get(q, (set(), set()))[1]:
            if b not in seen:
                found |= {b} | ancestors(b, (*seen, b))
        return found

    above = {q: ancestors(q) for q in classes}
    return {
        q: {m for sub in classes if q in above[sub] for m in classes[sub][0] & methods}
        for q, (methods, _) in classes.items()
    }


def test_no_class_has_more_than_4_override_points():
    """Engines vary by composition (collaborators), not by subclasses overriding a base's
    steps; the public contracts users implement are exempt."""
    points = override_points(class_table(modules()))
    many = {q: sorted(m) for q, m in points.items() if len(m) > OVERRIDE_POINTS_MOST}
    assert set(many) <= set(PUBLIC_CONTRACTS), f"classes with > 4 override points: {many}"
    example = {
        "m.Base": ({"a", "b", "c", "d", "e", "own"}, set()),
        "m.Mid": ({"a", "b"}, {"m.Base"}),
        "m.Leaf": ({"c", "d", "e"}, {"m.Mid"}),
    }
    assert override_points(example)["m.Base"] == {"a", "b", "c", "d", "e"}
    assert override_points(example)["m.Mid"] == set()
    tree = ast.parse("from .base import Base\nclass Leaf(Base):\n    def a(self): ...\n")
    assert class_table({"mpips.modes.x": tree})["mpips.modes.x.Leaf"][1] == {
        "mpips.modes.base.Base"
    }


def test_no_module_rebinds_a_global():
    """Process state lives on objects you can see and reset, not in names rebound by
    ``global`` statements."""
    found = {
        n: [node.lineno for node in ast.walk(t) if isinstance(node, ast.Global)]
        for n, t in modules().items()
    }
    assert not {n: lines for n, lines in found.items() if lines}
    rebinds = ast.parse("def f():\n    global x\n    x = 1\n")
    assert [n.lineno for n in ast.walk(rebinds) if isinstance(n, ast.Global)] == [2]


def all_imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """Every mpips module ``name`` imports, wherever: at module level, in functions, under
    ``if TYPE_CHECKING`` (a cycle through type hints is a cycle all the same)."""
    is_package = (ROOT.parent / name.replace(".", "/") / "__init__.py").exists()
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            subs = {f"{target}.{a.name}" for a in node.names} & known
            out |= subs or ({target} & known)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & known
    return out - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_even_through_type_hints():
    mods = modules()
    graph = {n: all_imports(n, t, set(mods)) for n, t in mods.items()}
    assert not cycles(graph)
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    hinted = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b")
    assert all_imports("mpips.a", hinted, {"mpips.b"}) == {"mpips.b"}


def test_mechanism_imports_no_policy():
    """The store and the allreduce move bytes: no optimizer, job, placement policy or mode."""
    mods = modules()
    mechanism = [n for n in mods if n.startswith(MECHANISM)]
    assert {"mpips.store.client", "mpips.allreduce.buckets"} <= set(mechanism)
    reach = {
        n: sorted(i for i in all_imports(n, mods[n], set(mods)) if i.startswith(POLICY))
        for n in mechanism
    }
    assert not {n: r for n, r in reach.items() if r}


def wing_of(name: str) -> int:
    """The index in WINGS of the wing a module belongs to (the longest prefix wins)."""
    found = [
        (len(p), i)
        for i, (_, prefixes) in enumerate(WINGS)
        for p in prefixes
        if name == p or name.startswith(p + ".")
    ]
    assert found, f"{name} is in no wing: add it to WINGS"
    return max(found)[1]


def upward_imports(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Imports from a module to one in a higher wing."""
    up = {n: sorted(i for i in deps if wing_of(i) > wing_of(n)) for n, deps in graph.items()}
    return {n: u for n, u in up.items() if u}


def test_wings_import_only_the_wings_below():
    mods = modules()
    graph = {n: all_imports(n, t, set(mods)) for n, t in mods.items()}
    assert not upward_imports(graph)
    assert upward_imports({"mpips.store.client": {"mpips.modes.sync", "mpips.errors"}}) == {
        "mpips.store.client": ["mpips.modes.sync"]
    }
    assert wing_of("mpips") == wing_of("mpips.cli") and wing_of("mpips.layers") == 5
    top = sorted(n for n in mods if n.count(".") == 1 and not (ROOT / n[6:]).is_dir())
    assert len(top) <= TOP_LEVEL_MOST, top


def test_every_module_is_mapped_to_its_tests():
    """tests/README.md names, for every module with code, the test files that exercise it,
    and every file it names exists."""
    rows = {}
    for line in (ROOT.parent / "tests/README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`mpips"):
            rows[cells[0].split("`")[1]] = [t.strip() for t in cells[1].split(",")]
    coded = {n for n, t in modules().items() if any(not isinstance(s, ast.Expr) for s in t.body)}
    assert not coded - set(rows), f"modules missing in tests/README.md: {sorted(coded - set(rows))}"
    assert not set(rows) - coded, f"no such module: {sorted(set(rows) - coded)}"
    missing = {t for ts in rows.values() for t in ts if not (ROOT.parent / "tests" / t).exists()}
    assert not missing, f"tests/README.md names files that do not exist: {sorted(missing)}"


def mode_reads(tree: ast.Module) -> list[int]:
    """Lines that read ``<...>.train.mode`` (or ``tc.mode``) for anything but printing or
    recording it: outside an f-string, a dict literal's value or a keyword argument, a read
    is a decision taken on the string (a comparison, a match, a lookup, a name bound to it)."""
    told = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr | ast.FormattedValue):
            told |= {id(n) for n in ast.walk(node)}
        elif isinstance(node, ast.Dict):
            told |= {id(v) for v in node.values}
        elif isinstance(node, ast.keyword):
            told.add(id(node.value))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "mode"
        and isinstance(node.ctx, ast.Load)
        and (
            (isinstance(node.value, ast.Attribute) and node.value.attr in ("train", "tc"))
            or (isinstance(node.value, ast.Name) and node.value.id == "tc")
        )
        and id(node) not in told
    ]


def test_the_mode_is_asked_of_its_object_not_compared_as_a_string():
    found = {
        n: lines
        for n, t in modules().items()
        if not n.startswith(MAY_NAME_MODES) and (lines := mode_reads(t))
    }
    assert not found, f"train.mode read outside the modes and the config: {found}"
    for decision in (
        'if job.train.mode in ("a", "b"): pass',
        'mode = job.train.mode\nif mode == "a": pass',
        'if self.tc.mode == "a": pass',
        'run = {"sync": f}.get(job.train.mode)',
        "match job.train.mode:\n    case _: pass",
        'job.train.mode.startswith("s")',
    ):
        assert mode_reads(ast.parse(decision)) == [1], decision
    for told in ('print(f"mode {job.train.mode}")', 'meta = {"mode": job.train.mode}'):
        assert mode_reads(ast.parse(told)) == [], told

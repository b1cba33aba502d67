"""The rooms of the tree import only what their role allows (ARCHITECTURE.md, Layout).

Read from the source with ``ast`` (every ``import`` and ``from ... import``, at any
depth, including imports inside functions and relative ones), so a lazy import
inside a function cannot slip past:

- the worker follows plans and never schedules: nothing of ``services.scheduler``
  or ``services.engine`` (the composition of scheduler and workers) in
  ``services/worker``;
- the scheduler holds no tensors and serves no HTTP: no torch, no FastAPI, and
  nothing of the worker or the gateway;
- the gateway never touches weights: no torch, nothing of the worker;
- the kernels (``services/kernels``) import nothing else of ferry;
- no import circle between the modules of the shipped tree (services, shared, ferry_cli,
  loadtests), counting every import statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN: dict[str, tuple[str, ...]] = {
    "services/worker": ("services.scheduler", "services.engine", "services.gateway"),
    "services/scheduler": ("torch", "fastapi", "transformers", "services.worker", "services.gateway",
                           "services.engine"),
    "services/gateway": ("torch", "services.worker", "services.scheduler", "services.engine"),
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, absolute, with relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def violations(room: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    out: list[str] = []
    for path in sorted((root / room).rglob("*.py")):
        for mod in sorted(imported_modules(path, root)):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(root)} imports {mod}")
    return out


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_room_imports_only_what_its_role_allows(room: str) -> None:
    assert (ROOT / room).is_dir()
    assert violations(room, FORBIDDEN[room]) == []


def test_the_checker_sees_relative_and_lazy_imports(tmp_path: Path) -> None:
    """The rule would catch the import the offline engine used to have (inside a method)."""
    pkg = tmp_path / "services" / "worker"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_import_rule_probe.py").write_text(
        "import torch\n\ndef f():\n    from services.scheduler.scheduler import Scheduler\n"
        "    from ..scheduler import ledger\n    return Scheduler, ledger, torch\n")
    found = violations("services/worker", FORBIDDEN["services/worker"], tmp_path)
    assert found == ["services/worker/_import_rule_probe.py imports services.scheduler",
                     "services/worker/_import_rule_probe.py imports services.scheduler.ledger",
                     "services/worker/_import_rule_probe.py imports services.scheduler.scheduler",
                     "services/worker/_import_rule_probe.py imports services.scheduler.scheduler.Scheduler"]


def test_the_engine_composes_scheduler_and_worker() -> None:
    mods = imported_modules(ROOT / "services" / "engine" / "offline.py")
    assert "services.scheduler.scheduler" in mods
    assert "services.worker.runner" in mods


# -- the kernels package: one door to native code, importing nothing else of ferry --------

FERRY_ROOTS = ("services", "shared", "ferry_cli", "loadtests", "benchmarks", "tests")


def test_the_kernels_import_nothing_of_ferry() -> None:
    """services/kernels is the one door to native code; the worker depends on it, never the
    other way round, so it imports nothing of ferry outside itself (ARCHITECTURE.md, Layout)."""
    room = ROOT / "services" / "kernels"
    found = [f"{path.relative_to(ROOT)} imports {mod}"
             for path in sorted(room.rglob("*.py")) for mod in sorted(imported_modules(path))
             if mod.split(".")[0] in FERRY_ROOTS and not (mod == "services.kernels"
                                                          or mod.startswith("services.kernels."))]
    assert found == []


# -- no import circle between the shipped modules -------------------------------------------

SHIPPED = ("services", "shared", "ferry_cli", "loadtests")


def module_graph(rooms: tuple[str, ...] = SHIPPED, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ``rooms`` -> the modules of ``rooms`` it imports: every import statement
    (in functions and under ``TYPE_CHECKING`` too), relative ones resolved. ``from p import x``
    is an edge to ``p.x`` where that is a module, else to ``p``; ``import a.b`` to ``a.b``.
    Importing a module also runs its packages' ``__init__``, but those are not edges here: a
    package that imports its own modules (a registry) would otherwise be a circle by itself."""
    files = {module_name(p, root): p for room in rooms if (root / room).is_dir()
             for p in sorted((root / room).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(_known(alias.name, files) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add(sub if sub in files else _known(target, files))
        edges.discard("")
        edges.discard(mod)
        graph[mod] = edges
    return graph


def _known(name: str, files: dict[str, Path]) -> str:
    """The longest prefix of dotted ``name`` that is one of ``files``' modules ("" if none)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in files:
            return ".".join(parts[:n])
    return ""


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan), each
    sorted; every such component holds at least one import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative, so a deep chain cannot hit the recursion limit
        nonlocal counter
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))

    for mod in sorted(graph):
        if mod not in index:
            visit(mod)
    return sorted(cycles)


# The one circle left, behind TYPE_CHECKING: StepBuilder holds the Scheduler. The scheduler's
# step as data (the builder receives the queues and ledger and returns its decisions) removes
# it; then this entry goes too.
TOLERATED_CYCLES = [["services.scheduler.scheduler", "services.scheduler.step"]]


def test_no_import_circle_in_the_shipped_tree() -> None:
    cycles = [c for c in import_cycles(module_graph()) if c not in TOLERATED_CYCLES]
    assert cycles == [], "import circles (each a group of modules importing one another):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_check_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "services" / "demo"
    pkg.mkdir(parents=True)
    (tmp_path / "services" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from . import a  # a registry importing its modules is no circle\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from services.demo import c\n")
    (pkg / "c.py").write_text("import services.demo.a\nfrom . import A\n")
    (pkg / "d.py").write_text("from .a import x\n")
    graph = module_graph(("services",), tmp_path)
    assert graph["services.demo.c"] == {"services.demo.a", "services.demo"}
    assert import_cycles(graph) == [["services.demo", "services.demo.a", "services.demo.b", "services.demo.c"]]

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
- the scheduling core (the step, the ledger, the queues, the requests, admission,
  poison and stats) runs without tensors and without sockets: neither it nor any
  module of ferry it imports, transitively, imports torch or zmq; the service loop
  around it is what speaks zmq;
- no import circle inside ``services/scheduler`` or ``services/gateway`` and its parts
  (imports under ``TYPE_CHECKING`` and inside functions count: a circle there still ties
  the two modules together);
- studies and tests stay outside the product: nothing shipped (``services``,
  ``shared``, ``ferry_cli``, ``loadtests``) imports ``benchmarks`` or ``tests``, and
  ``benchmarks`` is in neither the wheel nor the image;
- the load tool (``loadtests``, ``ferry bench``) is an HTTP client of any server: it
  imports nothing of ``services``, and neither ``services`` nor ``shared`` imports it
  (``ferry bench`` reaches it through ``ferry_cli``'s table of subcommand modules);
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


SCHEDULING_CORE = ("scheduler", "step", "ledger", "queues", "request", "admission", "poison", "stats")
NOT_IN_THE_CORE = ("torch", "zmq")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def from_target(node: ast.ImportFrom, package: list[str]) -> str:
    """The absolute module a ``from ... import`` names, relative levels resolved in ``package``."""
    if not node.level:
        return node.module or ""
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


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
            target = from_target(node, package)
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of ``root``'s tree that importing ``name`` runs (the longest prefix that is a
    module: ``shared.messages.StepPlan`` is ``shared/messages.py``); None outside the tree."""
    parts = name.split(".")
    while parts:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        parts.pop()
    return None


def reachable_violations(paths: list[Path], forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    """Forbidden imports of ``paths`` and of every module of the tree they import, transitively."""
    out: list[str] = []
    seen = set(paths)
    todo = list(paths)
    while todo:
        path = todo.pop()
        for mod in sorted(imported_modules(path, root)):
            if any(mod == f or mod.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(root)} imports {mod}")
                continue
            found = module_file(mod, root)
            while found is not None and found not in seen:  # the module, then its packages' __init__
                seen.add(found)
                todo.append(found)
                package = found.parent if found.name != "__init__.py" else found.parent.parent
                init = package / "__init__.py"
                found = init if init.is_file() and package != root else None
    return sorted(set(out))


def import_cycles(folder: str, root: Path = ROOT) -> list[list[str]]:
    """The groups of modules under ``folder`` that import one another (see ``module_graph``)."""
    return graph_cycles(module_graph((folder,), root))


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


def test_the_scheduling_core_imports_neither_torch_nor_zmq() -> None:
    core = [ROOT / "services" / "scheduler" / f"{name}.py" for name in SCHEDULING_CORE]
    assert all(path.is_file() for path in core)
    assert reachable_violations(core, NOT_IN_THE_CORE) == []


def test_the_scheduler_service_loop_is_what_speaks_zmq() -> None:
    """The rule above means something: the same check flags the service loop."""
    service = ROOT / "services" / "scheduler" / "service.py"
    assert "zmq" in imported_modules(service)
    assert "services/scheduler/service.py imports zmq" in reachable_violations([service], NOT_IN_THE_CORE)


def test_no_import_circle_in_the_scheduler() -> None:
    assert import_cycles("services/scheduler") == []


def test_no_import_circle_in_the_gateway() -> None:
    """Across its parts too: api, text, admission, engines, observability."""
    assert import_cycles("services/gateway") == []


def part_graph(folder: str, root: Path = ROOT) -> dict[str, set[str]]:
    """Which parts (the sub-packages and top modules of ``folder``) import which others."""
    prefix = folder.replace("/", ".") + "."
    graph: dict[str, set[str]] = {}
    for path in sorted((root / folder).rglob("*.py")):
        part = path.relative_to(root / folder).parts[0].removesuffix(".py")
        edges = graph.setdefault(part, set())
        for name in imported_modules(path, root):
            if name.startswith(prefix):
                other = name[len(prefix):].split(".")[0]
                if other != part:
                    edges.add(other)
    return graph


def test_the_gateways_parts_are_layered() -> None:
    """No circle between the parts either: api composes the others, which share only the
    errors and the protocol (and engines reads the metrics' label vocabulary)."""
    graph = part_graph("services/gateway")
    assert {"api", "text", "admission", "engines", "observability"} <= set(graph)
    seen: dict[str, int] = {}

    def cyclic(node: str) -> bool:  # depth-first search: 1 on the path, 2 done
        seen[node] = 1
        for nxt in graph.get(node, set()):
            if seen.get(nxt) == 1 or (nxt not in seen and cyclic(nxt)):
                return True
        seen[node] = 2
        return False

    assert not any(cyclic(n) for n in sorted(graph) if n not in seen), graph
    assert "api" not in set().union(*(graph[p] for p in graph if p != "__main__"))  # nothing below api reaches up


def test_the_checkers_see_type_checking_and_function_level_imports(tmp_path: Path) -> None:
    """A circle or a socket import hidden behind TYPE_CHECKING or inside a function counts."""
    pkg = tmp_path / "services" / "scheduler"
    pkg.mkdir(parents=True)
    (tmp_path / "services" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .b import B\n")
    (pkg / "b.py").write_text("def f():\n    from services.scheduler import a\n    return a\n")
    (pkg / "c.py").write_text("from .d import D\n")
    (pkg / "d.py").write_text("def g():\n    import zmq\n    return zmq\n")
    assert import_cycles("services/scheduler", tmp_path) == [["services.scheduler.a", "services.scheduler.b"]]
    assert reachable_violations([pkg / "c.py"], NOT_IN_THE_CORE, tmp_path) == [
        "services/scheduler/d.py imports zmq"]


# Rooms of what ships (the wheel's packages, the image's folders) and what each may not import.
NOT_SHIPPED = ("benchmarks", "tests")
SHIPPED: dict[str, tuple[str, ...]] = {
    "services": ("loadtests", *NOT_SHIPPED),
    "shared": ("loadtests", *NOT_SHIPPED),
    "ferry_cli": NOT_SHIPPED,
    "loadtests": ("services", *NOT_SHIPPED),
}


@pytest.mark.parametrize("room", sorted(SHIPPED))
def test_shipped_rooms_import_no_studies_and_the_load_tool_no_server(room: str) -> None:
    assert (ROOT / room).is_dir()
    assert violations(room, SHIPPED[room]) == []


def test_the_load_tool_rule_sees_lazy_imports(tmp_path: Path) -> None:
    """A study's helper pulled into the load tool inside a function is caught, as is a server module."""
    pkg = tmp_path / "loadtests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "_probe.py").write_text("def f():\n    from benchmarks.peers import board\n"
                                   "    import services.worker.loader\n    return board\n")
    assert violations("loadtests", SHIPPED["loadtests"], tmp_path) == [
        "loadtests/_probe.py imports benchmarks.peers", "loadtests/_probe.py imports benchmarks.peers.board",
        "loadtests/_probe.py imports services.worker.loader"]


def test_ferry_subcommands_name_no_study() -> None:
    from ferry_cli.main import SUBCOMMANDS

    modules = [module for module, _ in SUBCOMMANDS.values()]
    assert not [m for m in modules if m.split(".")[0] in NOT_SHIPPED]


def test_benchmarks_are_not_shipped() -> None:
    """The wheel's package list and the image's build context leave ``benchmarks`` out."""
    import fnmatch
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert not [p for p in find["include"] if fnmatch.fnmatch("benchmarks", p)]
    allowed = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip().startswith("!")]
    assert not [line for line in allowed if line.lstrip("!").split("/")[0] == "benchmarks"]
    copies = [ln for ln in (ROOT / "deploy" / "Dockerfile").read_text().splitlines() if ln.startswith(("COPY", "ADD"))]
    assert copies and not [ln for ln in copies if "benchmarks" in ln]


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

SHIPPED_ROOMS = ("services", "shared", "ferry_cli", "loadtests")


def module_graph(rooms: tuple[str, ...] = SHIPPED_ROOMS, root: Path = ROOT) -> dict[str, set[str]]:
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
                target = from_target(node, package)
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


def graph_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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


def test_no_import_circle_in_the_shipped_tree() -> None:
    cycles = graph_cycles(module_graph())
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
    assert graph_cycles(graph) == [["services.demo", "services.demo.a", "services.demo.b", "services.demo.c"]]

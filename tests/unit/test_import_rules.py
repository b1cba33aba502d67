"""The rooms of the tree import only what their role allows (ARCHITECTURE.md, Layout).

Read from the source with ``ast`` (every ``import`` and ``from ... import``, at any
depth, including imports inside functions and relative ones), so a lazy import
inside a function cannot slip past:

- the worker follows plans and never schedules: nothing of ``services.scheduler``
  or ``services.engine`` (the composition of scheduler and workers) in
  ``services/worker``;
- the scheduler holds no tensors and serves no HTTP: no torch, no FastAPI, and
  nothing of the worker or the gateway;
- the gateway never touches weights: no torch, nothing of the worker.
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

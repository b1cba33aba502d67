"""The one table of ``FERRY_*`` variables (shared/envs.py): complete, the only reader, documented.

- Python reads a ``FERRY_*`` name from the environment only in shared/envs.py and
  shared/config.py (which derives ``FERRY_<FIELD>`` from the config fields); the one
  exception is a switch the kernels read (``reader="kernels"``), in the kernels' loader,
  which imports nothing of ferry. Found with ``ast``: ``os.environ.get(NAME)``,
  ``os.getenv(NAME)``, ``environ[NAME]``, ``NAME in environ``, on any mapping. Setting a
  variable (a benchmark choosing a path, ``ferry serve`` passing one to a child) is not a read.
- Every ``FERRY_*`` name the code, the compose file, the deploy files and the Makefile use
  is declared, every switch declared is used, and the C++ sources ``getenv`` only names
  declared for the kernels.
- docs/environment.md shows exactly ``render_markdown()``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from shared import envs

ROOT = Path(__file__).resolve().parents[3]
TREES = ("services", "shared", "loadtests", "ferry_cli", "benchmarks")  # the shipped tree and the studies
ALLOWED_READERS = {"shared/envs.py", "shared/config.py"}
KERNEL_DIRS = ("services/kernels/", "services/worker/backends/")  # the kernels' loader and C++ sources
NAME = re.compile(r"FERRY_[A-Z0-9_]*[A-Z0-9]")
DOC = ROOT / "docs" / "environment.md"


def _ferry_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
        return node.value
    return None


def env_reads(source: str) -> list[tuple[int, str]]:
    """(line, name) of every read of a literal ``FERRY_*`` name from a mapping or ``getenv``."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            attr = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if attr in ("get", "getenv", "getenvb"):
                name = _ferry_name(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            name = _ferry_name(node.slice)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            name = _ferry_name(node.left)
        if name:
            found.append((node.lineno, name))
    return found


def python_files() -> list[Path]:
    return sorted(p for top in TREES if (ROOT / top).is_dir() for p in (ROOT / top).rglob("*.py"))


def test_the_reader_finds_every_kind_of_read() -> None:
    source = """
import os
a = os.environ.get("FERRY_A", "1")
b = os.getenv("FERRY_B")
c = os.environ["FERRY_C"]
d = "FERRY_D" in os.environ
e = env.get("FERRY_E")
os.environ["FERRY_SET"] = "1"
child = {"FERRY_CHILD": "1"}
os.environ.pop("FERRY_POP", None)
note = "FERRY_NOTE=1 in a docstring"
"""
    assert [name for _, name in env_reads(source)] == ["FERRY_A", "FERRY_B", "FERRY_C", "FERRY_D", "FERRY_E"]


def test_only_the_table_reads_ferry_variables() -> None:
    kernel_names = {s.name for s in envs.SWITCHES.values() if s.reader == "kernels"}
    bad = []
    for path in python_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ALLOWED_READERS:
            continue
        for line, name in env_reads(path.read_text()):
            if name in kernel_names and rel.startswith(KERNEL_DIRS):
                continue
            bad.append(f"{rel}:{line} reads {name} (read it through shared/envs.py)")
    assert bad == []


def cpp_reads() -> dict[str, str]:
    """Each FERRY_* name a C++ source ``getenv``s, with the source."""
    reads = {}
    for top in ("services", "shared"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in (".h", ".cpp", ".cu", ".cc"):
                for name in re.findall(r'getenv\(\s*"(FERRY_[A-Z0-9_]+)"', path.read_text()):
                    reads[name] = path.relative_to(ROOT).as_posix()
    return reads


def test_cpp_reads_only_the_kernels_switches() -> None:
    kernel_names = {s.name for s in envs.SWITCHES.values() if s.reader == "kernels"}
    reads = cpp_reads()
    assert reads, "no C++ source reads a FERRY_* variable: drop reader='kernels' where no kernel reads it"
    assert set(reads) <= kernel_names, reads
    assert all(p.startswith(KERNEL_DIRS) for p in reads.values()), reads


def _used_names() -> dict[str, str]:
    """Every FERRY_* name the code, the compose file, the deploy files and the Makefile use,
    with one place it is used."""
    used = cpp_reads()
    tests = [p for p in sorted((ROOT / "tests").rglob("*.py")) if p != Path(__file__).resolve()]  # (made-up names)
    for path in python_files() + tests + sorted((ROOT / "deploy").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = _ferry_name(node)
            if name:
                used.setdefault(name, path.relative_to(ROOT).as_posix())
    texts = [ROOT / "docker-compose.yml", ROOT / "Makefile", *sorted((ROOT / "deploy").rglob("*.yaml")),
             *sorted((ROOT / "deploy").rglob("*.yml")), *sorted((ROOT / "deploy").rglob("*.sh")),
             *sorted((ROOT / "deploy").rglob("Dockerfile*"))]
    for path in texts:
        text = path.read_text()
        # ${FERRY_X...}, FERRY_X: value / FERRY_X=value, {name: FERRY_X, ...}
        for pattern in (r"\$\{(FERRY_[A-Z0-9_]+)", r"^\s*(FERRY_[A-Z0-9_]+)\s*[:=]", r"name:\s*(FERRY_[A-Z0-9_]+)"):
            for name in re.findall(pattern, text, re.M):
                used.setdefault(name, path.relative_to(ROOT).as_posix())
    return used


def test_every_variable_in_use_is_declared() -> None:
    used = _used_names()
    assert {"FERRY_IMAGE", "FERRY_NUM_WORKERS", "FERRY_CPU_FUSED_OPS", "FERRY_DOCS_SLOW"} <= set(used)
    missing = {name: where for name, where in used.items() if name not in envs.declared_names()}
    assert missing == {}, "declare these in shared/envs.py"


def test_every_switch_is_used() -> None:
    """A switch nothing reads or sets any more leaves the table too."""
    assert set(envs.SWITCHES) - set(_used_names()) == set()


def test_switches_and_config_fields_do_not_overlap() -> None:
    assert set(envs.SWITCHES) & {v.name for v in envs.config_variables()} == set()


@pytest.mark.parametrize("switch", list(envs.SWITCHES.values()), ids=lambda s: s.name)
def test_every_default_parses_and_says_what_it_does(switch: envs.Switch) -> None:
    switch.get({})
    assert switch.doc and switch.values and switch.doc.endswith(".")


def test_typed_values_and_their_spellings() -> None:
    assert envs.CPU_FUSED_OPS.get({}) is True
    assert envs.CPU_FUSED_OPS.get({"FERRY_CPU_FUSED_OPS": " Off "}) is False
    assert envs.CPU_FLOAT32_EXACT.get({}) is False
    assert envs.CPU_FLOAT32_EXACT.get({"FERRY_CPU_FLOAT32_EXACT": "yes"}) is True
    assert [envs.CPU_BF16_DOT.get({"FERRY_CPU_BF16_DOT": v}) for v in ("auto", "1", "0", "on")] == [None, True, False, True]
    assert [envs.CPU_TILED_LINEAR.get({"FERRY_CPU_TILED_LINEAR": v}) for v in ("auto", "small", "0")] == \
        ["auto", "small", "off"]
    assert envs.CPU_AMX_PROMPT.get({"FERRY_CPU_AMX_PROMPT": "qkv, down"}) == {"qkv", "down"}
    assert envs.CPU_AMX_PROMPT.get({"FERRY_CPU_AMX_PROMPT": "all"}) == envs.AMX_PROMPT_KINDS
    assert envs.CPU_AMX_PROMPT.get({}) is None
    assert envs.DATA_PARALLEL_SIZE.get({"FERRY_DATA_PARALLEL_SIZE": "3"}) == 3
    for switch, value in ((envs.CPU_BF16_DOT, "maybe"), (envs.CPU_TILED_LINEAR, "everything"),
                          (envs.CPU_AMX_PROMPT, "gate_up,mlp"), (envs.DATA_PARALLEL_SIZE, "two")):
        with pytest.raises(ValueError, match=switch.name):
            switch.get({switch.name: value})


def test_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_CPU_LEAN_FORWARD", "0")
    assert envs.CPU_LEAN_FORWARD.get() is False
    monkeypatch.delenv("FERRY_CPU_LEAN_FORWARD")
    assert envs.CPU_LEAN_FORWARD.get() is True


def test_field_env_takes_only_config_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_REDIS_URL", "redis://h:1/0")
    assert envs.field_env("redis_url") == "redis://h:1/0"
    assert envs.field_env("cache_dir", {}) is None
    with pytest.raises(KeyError):
        envs.field_env("no_such_field")


def test_amx_prompt_kinds_are_the_projections() -> None:
    pytest.importorskip("torch")
    from services.worker.model.packed_linear import PROJECTION_KINDS

    assert envs.AMX_PROMPT_KINDS == set(PROJECTION_KINDS.values())


def test_the_docs_page_shows_the_table() -> None:
    page = DOC.read_text()
    assert envs.replace_table(page, envs.render_markdown()) == page, \
        "docs/environment.md is out of date: python -m shared.envs --write docs/environment.md"


def test_the_docs_page_is_linked_from_the_readme() -> None:
    assert "docs/environment.md" in (ROOT / "README.md").read_text()


def test_write_replaces_only_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nintro\n\n{envs.BEGIN}\nold\n{envs.END}\n\nafter\n")
    assert envs.main(["--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Title\n\nintro\n\n") and text.endswith(f"{envs.END}\n\nafter\n")
    assert envs.render_markdown() in text and "\nold\n" not in text

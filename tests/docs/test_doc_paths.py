"""Every path README's map of the code and docs/architecture.md name exists in the tree.

A path is a backticked token or the first word of a line in a fenced block that
starts with one of the repository's top-level rooms (``services/gateway/api/``,
``shared/envs.py``, ``tests/unit/gateway/``...); globs and placeholders
(``*``, ``<x>``) are skipped. A room moved without its map fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("services", "shared", "loadtests", "benchmarks", "ferry_cli", "deploy", "tests", "docs", ".ci")
FILES = ("Makefile", "docker-compose.yml", "pyproject.toml", "README.md")
DOCS = ("README.md", "docs/architecture.md")
PATH = re.compile(r"^(?:" + "|".join(re.escape(r) for r in ROOMS) + r")(?:/[\w.\-]+)*/?$")


def named_paths(text: str) -> set[str]:
    found = {m.group(1) for m in re.finditer(r"`([^`\s]+)`", text)}
    in_block = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block and line.strip():
            found.add(line.split()[0])
    return {p for p in found if PATH.match(p) or p in FILES}


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc: str) -> None:
    paths = named_paths((ROOT / doc).read_text())
    assert len(paths) >= 10, f"{doc} names almost no paths: is the map still there?"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], f"{doc} names paths that do not exist: {missing}"


def test_the_path_reader_finds_tokens_and_tree_lines() -> None:
    text = "See `services/gateway/api/` and `ferry serve`.\n```\nshared/envs.py   the table\n  \n```\n"
    assert named_paths(text) == {"services/gateway/api/", "shared/envs.py"}

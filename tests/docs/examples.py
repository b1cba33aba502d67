"""The shell and Python examples of README.md and docs/*.md, with the marker that says how to check each.

A marker is an HTML comment on the line right before a fenced block (invisible on
GitHub), one of:

- ``<!-- doctest -->``: run the block against the test cluster (bash for sh blocks,
  Python for python blocks) and fail when it fails;
- ``<!-- doctest: slow (REASON) -->``: the same, but only with ``FERRY_DOCS_SLOW=1``
  (the block takes minutes; REASON says how long and why);
- ``<!-- doctest: output -->``: the block is the expected output of the runnable
  block before it; each of its lines must appear, in order, in that block's stdout
  (``...`` inside a line matches any text);
- ``<!-- doctest: serve-output -->``: the expected output of ``ferry serve`` itself
  (its banner), checked against the test cluster's stdout;
- ``<!-- not-runnable: REASON -->``: an example this machine cannot run (a GPU,
  Docker, a model that is not here), with the reason.

``unmarked_commands`` lists the blocks that look like commands an operator would
type but carry no marker: a test keeps that list empty, so a new example is
either checked or explicitly excused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Not recursive: docs/journal/ (dated logs whose commands are kept as they were run) and
# docs/experiments/ (experiments' decision records) are not checked.
DOC_FILES = ("README.md", "docs/*.md")
MARKER = re.compile(r"^<!--\s*(doctest(?::\s*(?P<kind>[\w-]+)(?:\s*\((?P<why>.*)\))?)?"
                    r"|not-runnable:\s*(?P<reason>.+?))\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
SHELL_LANGS = {"sh", "bash", "shell", "console"}
COMMAND_WORDS = ("ferry ", "make ", "curl ", "docker ", "python ", ".venv/", "podman ", "kubectl ")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    kind: str  # "run", "slow", "output", "serve-output", "not-runnable" or "" (unmarked)
    reason: str = ""
    expected: list[str] = field(default_factory=list)  # from a following output block

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    def looks_like_command(self) -> bool:
        if self.lang in SHELL_LANGS or self.lang == "python":
            return True
        if self.lang:
            return False
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        return first.startswith(COMMAND_WORDS)


def doc_paths(root: Path = ROOT) -> list[Path]:
    paths: list[Path] = []
    for pattern in DOC_FILES:
        paths += sorted(root.glob(pattern))
    return paths


def parse(path: Path) -> list[Block]:
    """Every fenced block of ``path`` with its marker; output blocks folded into the block they check."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.match(prev.strip())
        kind, reason = "", ""
        if marker is not None:
            if marker.group("reason"):
                kind, reason = "not-runnable", marker.group("reason")
            else:
                kind = {None: "run"}.get(marker.group("kind"), marker.group("kind") or "run")
                reason = marker.group("why") or ""
        blocks.append(Block(path, i + 1, fence.group("lang"), "\n".join(lines[i + 1:end]), kind, reason))
        i = end + 1
    for before, block in zip(blocks, blocks[1:], strict=False):
        if block.kind == "output" and before.kind in ("run", "slow"):
            before.expected = [ln for ln in block.code.splitlines() if ln.strip()]
    return blocks


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in doc_paths(root) for b in parse(p)]


def unmarked_commands(blocks: list[Block]) -> list[str]:
    return [f"{b.where} ({b.lang or 'no language'})" for b in blocks if not b.kind and b.looks_like_command()]


def expected_line_pattern(line: str) -> re.Pattern[str]:
    """``...`` matches any text; everything else literally; surrounding blanks ignored."""
    parts = [re.escape(p) for p in line.strip().split("...")]
    return re.compile(".*".join(parts))


def missing_output(expected: list[str], stdout: str) -> list[str]:
    """The expected lines not found in order in ``stdout`` (each matches within one line)."""
    actual = [ln.strip() for ln in stdout.splitlines()]
    missing: list[str] = []
    pos = 0
    for line in expected:
        pattern = expected_line_pattern(line)
        for k in range(pos, len(actual)):
            if pattern.fullmatch(actual[k]):
                pos = k + 1
                break
        else:
            missing.append(line)
    return missing

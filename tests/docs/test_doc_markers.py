"""Every command-looking example in README.md and docs/*.md carries a marker (no cluster needed)."""

from __future__ import annotations

from pathlib import Path

from tests.docs.examples import all_blocks, missing_output, parse, unmarked_commands


def test_every_command_example_is_marked() -> None:
    assert unmarked_commands(all_blocks()) == [], (
        "mark each example <!-- doctest -->, <!-- doctest: slow (why) --> or <!-- not-runnable: why -->")


def test_not_runnable_examples_say_why() -> None:
    for block in all_blocks():
        if block.kind in ("not-runnable", "slow"):
            assert len(block.reason) > 10, f"{block.where}: give the reason"


def test_markers_and_outputs_are_parsed(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "text\n\n<!-- doctest -->\n```sh\nferry keys list\n```\n<!-- doctest: output -->\n```\nNAME ...\n```\n\n"
        "<!-- not-runnable: needs a GPU (CUDA) -->\n```sh\ndocker compose up\n```\n\n```sh\ncurl x\n```\n"
        "<!-- doctest: slow (60 s of load) -->\n```bash\nferry bench run\n```\n")
    blocks = parse(doc)
    assert [(b.kind, b.line) for b in blocks] == [
        ("run", 4), ("output", 8), ("not-runnable", 13), ("", 17), ("slow", 21)]
    assert blocks[0].expected == ["NAME ..."]
    assert blocks[2].reason == "needs a GPU (CUDA)"
    assert blocks[4].reason == "60 s of load"
    assert [b.line for b in blocks if not b.kind and b.looks_like_command()] == [17]


def test_expected_output_matches_in_order_with_wildcards() -> None:
    out = "NAME   PRIORITY\nalice  0\nboard: results/x/board.md\n"
    assert missing_output(["NAME ...", "board: .../board.md"], out) == []
    assert missing_output(["board: ...", "NAME ..."], out) == ["NAME ..."]  # order matters
    assert missing_output(["bob ..."], out) == ["bob ..."]

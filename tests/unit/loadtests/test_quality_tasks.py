"""The task-set format: canonical lines, a content hash that ignores the header, errors with file:line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from loadtests.quality.builtin import load_taskset
from loadtests.quality.tasks import (
    TASKS_FORMAT_VERSION,
    TaskItem,
    TaskSet,
    TaskSetError,
    read_taskset,
    write_taskset,
)

ARITH = {
    "id": "arith-0007", "task": "arithmetic", "checker": "numeric", "expected": 12,
    "messages": [{"role": "user", "content": "What is 7 + 5? Answer with the number only."}],
    "max_tokens": 16,
}
CAPITAL = {
    "id": "qa-1", "task": "qa", "checker": "normalized", "expected": ["Paris"],
    "prompt": "The capital of France is", "max_tokens": 8, "params": {"first_word": True},
}
PERSON = {
    "id": "json-1", "task": "structured", "checker": "json_schema", "expected": {"name": "Ada"},
    "messages": [{"role": "user", "content": "Give Ada's record as JSON."}], "max_tokens": 64,
    "request": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": {"type": "object", "required": ["name"]}}}},
}
FREE = {"id": "free-1", "task": "chat", "checker": "agree", "prompt": "Say hi.", "max_tokens": 4}
ITEMS = [ARITH, CAPITAL, PERSON, FREE]


def taskset(items: list[dict[str, Any]] = ITEMS, **meta: Any) -> TaskSet:
    return TaskSet([TaskItem.from_dict(raw) for raw in items], dict(meta))


def write_lines(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_canonical_form_omits_empty_and_absent_fields() -> None:
    item = TaskItem(id="a", task="t", checker="exact", max_tokens=3, expected="x", prompt="p")
    assert item.to_dict() == {"id": "a", "task": "t", "checker": "exact", "expected": "x", "prompt": "p",
                              "max_tokens": 3}
    assert TaskItem.from_dict(FREE).to_dict() == FREE  # agree: no expected
    assert TaskItem.from_dict(ARITH).to_dict() == ARITH
    assert TaskItem.from_dict(CAPITAL).check_spec() == {
        "checker": "normalized", "expected": ["Paris"], "params": {"first_word": True}, "request": {},
    }


def test_hash_is_sha256_of_the_canonical_item_lines() -> None:
    ts = taskset([ARITH])
    line = json.dumps(ARITH, sort_keys=True, separators=(",", ":"))
    assert ts.content_hash == hashlib.sha256((line + "\n").encode()).hexdigest()


def test_round_trip_keeps_the_hash_and_the_items(tmp_path: Path) -> None:
    ts = taskset(name="mine", version="3")
    digest = write_taskset(ts, tmp_path / "sets" / "mine.jsonl")
    assert digest == ts.content_hash
    back = read_taskset(tmp_path / "sets" / "mine.jsonl")
    assert back.content_hash == digest
    assert [i.to_dict() for i in back.items] == [i.to_dict() for i in ts.items]
    assert back.meta["name"] == "mine" and back.meta["version"] == "3"
    header = json.loads((tmp_path / "sets" / "mine.jsonl").read_text().splitlines()[0])
    assert header == {"ferry_tasks": TASKS_FORMAT_VERSION, "name": "mine", "version": "3", "sha256": digest}
    described = back.describe()
    assert described["sha256"] == digest and described["num_items"] == 4
    assert described["task_types"] == {"arithmetic": 1, "chat": 1, "qa": 1, "structured": 1}
    assert back.task_types == ["arithmetic", "chat", "qa", "structured"]
    assert load_taskset(str(tmp_path / "sets" / "mine.jsonl")).content_hash == digest


def test_hash_ignores_the_header_and_the_formatting(tmp_path: Path) -> None:
    plain = write_lines(tmp_path / "plain.jsonl", ITEMS)  # no header, keys in the given order, spaces
    pretty = write_lines(
        tmp_path / "pretty.jsonl",
        [{"ferry_tasks": 1, "name": "other", "version": "9"}, ""]
        + [json.dumps(dict(reversed(list(raw.items()))), separators=(" , ", " : ")) for raw in ITEMS],
    )
    reference = taskset().content_hash
    assert read_taskset(plain).content_hash == reference
    assert read_taskset(pretty).content_hash == reference
    assert read_taskset(plain).meta["name"] == "plain"  # no header: named after the file
    assert read_taskset(pretty).meta["name"] == "other"


@pytest.mark.parametrize(
    "change",
    [
        {"expected": 13},
        {"max_tokens": 17},
        {"task": "math"},
        {"params": {"abs_tol": 0.5}},
        {"messages": [{"role": "user", "content": "What is 7 + 5?"}]},
    ],
)
def test_a_changed_item_changes_the_hash(change: dict[str, Any]) -> None:
    assert taskset([{**ARITH, **change}, CAPITAL]).content_hash != taskset([ARITH, CAPITAL]).content_hash


def test_item_order_changes_the_hash() -> None:
    assert taskset([CAPITAL, ARITH]).content_hash != taskset([ARITH, CAPITAL]).content_hash


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({k: v for k, v in ARITH.items() if k != "max_tokens"}, "'max_tokens' must be a positive integer"),
        ({**ARITH, "max_tokens": 0}, "'max_tokens' must be a positive integer"),
        ({**ARITH, "prompt": "What is 7 + 5?"}, "exactly one of 'messages' or 'prompt'"),
        ({k: v for k, v in ARITH.items() if k != "messages"}, "exactly one of 'messages' or 'prompt'"),
        ({**ARITH, "checker": "fuzzy"}, "unknown checker 'fuzzy'"),
        ({**ARITH, "expected": "twelve"}, "'expected' must be a finite number"),
        ({**ARITH, "params": {"tolerance": 0.1}}, "unknown params for numeric: 'tolerance'"),
        ({**ARITH, "id": ""}, "'id'"),
        ({**ARITH, "id": "a#2"}, "'#'"),
        ({**ARITH, "task": None}, "'task'"),
        ({**ARITH, "messages": [{"content": "no role"}]}, "'messages[0]'"),
        ({**ARITH, "request": {"temperature": 0.7}}, "'temperature'"),
        ({**ARITH, "answer": 12}, "unknown fields 'answer'"),
    ],
)
def test_bad_lines_are_refused_with_file_and_line(tmp_path: Path, bad: dict[str, Any], words: str) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [{"ferry_tasks": 1}, CAPITAL, bad])
    with pytest.raises(TaskSetError) as err:
        read_taskset(path)
    assert str(err.value).startswith(f"{path}:3: ")
    assert words in str(err.value)


def test_duplicate_ids_are_refused_with_both_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "dup.jsonl", [ARITH, CAPITAL, {**CAPITAL, "expected": "Lyon"}])
    with pytest.raises(TaskSetError, match=r"dup\.jsonl:3: duplicate id 'qa-1' \(first on line 2\)"):
        read_taskset(path)
    with pytest.raises(TaskSetError, match="duplicate item id 'qa-1'"):
        taskset([CAPITAL, CAPITAL])


def test_bad_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TaskSetError, match=r"notjson\.jsonl:2: not JSON"):
        read_taskset(write_lines(tmp_path / "notjson.jsonl", [ARITH, "{oops"]))
    with pytest.raises(TaskSetError, match=r"v2\.jsonl:1: task-set format 2 is not supported"):
        read_taskset(write_lines(tmp_path / "v2.jsonl", [{"ferry_tasks": 2}, ARITH]))
    with pytest.raises(TaskSetError, match=r"late\.jsonl:2: .*header must be the first line"):
        read_taskset(write_lines(tmp_path / "late.jsonl", [ARITH, {"ferry_tasks": 1}]))
    with pytest.raises(TaskSetError, match="has no items"):
        read_taskset(write_lines(tmp_path / "empty.jsonl", [{"ferry_tasks": 1}]))
    with pytest.raises(TaskSetError, match=r"an item line must be a JSON object"):
        read_taskset(write_lines(tmp_path / "list.jsonl", [[1, 2]]))
    with pytest.raises(TaskSetError, match="not 'builtin' and not a file"):
        load_taskset(str(tmp_path / "missing.jsonl"))


def test_items_built_in_code_are_checked_too() -> None:
    with pytest.raises(TaskSetError, match="item 'x': 'max_tokens'"):
        TaskItem(id="x", task="t", checker="exact", max_tokens=0, expected="a", prompt="p")
    with pytest.raises(TaskSetError, match="not among request.tools"):
        TaskItem(id="x", task="t", checker="tool_call", max_tokens=8, expected={"name": "f"}, prompt="p")

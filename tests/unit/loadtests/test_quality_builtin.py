"""The built-in task set: its size and shape, a pinned content hash, and its own answers judged right."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from loadtests.quality.builtin import NAME, VERSION, builtin_taskset
from loadtests.quality.checkers import Answer, check
from loadtests.quality.tasks import TaskItem, TaskSet, read_taskset, write_taskset

# Pinned: any change to an item, a word list or a template changes it. If the change is meant,
# bump builtin.VERSION and put the new hash here (runs judged on different sets do not compare).
BUILTIN_SHA256 = "5a043f4f0d0e27492d58ef570a9372ca8467864f654c2620e4c977c8ad6fc10c"

TYPES = {
    "arithmetic": "numeric",
    "classification": "normalized",
    "choice": "choice",
    "extraction": "contains",
    "structured": "json_schema",
    "tool_call": "tool_call",
    "open": "agree",
}


@pytest.fixture(scope="module")
def taskset() -> TaskSet:
    return builtin_taskset()


def test_shape(taskset: TaskSet) -> None:
    counts = Counter(item.task for item in taskset.items)
    assert set(counts) == set(TYPES)
    assert all(n >= 100 for n in counts.values()), counts
    assert len({item.id for item in taskset.items}) == len(taskset.items)
    assert taskset.meta == {"name": NAME, "version": VERSION} == {"name": "ferry-builtin", "version": "1"}
    for item in taskset.items:
        assert item.checker == TYPES[item.task], item.id
        assert 8 <= item.max_tokens <= 48, item.id
        assert (item.expected is None) == (item.checker == "agree"), item.id
    # Distinct questions within each type.
    asked = Counter((item.task, json.dumps(item.messages) + str(item.prompt)) for item in taskset.items)
    assert max(asked.values()) == 1


def test_hash_is_stable(taskset: TaskSet) -> None:
    assert taskset.content_hash == BUILTIN_SHA256
    assert builtin_taskset().content_hash == BUILTIN_SHA256  # no hidden state between calls


def test_round_trips(taskset: TaskSet, tmp_path: Path) -> None:
    for item in taskset.items:
        assert TaskItem.from_dict(json.loads(json.dumps(item.to_dict()))) == item
    path = tmp_path / "builtin.jsonl"
    assert write_taskset(taskset, path) == BUILTIN_SHA256
    again = read_taskset(path)
    assert again.items == taskset.items
    assert again.content_hash == BUILTIN_SHA256


def _perfect(item: TaskItem) -> Answer:
    """An answer the item's own expectation describes."""
    expected = item.expected
    if item.checker == "numeric":
        return Answer(f"{expected}")
    if item.checker == "normalized":
        return Answer(f" a {expected[0]}.")  # how the model finishes "A mouse is"
    if item.checker in ("choice", "contains"):
        return Answer(expected)
    if item.checker == "json_schema":
        return Answer(json.dumps(expected))
    if item.checker == "tool_call":
        return Answer("", ((expected["name"], json.dumps(expected["arguments"])),), "tool_calls")
    return Answer(f"An answer to {item.id}.")


def _wrong(item: TaskItem) -> Answer:
    expected = item.expected
    if item.checker == "numeric":
        return Answer(f"{expected + 1}")
    if item.checker == "normalized":
        return Answer(" a stone.")
    if item.checker == "choice":
        return Answer("B" if expected == "A" else "A")
    if item.checker == "contains":
        return Answer("I do not know.")
    if item.checker == "json_schema":
        first = next(iter(expected))
        return Answer(json.dumps({k: v for k, v in expected.items() if k != first}))  # a required key missing
    if item.checker == "tool_call":
        other = next(t["function"]["name"] for t in item.request["tools"]
                     if t["function"]["name"] != expected["name"])
        return Answer("", ((other, "{}"),), "tool_calls")
    return Answer("Something else.")


def test_own_answers_are_judged_right(taskset: TaskSet) -> None:
    for item in taskset.items:
        perfect = _perfect(item)
        reference = perfect if item.checker == "agree" else None
        verdict = check(item.check_spec(), perfect, reference)
        assert verdict.correct is True, (item.id, verdict.reason)


def test_wrong_answers_are_judged_wrong(taskset: TaskSet) -> None:
    for item in taskset.items:
        reference = _perfect(item) if item.checker == "agree" else None
        verdict = check(item.check_spec(), _wrong(item), reference)
        assert verdict.correct is False, (item.id, verdict.reason)


def test_open_items_need_a_reference(taskset: TaskSet) -> None:
    item = next(i for i in taskset.items if i.task == "open")
    assert check(item.check_spec(), Answer("The sea is wide.")).correct is None


def test_structured_and_tool_items_carry_their_schema(taskset: TaskSet) -> None:
    for item in taskset.items:
        if item.task == "structured":
            schema = item.request["response_format"]["json_schema"]["schema"]
            assert set(schema["required"]) == set(item.expected)
            wrong_type = {k: (str(v) if isinstance(v, int) else v) for k, v in item.expected.items()}
            if wrong_type != item.expected:  # an integer given as a string fails the schema
                assert check(item.check_spec(), Answer(json.dumps(wrong_type))).correct is False
        if item.task == "tool_call":
            names = [t["function"]["name"] for t in item.request["tools"]]
            assert 3 <= len(names) <= 4 and item.expected["name"] in names
            assert item.request["tool_choice"] == "required"

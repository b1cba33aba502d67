"""Judging finished requests, and the per-task-type quality of a run.

Every completed request that came from a task set is checked when it finishes
(``judge``): the checker's verdict and reason go into its record. A run's quality
(``quality_summary``) is, per task type, how many answers were judged, how many were
correct, the share with its Wilson interval, and how many could not be judged (an ``agree``
item with no reference answer) or got no answer (errors and timeouts; those are already in
the error rate and are never counted as wrong answers).

The references an ``agree`` item is judged against are another run's answers to the same items
(``answers_of_items``): in an experiment, the baseline's quality pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from loadtests.client import RequestRecord
from loadtests.quality.checkers import Answer, check
from loadtests.quality.stats import wilson
from loadtests.trace import TraceRequest

CONFIDENCE = 0.95


def answer_of(record: RequestRecord) -> Answer:
    calls = tuple((str(name), str(args)) for name, args in (record.tool_calls or []))
    return Answer(record.text or "", calls, record.finish_reason)


def judge(record: RequestRecord, request: TraceRequest, references: Mapping[str, Answer] | None = None) -> None:
    """Check one finished request's answer in place (a no-op for synthetic or unfinished requests)."""
    if request.check is None or record.status != "ok":
        return
    reference = None if references is None else references.get(request.item_id)
    try:
        verdict = check(request.check, answer_of(record), reference)
    except Exception as exc:  # noqa: BLE001 - a checker's bug must not end a run; the answer stays unjudged
        record.correct, record.check_reason = None, f"the checker failed: {type(exc).__name__}: {exc}"[:300]
        return
    record.correct, record.check_reason = verdict.correct, verdict.reason


def item_answer(item: Mapping[str, Any]) -> Answer:
    """One answered item of a run result's ``items`` (what ``runner.answered_items`` keeps) as an Answer."""
    calls = tuple((str(n), str(a)) for n, a in item.get("tool_calls") or [])
    return Answer(str(item.get("text") or ""), calls, item.get("finish_reason"))


def answers_of_items(items: Mapping[str, Mapping[str, Any]]) -> dict[str, Answer]:
    """Item id -> the answer a run gave, from its result's ``items`` (request id -> answer and verdict);
    an item asked twice keeps its first answer."""
    out: dict[str, Answer] = {}
    for rid, item in items.items():
        out.setdefault(rid.split("#", 1)[0], item_answer(item))
    return out


def quality_summary(records: Iterable[RequestRecord], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """Per task type: judged, correct, correct share and its Wilson interval, unjudged, unanswered."""
    by_task: dict[str, dict[str, int]] = {}
    for record in records:
        if record.task is None or record.status == "cancelled":
            continue
        counts = by_task.setdefault(record.task, {"judged": 0, "correct": 0, "unjudged": 0, "unanswered": 0})
        if record.status != "ok":
            counts["unanswered"] += 1
        elif record.correct is None:
            counts["unjudged"] += 1
        else:
            counts["judged"] += 1
            counts["correct"] += int(record.correct)
    return _shares(by_task, confidence)


def quality_of_items(items: Mapping[str, Mapping[str, Any]], asked: Mapping[str, str],
                     confidence: float = CONFIDENCE) -> dict[str, Any]:
    """``quality_summary`` from a pass's answered items (request id -> answer and verdict) and every
    item it asked (request id -> task type): what was never answered counts as unanswered."""
    by_task: dict[str, dict[str, int]] = {}
    for rid, task in asked.items():
        counts = by_task.setdefault(task, {"judged": 0, "correct": 0, "unjudged": 0, "unanswered": 0})
        item = items.get(rid)
        if item is None:
            counts["unanswered"] += 1
        elif item.get("correct") is None:
            counts["unjudged"] += 1
        else:
            counts["judged"] += 1
            counts["correct"] += int(bool(item["correct"]))
    return _shares(by_task, confidence)


def _shares(by_task: dict[str, dict[str, int]], confidence: float) -> dict[str, Any]:
    """The counts per task type with the correct share and its Wilson interval."""
    out: dict[str, Any] = {}
    for task in sorted(by_task):
        counts = by_task[task]
        n, k = counts["judged"], counts["correct"]
        lo, hi = wilson(k, n, confidence) if n else (None, None)
        out[task] = {**counts, "correct_rate": k / n if n else None, "ci_low": lo, "ci_high": hi}
    return out

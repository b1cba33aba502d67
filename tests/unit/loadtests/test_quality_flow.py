"""Answer quality through the load tool: task items in traces, answers kept and judged, accepted
answers that must be correct, and experiment verdicts that respect quality per task type."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.client import ClientConfig, RequestRecord, _StreamState, request_body
from loadtests.decision import decide
from loadtests.experiment import ExperimentError, load_experiment
from loadtests.metrics import CostModel, GoodputSLO, summarize
from loadtests.quality import decide as qd
from loadtests.quality.judge import judge, quality_summary
from loadtests.quality.mix import draw, full_pass_trace, mix_tasks, taskset_trace
from loadtests.quality.tasks import TaskItem, TaskSet
from loadtests.report import render_board, render_decision
from loadtests.trace import Trace, TraceRequest, content_hash

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
ITEMS = [
    TaskItem(id="a1", task="arithmetic", checker="numeric", expected=12, max_tokens=8,
             messages=[{"role": "user", "content": "What is 7 + 5?"}]),
    TaskItem(id="a2", task="arithmetic", checker="numeric", expected=3, max_tokens=8,
             messages=[{"role": "user", "content": "What is 7 - 4?"}]),
    TaskItem(id="s1", task="structured", checker="json_schema", expected={"city": "Lisbon"}, max_tokens=32,
             messages=[{"role": "user", "content": "Ana lives in Lisbon. JSON please."}],
             request={"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}}),
    TaskItem(id="o1", task="open", checker="agree", max_tokens=16, prompt="Write about the sea."),
]
TASKS = TaskSet(ITEMS, {"name": "unit", "version": "1"})


def synthetic(n: int) -> Trace:
    return Trace([TraceRequest(id=f"chat-{i}", max_tokens=16, prompt="x " * 4, offset_s=0.5 * i, group="chat",
                               cancel_after=3) for i in range(n)], {"scenario": "chat"})


def test_a_trace_without_task_items_keeps_its_hash_and_task_items_round_trip() -> None:
    plain = TraceRequest(id="r", max_tokens=4, prompt="p")
    assert set(plain.to_dict()) == {"id", "offset_s", "group", "prompt", "max_tokens", "prefix_group",
                                    "cancel_after", "prompt_tokens"}
    trace = taskset_trace(TASKS, 6, seed=1)
    again = [TraceRequest.from_dict(r.to_dict()) for r in trace.requests]
    assert again == trace.requests and content_hash(again) == trace.content_hash
    # every item once before any repeats, the repeats marked
    assert sorted(r.id for r in trace.requests[:4]) == ["a1", "a2", "o1", "s1"]
    assert all(r.id.endswith("#2") for r in trace.requests[4:])
    assert trace.requests[4].item_id == trace.requests[4].id[:-2]
    assert taskset_trace(TASKS, 6, seed=1).content_hash == trace.content_hash
    assert taskset_trace(TASKS, 6, seed=2).content_hash != trace.content_hash
    with pytest.raises(ValueError, match="'task' and 'check' go together"):
        TraceRequest.from_dict({"max_tokens": 1, "prompt": "p", "task": "x"})
    with pytest.raises(ValueError, match="'checker' is one of"):
        TraceRequest.from_dict({"max_tokens": 1, "prompt": "p", "task": "x", "check": {"checker": "judge-llm"}})


def test_mixing_replaces_a_seeded_share_and_keeps_the_offsets() -> None:
    base = synthetic(200)
    mixed = mix_tasks(base, TASKS, 0.25, seed=0)
    tasked = [r for r in mixed.requests if r.task is not None]
    assert 30 <= len(tasked) <= 70  # a quarter of 200, seeded
    assert [r.offset_s for r in mixed.requests] == [r.offset_s for r in base.requests]
    assert all(r.cancel_after is None and r.group == "tasks" for r in tasked)  # an item is never cut short
    assert mix_tasks(base, TASKS, 0.25, seed=0).content_hash == mixed.content_hash
    assert mix_tasks(base, TASKS, 0.0, seed=0) is base
    assert all(r.task is not None for r in mix_tasks(base, TASKS, 1.0, seed=0).requests)
    with pytest.raises(ValueError):
        mix_tasks(base, TASKS, 1.01, seed=0)
    assert mixed.describe()["task_requests"] == {t: sum(1 for r in tasked if r.task == t)
                                                  for t in ("arithmetic", "open", "structured")}
    first = [item.id for (item, _), _ in zip(draw(TASKS, 0), range(4), strict=False)]
    assert sorted(first) == ["a1", "a2", "o1", "s1"]


def test_a_task_request_is_sent_greedy_with_its_own_fields() -> None:
    (s1,) = [r for r in full_pass_trace(TASKS).requests if r.id == "s1"]
    config = ClientConfig("http://x", "m", temperature=0.8, ignore_eos=True, extra_body={"top_p": 0.9})
    path, body = request_body(s1, config)
    assert path == "/v1/chat/completions"
    assert body["temperature"] == 0.0 and "top_p" not in body and "ignore_eos" not in body
    assert body["response_format"]["json_schema"]["schema"] == SCHEMA
    plain = TraceRequest(id="r", max_tokens=4, prompt="p")
    _, body = request_body(plain, config)
    assert body["temperature"] == 0.8 and body["ignore_eos"] is True and body["top_p"] == 0.9


def _stream(record: RequestRecord, keep: bool, chunks: list[dict]) -> _StreamState:
    state = _StreamState(record, 0.0, None, keep=keep)
    for i, chunk in enumerate(chunks):
        state.on_chunk(chunk, 0.01 * (i + 1))
    return state


def test_the_answer_is_kept_for_checked_requests_only_with_its_tool_calls() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "Hel"}}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c", "function": {"name": "get_weather", "arguments": "{\"ci"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": "ty\": \"Paris\"}"}}]}, "finish_reason": "tool_calls"}]},
    ]
    kept = _stream(RequestRecord("r", "g", task="tools"), True, chunks)
    assert kept.answer() == ("Hello", [["get_weather", "{\"city\": \"Paris\"}"]])
    assert kept.num_chunks == 4  # a tool call's deltas are output, timed like text
    plain = _stream(RequestRecord("r", "g"), False, chunks)
    assert plain.answer() == ("", []) and plain.num_chunks == 2
    assert "text" not in RequestRecord("r", "g").to_dict()  # synthetic records stay as they were


def _record(rid: str, task: str | None, ok: bool = True, text: str = "", ttft: float = 0.1) -> RequestRecord:
    return RequestRecord(rid, "g", status="ok" if ok else "error", ttft_s=ttft, latency_s=ttft + 0.1,
                         output_tokens=2, task=task, text=text if task else None, tool_calls=[] if task else None,
                         finish_reason="stop")


def test_an_accepted_answer_met_the_slos_and_is_correct() -> None:
    requests = {r.id: r for r in full_pass_trace(TASKS).requests}
    records = [
        _record("a1", "arithmetic", text="12"),            # right, on time
        _record("a2", "arithmetic", text="4"),             # wrong, on time
        _record("s1", "structured", text='{"city": "Lisbon"}', ttft=5.0),  # right, late
        _record("o1", "open", text="The sea."),            # nothing to judge against: the SLOs alone
        _record("x", None),                                # synthetic, on time
        _record("a1#2", "arithmetic", ok=False),           # no answer: an error, not a wrong answer
    ]
    for record in records:
        judge(record, requests.get(record.req_id.split("#")[0], TraceRequest("x", 1, prompt="p")))
    assert [r.correct for r in records] == [True, False, True, None, None, None]
    assert records[1].check_reason and "4" in records[1].check_reason
    summary = summarize(records, 10.0, GoodputSLO(ttft_ms=1000), CostModel(3.6))
    assert summary["accepted_slo_only"] == 4 and summary["accepted"] == 3  # a1, o1, x
    assert summary["cost_per_accepted"] == pytest.approx(3.6 * 10 / 3600 / 3)
    assert summary["checked"] == 3 and summary["correct"] == 2
    q = summary["quality"]
    assert q["arithmetic"] == {**q["arithmetic"], "judged": 2, "correct": 1, "unanswered": 1, "correct_rate": 0.5}
    assert q["open"]["unjudged"] == 1 and q["open"]["correct_rate"] is None
    assert 0.0 < q["arithmetic"]["ci_low"] < 0.5 < q["arithmetic"]["ci_high"] < 1.0
    # without a goodput SLO every completed answer is on time; a wrong one is still not accepted
    assert summarize(records, 10.0, GoodputSLO(), CostModel())["accepted"] == 4
    assert quality_summary([]) == {}


def _items(spec: dict[str, tuple[str, bool | None, str]]) -> dict[str, dict]:
    return {rid: {"task": task, "correct": ok, "text": text, "tool_calls": []} for rid, (task, ok, text) in spec.items()}


def test_pairs_determinism_and_agreement() -> None:
    base = _items({"a1": ("arith", True, "12"), "a2": ("arith", False, "4"), "o1": ("open", None, "sea"),
                   "o2": ("open", None, "sky"), "a3#2": ("arith", True, "1")})
    var = _items({"a1": ("arith", False, "13"), "a2": ("arith", True, "3"), "o1": ("open", None, "sea"),
                  "o2": ("open", True, "SKY"), "a3": ("arith", True, "1")})
    pairs = qd.pairs_by_task(base, var, "same")
    assert pairs == {"arith": [(True, False), (False, True), (True, True)], "open": [(True, True), (True, False)]}
    assert "open" not in qd.pairs_by_task(base, var, "may_change")
    # the baseline's repeat that disagreed with its first run is the baseline side of an agree item
    repeat = _items({"o1": ("open", None, "SEA"), "o2": ("open", None, "sky")})
    assert qd.pairs_by_task(base, var, "same", repeat)["open"] == [(False, True), (True, False)]
    check = qd.determinism(base, var)
    assert check == {"compared": 5, "differing": 3, "identical": False, "first_differing": ["a1", "a2", "o2"]}
    assert qd.determinism(base, base)["identical"] is True
    assert qd.determinism(base, {})["identical"] is False
    assert qd.answers_mode("max_num_seqs", None) == "same"
    assert qd.answers_mode("quantization", None) == "may_change"
    assert qd.answers_mode("quantization", "same") == "same"
    with pytest.raises(ValueError):
        qd.answers_mode("x", "maybe")


MINIMAL = """
title = "t"
[server]
kind = "command"
command = "my-server --port {port} --model {model}"
model = "m"
[baseline]
max_num_seqs = 8
[workload]
scenario = "chat"
rates = [1]
[quality]
tasks = "builtin"
mix = 0.2
[[variants]]
name = "v"
knob = "quantization"
value = "int8"
hypothesis = "h"
pass = "ttft_p95_ms <= baseline.ttft_p95_ms"
"""


def _config(name: str, ttft: float, correct: list[bool]) -> dict:
    items = {f"i{k}": {"task": "arith", "correct": ok, "text": str(ok), "tool_calls": []}
             for k, ok in enumerate(correct)}
    runs = [{"rate": 1.0, "slo_violations": [], "summary": {"ttft_p95_ms": ttft}}]
    return {"name": name, "runs": runs, "sweep": {"max_rate_meeting_slo": 1.0},
            "quality_pass": {"items": items, "summary": {}}}


def test_a_faster_variant_that_loses_quality_beyond_noise_is_worse(tmp_path: Path) -> None:
    path = tmp_path / "e.toml"
    path.write_text(MINIMAL)
    experiment = load_experiment(path)
    assert experiment.quality is not None and experiment.quality.mix == 0.2
    variant = experiment.variants[0]
    assert variant.answers == "may_change"
    base_ok = [True] * 20 + [False] * 20
    baselines = [_config("baseline", 100.0, base_ok), _config("baseline (repeat 2)", 100.0, base_ok)]
    # 6 items right on the baseline and wrong on the variant, none the other way: p = 2 * 0.5**6 < 0.05
    dropped = [False] * 6 + [True] * 14 + [False] * 20
    record = decide(experiment, variant, baselines, _config("v", 50.0, dropped), {})
    assert record["latency_verdict"] == "better"
    assert record["verdict"] == "worse: quality (arith -15.0 pts)"
    (call,) = record["quality"]
    assert (call["baseline_only"], call["variant_only"], call["call"]) == (6, 0, "worse")
    assert call["p_value"] == pytest.approx(2 * 0.5**6)
    assert record["determinism"]["differing"] == 6 and record["baseline_repeatability"]["identical"]
    text = render_decision(record)
    assert "quality dropped beyond noise in arith (20 -> 14 of 40 correct)" in text
    assert "not identical: 6 of 40 items differ" in text and "**latency and cost alone**: better" in text
    # 5 against 0 is p = 0.0625: inside the noise, so a faster variant is "no decision", with the items to settle
    close = [False] * 5 + [True] * 15 + [False] * 20
    record = decide(experiment, variant, baselines, _config("v", 50.0, close), {})
    assert record["verdict"] == "no decision: quality within noise (arith)"
    assert "items of this type would settle it" in record["to_settle"]
    # the same drop on a slower variant stays "worse" for its latency
    assert decide(experiment, variant, baselines, _config("v", 200.0, close), {})["verdict"] == "worse"
    # no drop at all: the latency verdict stands
    same = decide(experiment, variant, baselines, _config("v", 50.0, base_ok), {})
    assert same["verdict"] == "better" and same["determinism"]["identical"]


def test_quality_section_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "e.toml"
    for change, message in ((("mix = 0.2", "mix = 1.5"), "mix must be in"),
                            (("mix = 0.2", "full_pass = false"), "checks nothing"),
                            (("mix = 0.2", "mix = 0.2\nconfidence = 1.0"), "confidence"),
                            (("mix = 0.2", "mix = 0.2\nbogus = 1"), "unknown keys"),
                            (('pass = "', 'answers = "maybe"\npass = "'), "answers must be")):
        path.write_text(MINIMAL.replace(*change))
        with pytest.raises(ExperimentError, match=message):
            load_experiment(path)
    # the bounds at their edges: mix 0 and 1, confidence 0.5, margin 0 are allowed; just past them are not
    for change in (("mix = 0.2", "mix = 1.0"), ("mix = 0.2", "mix = 0.0"), ("mix = 0.2", "confidence = 0.5"),
                   ("mix = 0.2", "margin = 0.0")):
        path.write_text(MINIMAL.replace(*change))
        assert load_experiment(path).quality is not None
    for change in (("mix = 0.2", "confidence = 0.4999"), ("mix = 0.2", "margin = -0.001"),
                   ("mix = 0.2", "margin = 1.0"), ("mix = 0.2", "mix = -0.01"), ("mix = 0.2", "concurrency = 0")):
        path.write_text(MINIMAL.replace(*change))
        with pytest.raises(ExperimentError):
            load_experiment(path)


def test_the_board_shows_quality_per_task_type() -> None:
    summary = {"offered_rps": 1.0, "quality": {"arith": {"judged": 40, "correct": 20, "correct_rate": 0.5,
                                                         "ci_low": 0.35, "ci_high": 0.65, "unjudged": 0,
                                                         "unanswered": 1}}}
    results = {"meta": {"title": "t"}, "configs": [
        {"name": "run", "runs": [{"name": "1rps", "summary": summary}], "sweep": {},
         "quality_pass": {"name": "quality-pass", "summary": summary}, "determinism": {
             "compared": 4, "differing": 1, "identical": False, "first_differing": ["a1"]}}]}
    board = render_board(results)
    assert "## Answer quality by task type" in board
    assert "| 1rps | arith | 40 | 20 | 50.0% | 35.0% - 65.0% | 0 | 1 |" in board
    assert "| quality-pass | arith | 40 |" in board  # the config named "run" is not repeated
    assert "not identical: 1 of 4 items differ (first: `a1`)" in board


def test_a_checker_that_fails_leaves_the_answer_unjudged(monkeypatch: pytest.MonkeyPatch) -> None:
    import loadtests.quality.judge as judge_module

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(judge_module, "check", broken)
    (a1,) = [r for r in full_pass_trace(TASKS).requests if r.id == "a1"]
    record = _record("a1", "arithmetic", text="12")
    judge(record, a1)
    assert record.correct is None and record.check_reason == "the checker failed: KeyError: 'boom'"


def test_quality_of_a_pass_counts_what_was_never_answered() -> None:
    from loadtests.quality.judge import quality_of_items

    items = {"a1": {"correct": True}, "a2": {"correct": False}, "o1": {"correct": None}}
    q = quality_of_items(items, {"a1": "arith", "a2": "arith", "a3": "arith", "o1": "open"})
    assert q["arith"] == {**q["arith"], "judged": 2, "correct": 1, "unanswered": 1, "correct_rate": 0.5}
    assert q["open"]["unjudged"] == 1 and q["open"]["correct_rate"] is None


def test_the_quality_pass_asks_refused_items_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that refuses half of what it is asked (a 429 from a small queue) still gets every item
    answered: refused items go again with fewer in flight."""
    import loadtests.experiment_run as run_module

    calls: list[tuple[int, int]] = []

    def fake_run_once(trace: Trace, plan, settings) -> dict:  # type: ignore[no-untyped-def]
        calls.append((len(trace.requests), plan.concurrency))
        answered = trace.requests[: max(1, len(trace.requests) // 2)]  # the rest refused
        return {"summary": {}, "items": {r.id: {"task": r.task, "correct": True} for r in answered}}

    monkeypatch.setattr(run_module, "run_once", fake_run_once)
    monkeypatch.setattr(run_module.time, "sleep", lambda s: None)
    result = run_module.quality_pass(TASKS, None, 8, "v", lambda m: None)  # type: ignore[arg-type]
    assert calls == [(4, 8), (2, 4), (1, 2)]
    assert result["retried"] == [2, 1] and len(result["items"]) == 4
    assert all(q["unanswered"] == 0 for q in result["summary"]["quality"].values())
    calls.clear()
    result = run_module.quality_pass(TASKS, None, 8, "v", lambda m: None, retries=1)  # type: ignore[arg-type]
    assert calls == [(4, 8), (2, 4)]  # one round of retries only: one item stays unanswered, and says so
    assert sum(q["unanswered"] for q in result["summary"]["quality"].values()) == 1

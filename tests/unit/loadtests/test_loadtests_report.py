"""The board, results.json, decision records and PNG plots written from a hand-made result."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests.report import render_board, write_results


def summary(rate: float, **kw: object) -> dict:
    base = {
        "offered_rps": rate, "completed_rps": rate * 0.9, "sent_rps": rate, "ttft_p95_ms": 100 * rate,
        "ttft_p50_ms": 50.0, "ttft_p99_ms": 120 * rate, "queue_p95_ms": None, "queue_mean_ms": None,
        "e2e_p95_ms": 900.0, "error_rate": 0.0, "preemptions": None, "output_tok_s": 12.5, "itl_p95_ms": 20.0,
        "tpot_mean_ms": 15.0, "tpot_p95_ms": 18.0, "completed": 9, "cancelled": 1, "errors": 0, "errors_429": 0,
        "errors_503": 0, "errors_timeout": 0, "errors_other": 0, "peak_memory_bytes": None,
        "goodput_rps": None, "cost_per_accepted": None, "e2e_p50_ms": 500.0, "itl_p50_ms": 10.0,
    }
    return {**base, **kw}


def run(rate: float, **kw: object) -> dict:
    series = {"t_s": [0.0, 0.5, 1.0], "running": [0, 2, 1], "waiting": [0, 1, 0], "memory_bytes": [1, 2, 3],
              "client_t_s": [0.0, 0.1, 0.9], "client_in_flight": [0, 1, 0]}
    return {"name": f"{rate:g}rps", "rate": rate, "summary": summary(rate, **kw), "groups": {},
            "slo_violations": [], "series": series}


RESULTS = {
    "meta": {"title": "T", "command": "ferry bench run --rates 1,2", "started_at": "now",
             "trace": {"scenario": "chat", "seed": 0, "num_requests": 20, "sha256": "ab" * 32, "format_version": 1,
                       "tokenizer": "tok"},
             "base_url": "http://x"},
    "configs": [{"name": "run", "runs": [
        run(1.0, queue_p95_ms=150.0, preemptions=0.0, peak_memory_bytes=512 * 2**20),
        {**run(2.0, queue_p95_ms=290.0, queue_p95_below_ms=300.0),
         "slo_violations": ["p95 TTFT 200 ms > 150 ms"],
         "groups": {"chat": summary(2.0, completed_rps=1.0), "agent-rag": summary(2.0, completed_rps=0.8)}},
    ], "sweep": {"checked": True, "max_rate_meeting_slo": 1.0, "stopped_at": 2.0,
                 "broken": ["p95 TTFT 200 ms > 150 ms"]}}],
}


def test_board_has_the_methods_columns_and_na() -> None:
    board = render_board(RESULTS)
    assert "| run | offered req/s | completed req/s | p95 TTFT ms | p95 queue ms | p95 end-to-end ms | error rate " \
           "| preemptions |" in board
    assert "| 1rps | 1 | 0.9 | 100 | 150 | 900 | 0.000 | 0 |" in board
    # A queue p95 inside the histogram's first bucket is only a bound; no preemption counter: n/a.
    assert "| 2rps | 2 | 1.8 | 200 | <300 | 900 | 0.000 | n/a |" in board
    assert "missed: p95 TTFT 200 ms > 150 ms" in board
    assert "highest rate meeting the SLO: 1 req/s; stopped at 2 req/s" in board
    assert "`ferry bench run --rates 1,2`" in board and "sha256 `abababababababab`" in board
    assert "| 2rps | chat | 1 |" in board and "| 2rps | agent-rag | 0.8 |" in board
    assert "| 512 |" in board  # peak server MiB


def test_a_board_without_targets_never_says_met() -> None:
    no_targets = {**RESULTS, "configs": [{"name": "run", "sweep": {}, "runs": [
        {**run(1.0), "slo_targets": False},
        {**run(2.0), "slo_targets": False, "slo_violations": ["no request completed"]},
    ]}]}
    board = render_board(no_targets)
    assert "met" not in board.replace("no targets", "")
    assert board.count("| no targets |") == 1 and "no targets (no request completed)" in board


def test_saturated_runs_are_marked_on_the_board() -> None:
    results = {**RESULTS, "configs": [{"name": "run", "sweep": {}, "runs": [
        run(1.0, saturated=False, saturation_reasons=[], completion_ratio=0.98),
        run(4.0, saturated=True, saturation_reasons=["completed 61% of the offered rate (margin 10%)"],
            completion_ratio=0.61),
    ]}]}
    board = render_board(results)
    assert "| preemptions | saturated |" in board
    assert "| no (98% completed) |" in board
    assert "| **yes**: completed 61% of the offered rate (margin 10%) |" in board


def test_files_written(tmp_path: Path) -> None:
    decisions = [{"variant": "v1", "hypothesis": "h", "changed_parameter": "k: 1 -> 2", "input_set": {"a": 1},
                  "pass_condition": "x < 1", "measured_outcome": {"x": 0.5}, "verdict": "pass"}]
    written = write_results({**RESULTS, "decisions": decisions}, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["tool"] == "ferry-loadtests" and data["results_version"] == 1
    assert data["configs"][0]["runs"][1]["summary"]["ttft_p95_ms"] == 200.0
    assert "## Decision record: v1" in (tmp_path / "board.md").read_text()
    record = (tmp_path / "decision-v1.md").read_text()
    for field in ("hypothesis", "changed parameter", "input set", "pass condition", "measured outcome", "verdict"):
        assert f"**{field}**" in record
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["latency_vs_rate.png", "throughput_vs_rate.png", "timeline-1rps.png", "timeline-2rps.png"]
    for name in pngs:
        blob = (tmp_path / name).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 5000
    assert set(written) >= {"board", "results", "latency_plot", "throughput_plot", "decision:v1"}


def test_decision_record_shows_variant_against_baseline(tmp_path: Path) -> None:
    outcome = {"decision_rate": 2.0,
               "variant": {"ttft_p95_ms": 1234.5, "queue_p95_ms": 285.0, "queue_p95_below_ms": 300.0,
                           "goodput_rps": None},
               "baseline": {"ttft_p95_ms": 99.25, "queue_p95_ms": 400.0, "queue_p95_below_ms": None,
                            "goodput_rps": 0.5}}
    decision = {"variant": "v", "hypothesis": "h", "changed_parameter": "k: 1 -> 2", "input_set": {},
                "pass_condition": "ttft_p95_ms < baseline.ttft_p95_ms", "measured_outcome": outcome,
                "verdict": "fail"}
    write_results({**RESULTS, "decisions": [decision]}, tmp_path)
    record = (tmp_path / "decision-v.md").read_text()
    assert "at 2 req/s" in record
    assert "| ttft_p95_ms | 99.25 | 1,234 |" in record  # baseline first, then the variant
    assert "| queue_p95_ms | 400 | <300 |" in record
    assert "| goodput_rps | 0.5 | n/a |" in record and "below" not in record


def test_plots_survive_a_run_with_nothing(tmp_path: Path) -> None:
    empty = {**RESULTS, "configs": [{"name": "run", "runs": [
        {"name": "1rps", "rate": 1.0, "groups": {}, "slo_violations": ["no request completed"], "series": {},
         "summary": {k: None for k in summary(1.0)} | {"offered_rps": 1.0}}], "sweep": {}}]}
    write_results(empty, tmp_path)
    assert "| 1rps | 1 | n/a | n/a | n/a | n/a | n/a | n/a |" in (tmp_path / "board.md").read_text()
    assert (tmp_path / "timeline-1rps.png").stat().st_size > 0


def test_decision_record_shows_repeats_spread_and_memory(tmp_path: Path) -> None:
    outcome = {"decision_rate": 1.0,
               "variant": {"ttft_p95_ms": 900.0}, "baseline": {"ttft_p95_ms": 1075.0},
               "baseline_runs": {"ttft_p95_ms": [1000.0, 1150.0]}, "spread": {"ttft_p95_ms": 150.0},
               "difference": {"ttft_p95_ms": -175.0}, "call": {"ttft_p95_ms": "better"}}
    memory = {"baseline": {"measured": {"weight_bytes": 100 * 2**20, "kv_blocks_total": 1000,
                                        "peak_kv_blocks_used": 250, "peak_kv_usage": 0.25, "preemptions": 0,
                                        "peak_memory_bytes": 900 * 2**20},
                           "predicted": {"weight_bytes": 101 * 2**20, "kv_blocks": 1000,
                                         "max_concurrency_at_typical": 40, "typical_len": 400,
                                         "command": "ferry plan --model m --devices cpu:1"}}}
    decision = {"variant": "v", "hypothesis": "h", "changed_parameter": "k: 1 -> 2", "input_set": {},
                "pass_condition": "ttft_p95_ms < baseline.ttft_p95_ms", "measured_outcome": outcome,
                "verdict": "better", "noise_rule": "2 baseline runs; spread = max(range, 0.05 x mean)",
                "condition_on_means": "pass", "memory": memory}
    write_results({**RESULTS, "decisions": [decision]}, tmp_path)
    record = (tmp_path / "decision-v.md").read_text()
    assert "| ttft_p95_ms | 1,000, 1,150 | 1,075 | 900 | -175 | 150 | better |" in record
    assert "**noise rule**: 2 baseline runs" in record
    assert "| baseline | 100 (101) | 250 / 1,000 (1,000) | 25% | 40 (typical 400 tokens) | 0 | 900 |" in record
    assert "prediction: `ferry plan --model m --devices cpu:1`" in record


def test_a_sweep_whose_first_rate_broke_the_slo_says_none() -> None:
    import copy

    results = copy.deepcopy(RESULTS)
    results["configs"][0]["sweep"]["max_rate_meeting_slo"] = None  # type: ignore[index]
    board = render_board(results)
    assert "highest rate meeting the SLO: none (the first rate already broke it); stopped at 2 req/s" in board
    assert "n/a req/s" not in board

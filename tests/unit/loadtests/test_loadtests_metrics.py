"""Measures against hand-computed values: percentiles, TPOT, ITL, goodput, cost, errors, server deltas."""

from __future__ import annotations

import pytest

from loadtests.client import RequestRecord
from loadtests.metrics import CostModel, GoodputSLO, RunSLO, is_good, slo_violations, summarize, tpot_s
from loadtests.scrape import (
    MetricNames,
    first_bucket_bound,
    histogram_delta,
    histogram_quantile,
    parse_metrics,
    server_deltas,
)


def rec(req_id: str, status: str = "ok", **kw: object) -> RequestRecord:
    return RequestRecord(req_id, kw.pop("group", "g"), status=status, **kw)  # type: ignore[arg-type]


RECORDS = [
    rec("r1", ttft_s=0.1, latency_s=1.0, output_tokens=10, itl_s=[0.1] * 9, prompt_tokens=5),
    rec("r2", ttft_s=0.3, latency_s=0.5, output_tokens=3, itl_s=[0.05, 0.15], prompt_tokens=5),
    rec("r3", ttft_s=0.2, latency_s=0.2, output_tokens=1, prompt_tokens=5),
    rec("r4", "cancelled", ttft_s=0.05, latency_s=0.1, output_tokens=2),
    rec("r5", "error", error_kind="429", http_status=429),
    rec("r6", "error", error_kind="timeout"),
]


@pytest.fixture()
def summary() -> dict:
    return summarize(RECORDS, 2.0, GoodputSLO(ttft_ms=250, tpot_ms=150), CostModel(3.6, 2), offered_rps=3.0)


def test_counts_and_rates(summary: dict) -> None:
    assert (summary["num_requests"], summary["completed"], summary["cancelled"], summary["errors"]) == (6, 3, 1, 2)
    assert (summary["errors_429"], summary["errors_503"], summary["errors_timeout"], summary["errors_other"]) == (
        1, 0, 1, 0)
    assert summary["error_rate"] == pytest.approx(2 / 6)
    assert summary["completed_rps"] == pytest.approx(1.5)
    assert summary["output_tok_s"] == pytest.approx(14 / 2.0)  # completed requests only
    assert summary["total_tok_s"] == pytest.approx((15 + 14) / 2.0)
    assert summary["offered_rps"] == 3.0


def test_ttft_and_e2e_percentiles_interpolate_linearly(summary: dict) -> None:
    # TTFTs 100, 200, 300 ms: p95 sits 0.9 of the way from 200 to 300.
    assert summary["ttft_p50_ms"] == pytest.approx(200.0)
    assert summary["ttft_p95_ms"] == pytest.approx(290.0)
    assert summary["ttft_p99_ms"] == pytest.approx(298.0)
    assert summary["ttft_mean_ms"] == pytest.approx(200.0)
    # End-to-end 200, 500, 1000 ms.
    assert summary["e2e_p95_ms"] == pytest.approx(950.0)


def test_tpot_excludes_the_first_token_and_single_token_answers(summary: dict) -> None:
    assert tpot_s(RECORDS[0]) == pytest.approx(0.9 / 9)
    assert tpot_s(RECORDS[1]) == pytest.approx(0.2 / 2)
    assert tpot_s(RECORDS[2]) is None
    assert summary["tpot_mean_ms"] == pytest.approx(100.0)


def test_itl_pools_every_gap_of_every_completed_request(summary: dict) -> None:
    # 9 gaps of 100 ms, one of 50, one of 150: sorted index 9.5 for p95.
    assert summary["itl_p50_ms"] == pytest.approx(100.0)
    assert summary["itl_p95_ms"] == pytest.approx(125.0)
    assert summary["itl_mean_ms"] == pytest.approx(1100.0 / 11)


def test_goodput_needs_every_slo_and_counts_tpot_zero_for_one_token(summary: dict) -> None:
    slo = GoodputSLO(ttft_ms=250, tpot_ms=150)
    assert [is_good(r, slo) for r in RECORDS] == [True, False, True, False, False, False]
    assert summary["good_requests"] == 2
    assert summary["goodput_rps"] == pytest.approx(1.0)
    assert is_good(RECORDS[0], GoodputSLO(e2el_ms=999)) is False
    assert is_good(RECORDS[0], GoodputSLO(e2el_ms=1000)) is True  # value <= limit, as vLLM


def test_cost_per_accepted_answer(summary: dict) -> None:
    # 2 s x 2 GPUs x 3.6 per GPU-hour = 0.004, over 2 accepted answers.
    assert summary["accepted"] == 2
    assert summary["cost_per_accepted"] == pytest.approx(0.002)
    no_slo = summarize(RECORDS, 2.0, GoodputSLO(), CostModel(3.6, 2))
    assert no_slo["accepted"] == 3 and no_slo["goodput_rps"] is None
    assert no_slo["cost_per_accepted"] == pytest.approx(0.004 / 3)
    assert summarize(RECORDS, 2.0, GoodputSLO(), CostModel())["cost_per_accepted"] is None


def test_empty_run_is_not_a_crash() -> None:
    summary = summarize([], 1.0, GoodputSLO(), CostModel(1.0))
    assert summary["completed"] == 0 and summary["ttft_p95_ms"] is None and summary["error_rate"] is None
    assert slo_violations(summary, RunSLO()) == ["no request completed"]


def test_goodput_parse() -> None:
    assert GoodputSLO.parse("ttft:500,tpot:50 e2el:3000") == GoodputSLO(500.0, 50.0, 3000.0)
    with pytest.raises(ValueError, match="ttft:MS"):
        GoodputSLO.parse("latency:5")


def test_slo_violations(summary: dict) -> None:
    assert slo_violations(summary, RunSLO(ttft_p95_ms=300, e2e_p95_ms=1000)) == []
    broken = slo_violations({**summary, "queue_p95_ms": 40.0}, RunSLO(ttft_p95_ms=250, error_rate=0.1,
                                                                       queue_p95_ms=30))
    assert broken == ["p95 TTFT 290 ms > 250 ms", "p95 queue 40 ms > 30 ms", "error rate 0.333 > 0.100"]
    # A measure the server does not give cannot break its target.
    assert slo_violations({**summary, "queue_p95_ms": None}, RunSLO(queue_p95_ms=1)) == []


BUCKETS = {0.1: 2.0, 0.5: 6.0, 1.0: 8.0, float("inf"): 10.0}


def test_histogram_quantile_like_prometheus() -> None:
    assert histogram_quantile(0.5, BUCKETS) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert histogram_quantile(0.1, BUCKETS) == pytest.approx(0.05)
    assert histogram_quantile(0.95, BUCKETS) == pytest.approx(1.0)  # in +Inf: the last finite bound
    assert histogram_quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None
    assert first_bucket_bound(0.1, BUCKETS) == 0.1
    assert first_bucket_bound(0.5, BUCKETS) is None


def test_histogram_delta() -> None:
    before = {0.1: 1.0, 0.5: 1.0, 1.0: 1.0, float("inf"): 1.0}
    assert histogram_delta(before, BUCKETS) == {0.1: 1.0, 0.5: 5.0, 1.0: 7.0, float("inf"): 9.0}
    assert histogram_delta(None, BUCKETS) == BUCKETS
    assert histogram_delta(before, None) is None


def _exposition(prefix: str, counts: tuple[int, int, int], total: float, preemptions: int) -> str:
    lines = [f"# TYPE {prefix}:request_queue_time_seconds histogram"]
    for model in ("a", "b"):  # two label sets are summed
        for le, count in zip(("0.1", "0.5", "+Inf"), counts, strict=True):
            lines.append(f'{prefix}:request_queue_time_seconds_bucket{{le="{le}",model_name="{model}"}} {count}')
        lines.append(f'{prefix}:request_queue_time_seconds_count{{model_name="{model}"}} {counts[-1]}')
        lines.append(f'{prefix}:request_queue_time_seconds_sum{{model_name="{model}"}} {total}')
    lines += [f"# TYPE {prefix}:num_preemptions counter", f"{prefix}:num_preemptions_total {preemptions}"]
    lines += [f'{prefix}:process_resident_memory_bytes{{process="w"}} 100',
              f'{prefix}:process_resident_memory_bytes{{process="g"}} 50']
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("prefix", ["ferry", "vllm"])
def test_server_deltas_from_two_scrapes(prefix: str) -> None:
    before = parse_metrics(_exposition(prefix, (1, 1, 1), 0.05, 3))
    after = parse_metrics(_exposition(prefix, (1, 4, 5), 1.05, 7))
    out = server_deltas(before, after, MetricNames())
    # Delta per label set: 0 below 0.1 s, 3 in (0.1, 0.5], 1 above; two label sets double it.
    assert out["queue_count"] == 8
    assert out["queue_mean_s"] == pytest.approx(2.0 / 8)
    assert out["queue_p50_s"] == pytest.approx(0.1 + 0.4 * 4 / 6)
    assert out["queue_p95_s"] == pytest.approx(0.5)
    assert out["preemptions"] == 4
    from loadtests.scrape import scalar_sum

    assert scalar_sum(after, MetricNames().memory) == 150


def test_server_without_metrics_gives_none() -> None:
    out = server_deltas(None, None, MetricNames())
    assert out["queue_p95_s"] is None and out["preemptions"] is None
    out = server_deltas(parse_metrics("up 1\n"), parse_metrics("up 1\n"), MetricNames())
    assert out["queue_p95_s"] is None and out["preemptions"] is None


def test_metric_names_are_configurable() -> None:
    names = MetricNames.with_overrides(["preemptions=my:preempted_total", "queue_time=a,b"])
    assert names.preemptions == ("my:preempted_total",) and names.queue_time == ("a", "b")
    assert server_deltas({}, parse_metrics("my:preempted_total 4\n"), names)["preemptions"] == 4
    with pytest.raises(ValueError, match="KIND=NAME"):
        MetricNames.with_overrides(["bogus=x"])

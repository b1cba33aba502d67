"""The noise rule and the saturation rule, on hand-computed cases."""

from __future__ import annotations

import pytest

from loadtests.experiment import Unavailable
from loadtests.noise import Interval, call_measure, evaluate_interval, noisy_verdict, spreads
from loadtests.saturation import SaturationRule, completion_ratio, judge, queue_growth


def test_interval_arithmetic() -> None:
    a, b = Interval(1.0, 2.0), Interval(-1.0, 3.0)
    assert a + b == Interval(0.0, 5.0)
    assert a - b == Interval(-2.0, 3.0)
    assert a * b == Interval(-2.0, 6.0)
    assert a / Interval(2.0, 4.0) == Interval(0.25, 1.0)
    assert -a == Interval(-2.0, -1.0)
    with pytest.raises(ZeroDivisionError):
        a / b


def test_three_valued_conditions() -> None:
    mine = {"x": Interval(8.0, 10.0), "y": Interval(1.0, 1.0)}
    base = {"x": Interval(9.0, 11.0), "y": Interval(0.0, 0.5)}
    assert evaluate_interval("x < baseline.x", mine, base) is None  # the intervals overlap
    assert evaluate_interval("x < 11", mine, base) is True
    assert evaluate_interval("x > 10", mine, base) is False
    assert evaluate_interval("y > baseline.y", mine, base) is True
    # Kleene logic: a sure False decides an 'and', a sure True decides an 'or'.
    assert evaluate_interval("x < baseline.x and y < baseline.y", mine, base) is False
    assert evaluate_interval("x < baseline.x or y > baseline.y", mine, base) is True
    assert evaluate_interval("not x < baseline.x", mine, base) is None
    assert evaluate_interval("x < baseline.x * 2", mine, base) is True  # 10 < 18
    with pytest.raises(Unavailable):
        evaluate_interval("z < 1", {"z": None}, {})


def test_spread_is_the_range_with_a_floor() -> None:
    noise = spreads([{"a": 100.0, "b": 10.0, "c": None}, {"a": 120.0, "b": 10.1, "c": 1.0}], ["a", "b", "c"], 0.05)
    assert noise["a"]["mean"] == 110.0 and noise["a"]["spread"] == 20.0
    assert noise["b"]["spread"] == pytest.approx(0.05 * 10.05)  # the range 0.1 is under the 5 % floor
    assert noise["c"]["mean"] is None  # a measure missing from one repeat has no noise estimate


def test_a_variant_inside_the_spread_is_no_decision_outside_it_is_decided() -> None:
    base = [{"ttft_p95_ms": 1000.0, "goodput_rps": 2.0}, {"ttft_p95_ms": 1150.0, "goodput_rps": 2.2}]
    # mean 1075, spread 150 (the range beats the 5 % floor of 53.75).
    cond = "ttft_p95_ms < baseline.ttft_p95_ms"
    assert noisy_verdict(cond, {"ttft_p95_ms": 1000.0, "goodput_rps": 2.1}, base)[0] == "no decision: within noise"
    assert noisy_verdict(cond, {"ttft_p95_ms": 920.0, "goodput_rps": 2.1}, base)[0] == "better"  # 155 below
    assert noisy_verdict(cond, {"ttft_p95_ms": 1240.0, "goodput_rps": 2.1}, base)[0] == "worse"
    verdict, _ = noisy_verdict("goodput_rps >= baseline.goodput_rps", {"goodput_rps": None, "ttft_p95_ms": 1.0}, base)
    assert verdict.startswith("inconclusive")


def test_each_measure_is_called_by_its_direction() -> None:
    noise = {"mean": 100.0, "spread": 10.0}
    assert call_measure("ttft_p95_ms", 85.0, noise) == "better"
    assert call_measure("ttft_p95_ms", 111.0, noise) == "worse"
    assert call_measure("ttft_p95_ms", 109.0, noise) == "within noise"
    assert call_measure("goodput_rps", 111.0, noise) == "better"
    # more KV blocks in the same memory, more accepted or correct answers: higher is better
    for name in ("kv_blocks_total", "accepted", "correct_rate"):
        assert call_measure(name, 111.0, noise) == "better" and call_measure(name, 85.0, noise) == "worse"
    assert call_measure("goodput_rps", None, noise) == "n/a"


def _summary(**kw: float) -> dict:
    return {"sent_rps": 2.0, "duration_s": 62.0, "completed": 120, "cancelled": 0, "e2e_p50_ms": 3000.0, **kw}


def test_completion_ratio_allows_the_drain_of_a_healthy_server() -> None:
    # 120 finished over max(62 - 3, 60) = 60 s at 2 req/s sent: exactly keeping up.
    assert completion_ratio(_summary(), 60.0) == pytest.approx(1.0)
    # A backlog: the last response came 40 s after the window; 120 / (100 - 3) / 2 = 0.619.
    assert completion_ratio(_summary(duration_s=100.0), 60.0) == pytest.approx(120 / 97 / 2)
    # Cancellations are the client's choice and count as finished.
    assert completion_ratio(_summary(completed=100, cancelled=20), 60.0) == pytest.approx(1.0)
    assert completion_ratio(_summary(sent_rps=0.0), 60.0) is None


def test_queue_growth_from_the_waiting_gauge() -> None:
    t = [float(i) for i in range(9)]
    growth, slope = queue_growth(t, [0, 0, 0, 1, 2, 3, 4, 5, 6], 10.0) or (0.0, 0.0)
    assert growth == pytest.approx(5.0 - 0.0) and slope > 0
    flat = queue_growth(t, [3, 3, 3, 3, 3, 3, 3, 3, 3], 10.0)
    assert flat == (0.0, 0.0)
    assert queue_growth(t[:4], [0, 1, 2, 3], 10.0) is None  # too few samples to say
    # Samples after the send window (the drain) do not count.
    assert queue_growth(t, [0, 0, 0, 0, 0, 0, 9, 9, 9], 5.0) == (0.0, 0.0)


def test_saturation_verdict_and_margin() -> None:
    healthy = judge(_summary(), {"t_s": [float(i) for i in range(9)], "waiting": [0] * 9}, 60.0)
    assert healthy["saturated"] is False and healthy["saturation_reasons"] == []
    behind = judge(_summary(duration_s=100.0), {}, 60.0)
    assert behind["saturated"] is True and "completed 62% of the offered rate" in behind["saturation_reasons"][0]
    assert behind["queue_growth"] is None  # no gauge: no verdict on that sign
    # 0.93 of the offer: inside the default 10 % margin, outside a 5 % one.
    slightly = _summary(completed=112)
    assert judge(slightly, {}, 60.0)["saturated"] is False
    assert judge(slightly, {}, 60.0, SaturationRule(margin=0.05))["saturated"] is True
    growing = judge(_summary(), {"t_s": [float(i) for i in range(9)], "waiting": [0, 0, 0, 1, 2, 3, 4, 5, 6]}, 60.0)
    assert growing["saturated"] is True and "waiting queue grew by 5.0" in growing["saturation_reasons"][0]
    with pytest.raises(ValueError):
        SaturationRule(margin=1.0)

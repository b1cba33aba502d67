"""Quality statistics on hand-computed cases: Wilson, exact McNemar, the paired call per task type."""

from __future__ import annotations

import math
import time

import pytest

from loadtests.quality import stats
from loadtests.quality.stats import MAX_ITEMS_TO_SETTLE, drop_interval, mcnemar_p, paired_call, wilson

Z = 1.959963984540054  # the two-sided 95 % normal quantile
Z2 = Z * Z


def _pairs(a: int, b: int, c: int, d: int) -> list[tuple[bool, bool]]:
    """a both right, b baseline right & variant wrong, c baseline wrong & variant right, d both wrong."""
    return [(True, True)] * a + [(True, False)] * b + [(False, True)] * c + [(False, False)] * d


# --- McNemar -----------------------------------------------------------------------------------


def test_mcnemar_exact_small_cases() -> None:
    assert mcnemar_p(0, 6) == 2 * 0.5**6 == 0.03125
    assert mcnemar_p(6, 0) == 0.03125  # symmetric
    assert mcnemar_p(0, 5) == 2 * 0.5**5 == 0.0625
    # 2 * (C(12,10) + C(12,11) + C(12,12)) / 2**12 = 2 * 79 / 4096
    assert mcnemar_p(10, 2) == 158 / 4096
    # 2 * (C(4,3) + C(4,4)) / 16
    assert mcnemar_p(3, 1) == 0.625


@pytest.mark.parametrize("b", [0, 1, 2, 7, 50, 400, 5000])
def test_mcnemar_equal_counts_is_one(b: int) -> None:
    assert mcnemar_p(b, b) == 1.0


def test_mcnemar_one_apart_is_one() -> None:
    # k = ceil(m/2) for odd m: P(X >= k) = 1/2 exactly, doubled = 1.
    assert mcnemar_p(3, 2) == 1.0
    assert mcnemar_p(1, 0) == 1.0


def test_mcnemar_large_n_is_fast_and_right() -> None:
    start = time.perf_counter()
    p = mcnemar_p(500_500, 499_500)
    far = mcnemar_p(1_000_000, 0)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5
    # Normal approximation with continuity correction: z = (|b - c| - 1) / sqrt(b + c) = 999 / 1000.
    approx = 2 * (1 - 0.5 * (1 + math.erf(0.999 / math.sqrt(2))))
    assert p == pytest.approx(approx, abs=1e-3)
    assert 0.0 <= far < 1e-300


def test_mcnemar_log_space_agrees_with_exact_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "_EXACT_UP_TO", 0)  # force the lgamma path
    for b, c in [(6, 0), (10, 2), (30, 12), (130, 90), (700, 600)]:
        m, k = b + c, max(b, c)
        exact = min(1.0, 2 * sum(math.comb(m, i) for i in range(k, m + 1)) / 2**m)
        assert mcnemar_p(b, c) == pytest.approx(exact, rel=1e-9)


def test_mcnemar_refuses_negative_counts() -> None:
    with pytest.raises(ValueError):
        mcnemar_p(-1, 3)


# --- Wilson ------------------------------------------------------------------------------------


def test_wilson_zero_of_n() -> None:
    # Lower 0; upper z^2 / (n + z^2) (the centre and the half-width are both z^2/2n / (1 + z^2/n)).
    low, high = wilson(0, 10)
    assert low == 0.0
    assert high == pytest.approx(Z2 / (10 + Z2), abs=1e-12)
    assert high == pytest.approx(0.2775327998, abs=1e-9)


def test_wilson_n_of_n() -> None:
    low, high = wilson(10, 10)
    assert high == 1.0
    assert low == pytest.approx(10 / (10 + Z2), abs=1e-12)
    assert low == pytest.approx(0.7224672001, abs=1e-9)


def test_wilson_half() -> None:
    # p = 0.5, n = 100: centre 0.5; half = z * sqrt(0.25/100 + z^2/40000) / (1 + z^2/100)
    #   = 1.959964 * sqrt(0.0025 + 0.0000960365) / 1.0384146 = 1.959964 * 0.0509513 / 1.0384146
    #   = 0.0961685 -> (0.4038315, 0.5961685), the textbook (0.4038, 0.5962).
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.4038315, abs=1e-7)
    assert high == pytest.approx(0.5961685, abs=1e-7)
    assert low + high == pytest.approx(1.0, abs=1e-12)


def test_wilson_edges() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    narrow, wide = wilson(50, 100, 0.8), wilson(50, 100, 0.99)
    assert wide[0] < wilson(50, 100)[0] < narrow[0]
    with pytest.raises(ValueError):
        wilson(11, 10)
    with pytest.raises(ValueError):
        wilson(1, 10, confidence=1.0)


# --- the paired drop's interval ----------------------------------------------------------------


def test_drop_interval_without_correlation() -> None:
    # a=97, b=3, c=0, d=0: baseline 100/100 (Wilson upper 1), variant 97/100; phi = 0 (c + d = 0),
    # so the upper bound is 0.03 + (0.97 - Wilson lower of 97/100).
    centre = (0.97 + Z2 / 200) / (1 + Z2 / 100)
    half = Z * math.sqrt(0.97 * 0.03 / 100 + Z2 / 40000) / (1 + Z2 / 100)
    assert centre - half == pytest.approx(0.91548064, abs=1e-8)
    _, high = drop_interval(97, 3, 0, 0)
    assert high == pytest.approx(0.03 + 0.97 - (centre - half), abs=1e-12)
    assert high == pytest.approx(0.08451936, abs=1e-8)


def test_drop_interval_with_correlation() -> None:
    # a=40, b=10, c=5, d=45 (n=100): p1 = 0.50, p2 = 0.45, drop 0.05.
    # ad - bc = 1750 > n/2, so phi = (1750 - 50) / sqrt(50 * 50 * 45 * 55) = 0.683428...
    phi = 1700 / math.sqrt(50 * 50 * 45 * 55)
    u1 = 0.5 + 0.0961685  # Wilson 50/100 (above)
    c2 = (0.45 + Z2 / 200) / (1 + Z2 / 100)
    h2 = Z * math.sqrt(0.45 * 0.55 / 100 + Z2 / 40000) / (1 + Z2 / 100)
    l2 = c2 - h2
    high_hand = 0.05 + math.sqrt((u1 - 0.5) ** 2 - 2 * phi * (u1 - 0.5) * (0.45 - l2) + (0.45 - l2) ** 2)
    low, high = drop_interval(40, 10, 5, 45)
    assert high == pytest.approx(high_hand, abs=1e-6)
    assert low < 0.05 < high
    # Positive correlation narrows the interval against treating the two runs as independent.
    assert high - 0.05 < math.hypot(u1 - 0.5, 0.45 - l2)


# --- the paired call ---------------------------------------------------------------------------


def test_six_lost_is_worse_six_gained_is_better() -> None:
    worse = paired_call("arithmetic", _pairs(90, 6, 0, 4))
    assert (worse.call, worse.b, worse.c, worse.p_value) == ("worse", 6, 0, 0.03125)
    assert (worse.n, worse.base_correct, worse.variant_correct) == (100, 96, 90)
    assert worse.items_to_settle is None
    better = paired_call("arithmetic", _pairs(90, 0, 6, 4))
    assert (better.call, better.p_value, better.items_to_settle) == ("better", 0.03125, None)


def test_five_lost_is_within_noise_and_settles_at_110_items() -> None:
    # p(5, 0) = 0.0625 >= 0.05. At the same rates n' items give b' = round(5 n' / 100) lost;
    # b' = 6 (p = 0.03125) needs 5 n' / 100 >= 5.5, so n' >= 110.
    call = paired_call("arithmetic", _pairs(95, 5, 0, 0))
    assert (call.call, call.p_value, call.items_to_settle) == ("within noise", 0.0625, 110)
    assert "110" in call.reason
    # Three lost of 100: b' = 6 needs 3 n' / 100 >= 5.5, n' >= 183.3, so 184.
    assert paired_call("arithmetic", _pairs(97, 3, 0, 0)).items_to_settle == 184


def test_five_gained_is_not_worse() -> None:
    call = paired_call("arithmetic", _pairs(95, 0, 5, 0))
    assert (call.call, call.p_value, call.items_to_settle) == ("not worse", 0.0625, None)


def test_equal_discordance_is_not_worse_with_p_one() -> None:
    call = paired_call("choice", _pairs(80, 7, 7, 6))
    assert (call.call, call.p_value) == ("not worse", 1.0)
    assert paired_call("choice", _pairs(50, 0, 0, 50)).call == "not worse"  # identical answers


def test_confidence_changes_the_call() -> None:
    # p = 0.0625: within noise at 95 %, worse at 90 %.
    assert paired_call("x", _pairs(95, 5, 0, 0), confidence=0.90).call == "worse"
    # p = 0.03125: worse at 95 %, within noise at 99 %.
    assert paired_call("x", _pairs(94, 6, 0, 0), confidence=0.99).call == "within noise"


def test_margin_edge() -> None:
    pairs = _pairs(97, 3, 0, 0)  # p = 0.25; the drop's upper bound is 0.0845... (see above)
    _, bound = drop_interval(97, 3, 0, 0)
    at_edge = paired_call("x", pairs, margin=bound)
    assert at_edge.call == "not worse" and at_edge.items_to_settle is None
    just_above = paired_call("x", pairs, margin=math.nextafter(bound, 0.0))  # bound just above margin
    assert just_above.call == "within noise"
    assert just_above.items_to_settle == 101  # one more item at the same rates narrows the bound enough
    assert paired_call("x", pairs, margin=0.0).call == "within noise"  # no margin: never 'not worse'


def test_margin_settles_by_the_bound() -> None:
    # 2 lost, 1 gained of 100: the drop's estimate 1 % is inside a 5 % margin, so more items
    # settle it by the bound before the exact test could (its p stays large at a 2:1 ratio).
    call = paired_call("x", _pairs(97, 2, 1, 0), margin=0.05)
    assert call.call == "within noise"
    assert call.items_to_settle is not None
    n2 = call.items_to_settle
    k = n2 / 100
    assert drop_interval(97 * k, 2 * k, 1 * k, 0)[1] <= 0.05
    k_before = (n2 - 1) / 100
    assert drop_interval(97 * k_before, 2 * k_before, 1 * k_before, 0)[1] > 0.05


def test_items_to_settle_is_capped() -> None:
    # 51 lost, 50 gained of 1000: at that ratio it takes ~390k items; 501:500 never within 10^6.
    near = paired_call("x", _pairs(899, 51, 50, 0))
    assert near.call == "within noise"
    assert near.items_to_settle is not None and 100_000 < near.items_to_settle < MAX_ITEMS_TO_SETTLE
    start = time.perf_counter()
    capped = paired_call("x", _pairs(0, 501, 500, 0))
    assert time.perf_counter() - start < 2.0
    assert capped.items_to_settle == MAX_ITEMS_TO_SETTLE
    assert "more than" in capped.reason


def test_paired_call_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        paired_call("x", [], confidence=0.0)
    with pytest.raises(ValueError):
        paired_call("x", [], margin=-0.01)
    empty = paired_call("x", [])
    assert (empty.n, empty.call, empty.reason) == (0, "not worse", "no items")

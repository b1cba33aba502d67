"""Statistics for answer quality: Wilson interval, exact McNemar, a paired verdict per task type.

Everything here is stdlib (``math``, ``statistics.NormalDist``) and pure.

* ``wilson(correct, n)`` -- the Wilson score interval of one accuracy (two-sided, ``confidence``).
* ``mcnemar_p(b, c)`` -- exact two-sided McNemar: ``min(1, 2 * P(X >= max(b, c)))`` with
  ``X ~ Bin(b + c, 1/2)``.  Summed in log space with incremental terms, so ``b + c`` in the
  millions costs a few thousand steps (up to 300 discordant items: exact integer sums).
* ``drop_interval(a, b, c, d)`` -- the confidence interval of the paired drop
  ``(b - c) / n`` = baseline accuracy - variant accuracy, by Newcombe's (1998) square-and-add
  method for paired proportions (method 10: Wilson intervals of both accuracies combined with
  the continuity-corrected correlation phi).  Unlike the Wald interval it does not claim a
  tight bound from one or two discordant items (1 of 100 discordant gives an upper bound of
  about 5 %, not 3 %).
* ``paired_call(task, pairs)`` -- the decision for one task type from paired verdicts
  ``(baseline_correct, variant_correct)`` over the same items.

Rule (confidence ``c``, ``alpha = 1 - c``; ``b`` = baseline right & variant wrong, ``c_`` =
baseline wrong & variant right): *worse* if ``b > c_`` and ``p < alpha``; *better* if
``c_ > b`` and ``p < alpha``; *not worse* if ``b <= c_`` (no drop) or (``margin > 0`` and the
drop's upper bound ``<= margin``); else *within noise*, with ``items_to_settle``: the smallest
``n'`` (all four cells scaled by ``n'/n``; ``b``, ``c_`` rounded half up for the exact test)
at which it would be settled (``p < alpha`` or the bound ``<= margin``), capped at 10**6.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

__all__ = [
    "MAX_ITEMS_TO_SETTLE",
    "PairedCall",
    "drop_interval",
    "mcnemar_p",
    "paired_call",
    "wilson",
    "z_value",
]

MAX_ITEMS_TO_SETTLE = 1_000_000

# Stop summing the binomial tail once a term is this small relative to the sum so far: the
# terms after it shrink geometrically, so the dropped rest is far below double precision.
_TAIL_EPS = 1e-18
# Up to this many discordant items the tail is summed exactly in integers (fast enough there).
_EXACT_UP_TO = 300


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def z_value(confidence: float = 0.95) -> float:
    """The two-sided normal quantile for ``confidence`` (1.959963984540054 at 0.95)."""
    _check_confidence(confidence)
    return NormalDist().inv_cdf(1.0 - (1.0 - confidence) / 2.0)


def _wilson_z(correct: float, n: float, z: float) -> tuple[float, float]:
    if n <= 0:
        return 0.0, 1.0
    p = correct / n
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2.0 * n)) / denom
    half = z * math.sqrt(max(0.0, p * (1.0 - p) / n + z2 / (4.0 * n * n))) / denom
    low = 0.0 if correct <= 0 else max(0.0, center - half)
    high = 1.0 if correct >= n else min(1.0, center + half)
    return low, high


def wilson(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for ``correct`` of ``n``; ``(0.0, 1.0)`` when ``n == 0``."""
    if n < 0 or correct < 0 or correct > n:
        raise ValueError(f"need 0 <= correct <= n, got correct={correct}, n={n}")
    return _wilson_z(correct, n, z_value(confidence))


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: ``min(1, 2 * P(X >= max(b, c)))``, ``X ~ Bin(b+c, 1/2)``."""
    if b < 0 or c < 0:
        raise ValueError(f"discordant counts must be >= 0, got b={b}, c={c}")
    m = b + c
    k = max(b, c)
    if m == 0 or 2 * k <= m + 1:
        # k is the median (or just above it for odd m): the doubled tail is >= 1.
        return 1.0
    if m <= _EXACT_UP_TO:
        # Exact: integer tail over 2**m, one correctly rounded division.
        tail = sum(math.comb(m, i) for i in range(k, m + 1))
        return min(1.0, (2 * tail) / (1 << m))
    # log P(X = k) = log C(m, k) - m log 2; then the tail relative to it: terms shrink from k on
    # (k > m/2), each the previous times (m - i) / (i + 1).
    log_first = math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1) - m * math.log(2.0)
    total = 1.0
    term = 1.0
    for i in range(k, m):
        term *= (m - i) / (i + 1)
        total += term
        if term < _TAIL_EPS * total:
            break
    log_p = math.log(2.0) + log_first + math.log(total)
    if log_p >= 0.0:
        return 1.0
    return math.exp(log_p)


def drop_interval(a: float, b: float, c: float, d: float, confidence: float = 0.95) -> tuple[float, float]:
    """Newcombe's square-and-add interval for the paired drop ``(b - c) / n``.

    Cells: ``a`` both right, ``b`` baseline right & variant wrong, ``c`` baseline wrong & variant
    right, ``d`` both wrong (floats allowed: scaled tables).  The drop is baseline accuracy
    ``p1 = (a + b) / n`` minus variant accuracy ``p2 = (a + c) / n``.  Returns ``(0.0, 0.0)`` for
    an empty table.
    """
    if min(a, b, c, d) < 0:
        raise ValueError("cell counts must be >= 0")
    n = a + b + c + d
    if n <= 0:
        return 0.0, 0.0
    z = z_value(confidence)
    p1 = (a + b) / n
    p2 = (a + c) / n
    l1, u1 = _wilson_z(a + b, n, z)
    l2, u2 = _wilson_z(a + c, n, z)
    denom = (a + b) * (c + d) * (a + c) * (b + d)
    phi = 0.0
    if denom > 0:
        cross = a * d - b * c
        if cross > n / 2.0:
            phi = (cross - n / 2.0) / math.sqrt(denom)
        elif cross < 0:
            phi = cross / math.sqrt(denom)
    drop = p1 - p2
    low_sq = (p1 - l1) ** 2 - 2.0 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2
    high_sq = (u1 - p1) ** 2 - 2.0 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2
    low = max(-1.0, drop - math.sqrt(max(0.0, low_sq)))
    high = min(1.0, drop + math.sqrt(max(0.0, high_sq)))
    return low, high


@dataclass(frozen=True)
class PairedCall:
    task: str
    n: int
    base_correct: int
    variant_correct: int
    b: int  # baseline right, variant wrong
    c: int  # baseline wrong, variant right
    p_value: float
    call: str  # "worse" | "not worse" | "better" | "within noise"
    items_to_settle: int | None  # within noise only: items of this type that would settle it
    reason: str


def _scaled(count: int, n_new: int, n: int) -> int:
    """``count * n_new / n`` rounded half up, in exact integer arithmetic."""
    return (2 * count * n_new + n) // (2 * n)


def _settled_at(
    n_new: int, n: int, cells: tuple[int, int, int, int], alpha: float, confidence: float, margin: float
) -> bool:
    a, b, c, d = cells
    if mcnemar_p(_scaled(b, n_new, n), _scaled(c, n_new, n)) < alpha:
        return True
    if margin > 0:
        k = n_new / n
        return drop_interval(a * k, b * k, c * k, d * k, confidence)[1] <= margin
    return False


def _items_to_settle(
    n: int, cells: tuple[int, int, int, int], alpha: float, confidence: float, margin: float
) -> int:
    """Smallest ``n' > n`` that settles the call at the same cell rates, capped at the maximum.

    Exponential search for a settling size, then bisection between the last unsettled and the
    first settled one (the p-value falls and the bound shrinks as ``n'`` grows; rounding the
    scaled counts can make the boundary jitter by an item or two).
    """
    if n >= MAX_ITEMS_TO_SETTLE:
        return MAX_ITEMS_TO_SETTLE
    low = n  # unsettled (that is why we are here)
    high = n
    while True:
        high = min(MAX_ITEMS_TO_SETTLE, high * 2)
        if _settled_at(high, n, cells, alpha, confidence, margin):
            break
        if high >= MAX_ITEMS_TO_SETTLE:
            return MAX_ITEMS_TO_SETTLE
        low = high
    while high - low > 1:
        mid = (low + high) // 2
        if _settled_at(mid, n, cells, alpha, confidence, margin):
            high = mid
        else:
            low = mid
    return high


def paired_call(
    task: str, pairs: list[tuple[bool, bool]], confidence: float = 0.95, margin: float = 0.0
) -> PairedCall:
    """The paired verdict for one task type; ``pairs`` = ``(baseline_correct, variant_correct)``."""
    _check_confidence(confidence)
    if margin < 0:
        raise ValueError(f"margin must be >= 0, got {margin}")
    alpha = 1.0 - confidence
    a = b = c = d = 0
    for base_ok, variant_ok in pairs:
        if base_ok and variant_ok:
            a += 1
        elif base_ok:
            b += 1
        elif variant_ok:
            c += 1
        else:
            d += 1
    n = a + b + c + d
    p = mcnemar_p(b, c)
    counts = f"{b} lost, {c} gained of {n}"
    items: int | None = None
    if n == 0:
        call, reason = "not worse", "no items"
    elif b > c and p < alpha:
        call, reason = "worse", f"{counts}; McNemar p={p:.3g} < {alpha:.3g}"
    elif c > b and p < alpha:
        call, reason = "better", f"{counts}; McNemar p={p:.3g} < {alpha:.3g}"
    elif b <= c:
        call, reason = "not worse", f"{counts}; no drop"
    else:
        high = drop_interval(a, b, c, d, confidence)[1]
        if margin > 0 and high <= margin:
            call = "not worse"
            reason = f"{counts}; drop <= {high:.2%} at {confidence:.0%} (margin {margin:.2%})"
        else:
            call = "within noise"
            items = _items_to_settle(n, (a, b, c, d), alpha, confidence, margin)
            bound = f", drop up to {high:.2%} > margin {margin:.2%}" if margin > 0 else ""
            more = "more than " if items >= MAX_ITEMS_TO_SETTLE else ""
            reason = f"{counts}; McNemar p={p:.3g}{bound}; settles at {more}{items} items"
    return PairedCall(
        task=task,
        n=n,
        base_correct=a + b,
        variant_correct=a + c,
        b=b,
        c=c,
        p_value=p,
        call=call,
        items_to_settle=items,
        reason=reason,
    )

"""Verdicts that respect run-to-run noise.

On a shared machine the same configuration measured twice moves by 10-15 %: a
variant that differs from its baseline by less than that has not shown anything.
An experiment therefore runs its baseline at least twice, interleaved with the
variants (``A B C A``), and reads the noise of each measure off those repeats:

    spread(m) = max(max(baseline runs) - min(baseline runs), noise_floor * |mean(baseline runs)|)

``noise_floor`` (5 % by default) keeps two repeats that agreed by luck from
making the rule overconfident. A single measurement ``x`` of a measure with
spread ``s`` is read as the interval ``[x - s/2, x + s/2]``; the baseline is the
same interval around the mean of its repeats. A difference smaller than the
spread therefore lies inside the overlap of the two intervals.

The pass condition is then evaluated on intervals (interval arithmetic, and
three-valued logic for comparisons, ``and``, ``or``, ``not``):

- **better**: the condition holds for every value inside the intervals;
- **worse**: it fails for every value inside them;
- **no decision: within noise**: it holds for some and fails for others; the
  record says which measures were too close to call and what run would settle it.

Each measure on its own is also called better / worse / within noise by its
direction (lower is better for latencies, errors, cost, memory, preemptions;
higher for throughput), with its difference and spread printed side by side.
"""

from __future__ import annotations

import ast
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loadtests.experiment import _BINOPS, Unavailable, check_condition

DEFAULT_NOISE_FLOOR = 0.05
HIGHER_IS_BETTER = frozenset({"completed_rps", "goodput_rps", "output_tok_s", "total_tok_s", "max_ok_rate",
                              "slo_met", "sent_rps", "kv_blocks_total", "accepted", "accepted_slo_only", "correct",
                              "correct_rate"})


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float

    @classmethod
    def around(cls, value: float, spread: float) -> Interval:
        return cls(value - spread / 2.0, value + spread / 2.0)

    def __add__(self, other: Interval) -> Interval:
        return Interval(self.lo + other.lo, self.hi + other.hi)

    def __sub__(self, other: Interval) -> Interval:
        return Interval(self.lo - other.hi, self.hi - other.lo)

    def __mul__(self, other: Interval) -> Interval:
        products = (self.lo * other.lo, self.lo * other.hi, self.hi * other.lo, self.hi * other.hi)
        return Interval(min(products), max(products))

    def __truediv__(self, other: Interval) -> Interval:
        if other.lo <= 0.0 <= other.hi:
            raise ZeroDivisionError("the divisor's interval contains zero")
        return self * Interval(1.0 / other.hi, 1.0 / other.lo)

    def __neg__(self) -> Interval:
        return Interval(-self.hi, -self.lo)


Tri = bool | None  # True, False, or None: cannot tell inside the noise


def _compare(op: ast.cmpop, a: Interval, b: Interval) -> Tri:
    if isinstance(op, ast.Lt):
        return True if a.hi < b.lo else False if a.lo >= b.hi else None
    if isinstance(op, ast.LtE):
        return True if a.hi <= b.lo else False if a.lo > b.hi else None
    if isinstance(op, ast.Gt):
        return _compare(ast.Lt(), b, a)
    if isinstance(op, ast.GtE):
        return _compare(ast.LtE(), b, a)
    disjoint = a.hi < b.lo or b.hi < a.lo
    same_point = a.lo == a.hi == b.lo == b.hi
    equal: Tri = True if same_point else False if disjoint else None
    if isinstance(op, ast.Eq):
        return equal
    return None if equal is None else not equal


def _and(values: Sequence[Tri]) -> Tri:
    if any(v is False for v in values):
        return False
    return True if all(v is True for v in values) else None


def _or(values: Sequence[Tri]) -> Tri:
    if any(v is True for v in values):
        return True
    return False if all(v is False for v in values) else None


def evaluate_interval(text: str, variant: dict[str, Interval | None], baseline: dict[str, Interval | None]) -> Tri:
    """The pass condition over intervals: True, False, or None (within noise).
    Raises Unavailable when a measure it reads is n/a."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant):
            number = float(node.value)  # type: ignore[arg-type]  # check_condition admits numbers only
            return Interval(number, number)
        if isinstance(node, ast.Name | ast.Attribute):
            scope, name = (baseline, node.attr) if isinstance(node, ast.Attribute) else (variant, node.id)
            if name not in scope:
                raise ValueError(f"pass condition {text!r}: unknown measure {name!r}")
            found = scope[name]
            if found is None:
                raise Unavailable(("baseline." if scope is baseline else "") + name)
            return found
        if isinstance(node, ast.BoolOp):
            parts = [value(v) for v in node.values]
            return _and(parts) if isinstance(node.op, ast.And) else _or(parts)
        if isinstance(node, ast.UnaryOp):
            operand = value(node.operand)
            if isinstance(node.op, ast.Not):
                return None if operand is None else not operand
            return -operand
        if isinstance(node, ast.BinOp):
            arith = _BINOPS[type(node.op)]
            try:
                return arith(value(node.left), value(node.right))
            except ZeroDivisionError:
                return Interval(float("-inf"), float("inf"))
        if isinstance(node, ast.Compare):
            left = value(node.left)
            results: list[Tri] = []
            for cmp, comparator in zip(node.ops, node.comparators, strict=True):
                right = value(comparator)
                results.append(_compare(cmp, left, right))
                left = right
            return _and(results)
        raise ValueError(f"pass condition {text!r}: unsupported expression")

    result = value(check_condition(text))
    if isinstance(result, Interval):
        raise ValueError(f"pass condition {text!r} is a number, not a comparison")
    return result


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def spreads(baseline_runs: Sequence[dict[str, Any]], names: Sequence[str],
            noise_floor: float = DEFAULT_NOISE_FLOOR) -> dict[str, dict[str, Any]]:
    """Per measure: the baseline repeats, their mean, and the spread used as the noise."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        values = [_number(run.get(name)) for run in baseline_runs]
        known = [v for v in values if v is not None]
        if not known or len(known) < len(values):
            out[name] = {"runs": values, "mean": None, "spread": None}
            continue
        mean = statistics.fmean(known)
        spread = max(max(known) - min(known), noise_floor * abs(mean))
        out[name] = {"runs": values, "mean": mean, "spread": spread}
    return out


def call_measure(name: str, variant: float | None, noise: dict[str, Any]) -> str:
    """'better', 'worse' or 'within noise' for one measure, by its direction."""
    mean, spread = noise.get("mean"), noise.get("spread")
    if variant is None or mean is None or spread is None:
        return "n/a"
    diff = variant - mean
    if abs(diff) <= spread:
        return "within noise"
    higher_better = name in HIGHER_IS_BETTER
    return "better" if (diff > 0) == higher_better else "worse"


def noisy_verdict(text: str, variant: dict[str, Any], baseline_runs: Sequence[dict[str, Any]],
                  noise_floor: float = DEFAULT_NOISE_FLOOR) -> tuple[str, dict[str, dict[str, Any]]]:
    """The verdict of a pass condition given the baseline's repeats, and the noise per measure."""
    names = sorted(set(variant) | {k for run in baseline_runs for k in run})
    noise = spreads(baseline_runs, names, noise_floor)
    mine: dict[str, Interval | None] = {}
    base: dict[str, Interval | None] = {}
    for name in names:
        spread = noise[name]["spread"]
        value = _number(variant.get(name))
        mine[name] = None if value is None or spread is None else Interval.around(value, spread)
        mean = noise[name]["mean"]
        base[name] = None if mean is None else Interval.around(mean, spread)
    try:
        result = evaluate_interval(text, mine, base)
    except Unavailable as exc:
        return f"inconclusive ({exc} is n/a on this server)", noise
    if result is None:
        return "no decision: within noise", noise
    return ("better" if result else "worse"), noise

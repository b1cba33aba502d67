"""Decision records: one variant against its baseline's repeats, verdict read through the noise.

A record carries what the method asks for (hypothesis, changed parameter, input
set, pass condition, measured outcome, verdict) plus what makes it honest on a
noisy machine: every baseline repeat, the spread used as noise, the variant's
difference beside it, and a verdict of **better**, **worse** or **no decision:
within noise** (loadtests/noise.py states the rule). The plain pass/fail of the
condition on the baseline's mean is kept beside it for reference.
"""

from __future__ import annotations

import ast
from typing import Any

from loadtests.experiment import Experiment, Unavailable, Variant, check_condition, evaluate
from loadtests.noise import call_measure, noisy_verdict
from loadtests.quality import decide as qd

OUTCOME_KEYS = ("completed_rps", "goodput_rps", "ttft_p95_ms", "queue_p95_ms", "queue_p95_below_ms", "e2e_p95_ms",
                "itl_p95_ms", "error_rate", "preemptions", "peak_memory_bytes", "peak_kv_blocks_used",
                "accepted", "cost_per_accepted", "max_ok_rate")
ERROR_GUARD = 0.01
"""A variant failing more than this share of requests beyond the baseline is never 'better' unless its
pass condition reads ``error_rate``."""


def measures(config_result: dict[str, Any], decision_rate: float) -> dict[str, Any]:
    """The names a pass condition can use, for one configuration."""
    runs = config_result["runs"]
    at_rate = [r for r in runs if r.get("rate") is not None and abs(r["rate"] - decision_rate) < 1e-9]
    summary = dict(at_rate[0]["summary"]) if at_rate else {}
    summary["max_ok_rate"] = config_result["sweep"].get("max_rate_meeting_slo") or 0.0
    if at_rate and not at_rate[0].get("slo_targets", True):
        summary["slo_met"] = None  # no targets: nothing to meet
    else:
        summary["slo_met"] = 1.0 if at_rate and not at_rate[0]["slo_violations"] else 0.0
    return summary


def condition_names(text: str) -> list[str]:
    """The measures a pass condition reads, in order of appearance."""
    names: list[str] = []
    for node in ast.walk(check_condition(text)):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name is not None and name != "baseline" and name not in names:
            names.append(name)
    return names


def _plain(text: str, mine: dict[str, Any], base: dict[str, Any]) -> str:
    try:
        return "pass" if evaluate(text, mine, base) else "fail"
    except Unavailable as exc:
        return f"inconclusive ({exc} is n/a)"


def decide(experiment: Experiment, variant: Variant, baseline_results: list[dict[str, Any]],
           variant_result: dict[str, Any], input_set: dict[str, Any]) -> dict[str, Any]:
    """One decision record for ``variant`` against every run of the baseline."""
    rate = experiment.decision_rate
    base_runs = [_priced(measures(b, rate), experiment) for b in baseline_results]
    mine = _priced(measures(variant_result, rate), experiment)
    verdict, noise = noisy_verdict(variant.pass_condition, mine, base_runs, experiment.noise_floor)
    keys = list(OUTCOME_KEYS) + [k for k in condition_names(variant.pass_condition) if k not in OUTCOME_KEYS]
    mean = {k: noise.get(k, {}).get("mean") for k in keys}
    base_mean = {**base_runs[0], **{k: v for k, v in mean.items() if v is not None}}
    outcome = {
        "decision_rate": rate,
        "variant": {k: mine.get(k) for k in keys},
        "baseline": {k: mean.get(k) for k in keys},
        "baseline_runs": {k: noise.get(k, {}).get("runs") for k in keys},
        "spread": {k: noise.get(k, {}).get("spread") for k in keys},
        "difference": {k: _diff(mine.get(k), mean.get(k)) for k in keys},
        "call": {k: call_measure(k, _float(mine.get(k)), noise.get(k, {})) for k in keys},
    }
    verdict = _errors_guard(verdict, variant.pass_condition, mine, outcome)
    record = {
        "variant": variant.name,
        "hypothesis": variant.hypothesis,
        "changed_parameter": f"{variant.knob}: {experiment.baseline.get(variant.knob, 'server default')} -> "
                             f"{variant.value}",
        "input_set": input_set,
        "pass_condition": variant.pass_condition,
        "measured_outcome": outcome,
        "verdict": verdict,
        "condition_on_means": _plain(variant.pass_condition, mine, base_mean),
        "noise_rule": f"{len(base_runs)} baseline runs; spread = max(range, {experiment.noise_floor:g} x mean)",
    }
    if verdict.startswith("no decision"):
        record["to_settle"] = _to_settle(variant.pass_condition, outcome, len(base_runs))
    if experiment.quality is not None:
        _fold_quality(record, experiment, variant, baseline_results, variant_result)
    return record


def _errors_guard(verdict: str, condition: str, mine: dict[str, Any], outcome: dict[str, Any]) -> str:
    """A variant that fails more requests than the baseline, beyond noise, is never 'better' on the
    latency of the requests that survived, unless its pass condition weighs errors itself (a queue
    limit trades refusals for latency on purpose and says how many it allows)."""
    if "error_rate" in condition_names(condition) or outcome["call"].get("error_rate") != "worse":
        return verdict
    base = outcome["baseline"].get("error_rate")
    if (_float(mine.get("error_rate")) or 0.0) - (_float(base) or 0.0) <= ERROR_GUARD:
        return verdict
    return (f"worse: errors (error rate {_float(mine.get('error_rate')) or 0:.3f} against "
            f"{_float(base) or 0:.3f}; the pass condition does not weigh errors)")


def config_items(config_result: dict[str, Any], decision_rate: float) -> dict[str, Any] | None:
    """The task items one configuration answered: its quality pass, else its run at the decision rate."""
    full = config_result.get("quality_pass")
    if full and full.get("items") is not None:
        return dict(full["items"])
    for run in config_result.get("runs", []):
        if run.get("rate") is not None and abs(run["rate"] - decision_rate) < 1e-9 and "items" in run:
            return dict(run["items"])
    return None


def _fold_quality(record: dict[str, Any], experiment: Experiment, variant: Variant,
                  baseline_results: list[dict[str, Any]], variant_result: dict[str, Any]) -> None:
    """Per task type, the paired comparison on the same items; the greedy determinism check; the
    verdict with quality folded in (loadtests/quality/decide.py)."""
    quality = experiment.quality
    assert quality is not None
    rate = experiment.decision_rate
    base = config_items(baseline_results[0], rate) if baseline_results else None
    mine = config_items(variant_result, rate)
    record["answers"] = variant.answers
    if base is None or mine is None:
        record["quality"] = "no task items were answered by both configurations"
        return
    repeat = config_items(baseline_results[1], rate) if len(baseline_results) > 1 else None
    calls = qd.quality_calls(qd.pairs_by_task(base, mine, variant.answers, repeat), quality.confidence,
                             quality.margin)
    record["quality"] = qd.describe(calls)
    record["quality_rule"] = (f"paired per task type on the same items (McNemar's exact test), confidence "
                              f"{quality.confidence:g}, margin {quality.margin:g}")
    record["determinism"] = qd.determinism(base, mine)
    if repeat is not None:
        record["baseline_repeatability"] = qd.determinism(base, repeat)
    latency_verdict = record["verdict"]
    record["latency_verdict"] = latency_verdict
    record["verdict"], settle = qd.combine(latency_verdict, calls)
    if settle:
        record["to_settle"] = settle


def _priced(summary: dict[str, Any], experiment: Experiment) -> dict[str, Any]:
    """With a price set, a run that accepted no answer cost infinitely much per accepted answer:
    that is a decided 'worse', not a measure the server failed to give."""
    if (experiment.cost.price_per_gpu_hour is not None and summary.get("cost_per_accepted") is None
            and summary.get("accepted") == 0):
        summary["cost_per_accepted"] = float("inf")
    return summary


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _diff(a: Any, b: Any) -> float | None:
    x, y = _float(a), _float(b)
    return None if x is None or y is None else x - y


def _to_settle(condition: str, outcome: dict[str, Any], num_baseline: int) -> str:
    """What run would settle a 'no decision': the condition's measures that are inside their noise."""
    close = [k for k in condition_names(condition) if outcome["call"].get(k) == "within noise"]
    if not close:
        return ("the condition combines measures whose intervals overlap its thresholds; repeat the baseline "
                "and the variant (e.g. A B A B A B) so the spread can shrink")
    parts = []
    for k in close:
        diff, spread = outcome["difference"].get(k), outcome["spread"].get(k)
        if diff is not None and spread:
            parts.append(f"{k} moved {diff:+.4g} inside a spread of {spread:.4g}")
        else:
            parts.append(f"{k} did not move beyond its spread")
    return ("; ".join(parts) + f". Settle it with more repeats ({num_baseline} baseline runs now; the spread of "
            "a mean falls roughly with the square root of the runs), longer runs at the decision rate, or a "
            "quieter machine")

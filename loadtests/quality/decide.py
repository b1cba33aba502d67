"""Quality in an experiment's decision: the same items on the baseline and on the variant, paired.

Greedy answers repeat exactly, so the noise in a quality comparison comes from which items
were asked, not from the runs: each task type is compared item by item (McNemar's exact test
on the items one configuration got right and the other wrong, loadtests/quality/stats.py).
A variant is called better only when no task type lost quality beyond that noise:

- some type dropped significantly  -> **worse: quality** (the types, in the verdict);
- a latency verdict of "better" with a type whose drop is inside the noise -> **no decision:
  quality within noise**, with the items of that type it would take to settle it;
- otherwise the latency verdict stands.

``agree`` items (open prompts) have no right answer of their own: an answer is correct when it
is identical to the baseline's (its first run's quality pass). They are judged only for a
variant that must not change answers (``answers = "same"``: scheduling knobs, prefix caching,
chunked prefill, speculative decoding); a variant allowed to change answers (quantization, a
KV cache dtype, another model) is judged on correctness alone. The baseline's own repeat is
judged the same way, so a baseline that does not repeat itself shows up as noise, not as the
variant's fault.

The greedy determinism check, for every variant: were the variant's answers identical to the
baseline's, item by item, and which differed first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from loadtests.quality.judge import item_answer
from loadtests.quality.stats import PairedCall, paired_call

FIRST_DIFFERING = 5
# Knobs whose change must leave every greedy answer as it was; anything else may change them.
SAME_ANSWER_KNOBS = frozenset({
    "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs", "long_prefill_token_threshold",
    "enable_chunked_prefill", "max_waiting_requests", "kv_cache_memory", "num_kv_blocks", "async_scheduling",
    "max_queue_time_s", "scheduling_policy", "preemption_mode", "block_size", "num_speculative_tokens",
    "speculative_model", "max_model_len", "data_parallel_size",
})


def answers_mode(knob: str, declared: str | None) -> str:
    """'same' (answers must not change) or 'may_change', as the variant declares or by its knob."""
    if declared is not None:
        if declared not in ("same", "may_change"):
            raise ValueError(f"answers must be 'same' or 'may_change', not {declared!r}")
        return declared
    return "same" if knob in SAME_ANSWER_KNOBS else "may_change"


def _answer(item: Mapping[str, Any]) -> tuple[str, tuple[tuple[str, str], ...]]:
    answer = item_answer(item)
    return answer.text, answer.tool_calls


def _unique(items: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Item id -> its first answer (a repeated item's ``#k`` answers are dropped)."""
    out: dict[str, Mapping[str, Any]] = {}
    for rid, item in items.items():
        out.setdefault(rid.split("#", 1)[0], item)
    return out


def determinism(base: Mapping[str, Mapping[str, Any]], other: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Were ``other``'s greedy answers identical to ``base``'s on the items both answered?"""
    b, o = _unique(base), _unique(other)
    common = sorted(set(b) & set(o))
    differing = [i for i in common if _answer(b[i]) != _answer(o[i])]
    return {"compared": len(common), "differing": len(differing), "identical": bool(common) and not differing,
            "first_differing": differing[:FIRST_DIFFERING]}


def pairs_by_task(base: Mapping[str, Mapping[str, Any]], variant: Mapping[str, Mapping[str, Any]],
                  mode: str, repeat: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, list[tuple[bool, bool]]]:
    """Per task type, (baseline correct, variant correct) on the items both answered.

    ``agree`` items (``correct`` is None in a run: nothing to judge against) compare the
    variant's answer with the baseline's; the baseline side is its repeat's agreement with its
    first run (True when there is no repeat). They are left out when answers may change."""
    b, v = _unique(base), _unique(variant)
    r = _unique(repeat) if repeat is not None else None
    out: dict[str, list[tuple[bool, bool]]] = {}
    for item_id in sorted(set(b) & set(v)):
        bi, vi = b[item_id], v[item_id]
        task = str(bi.get("task"))
        if bi.get("correct") is None:  # an agree item
            if mode != "same":
                continue
            base_ok = True if r is None or item_id not in r else _answer(r[item_id]) == _answer(bi)
            out.setdefault(task, []).append((base_ok, _answer(vi) == _answer(bi)))
        elif vi.get("correct") is not None:
            out.setdefault(task, []).append((bool(bi["correct"]), bool(vi["correct"])))
    return out


def quality_calls(pairs: Mapping[str, Sequence[tuple[bool, bool]]], confidence: float,
                  margin: float) -> list[PairedCall]:
    return [paired_call(task, list(p), confidence, margin) for task, p in sorted(pairs.items()) if p]


def combine(latency_verdict: str, calls: Sequence[PairedCall]) -> tuple[str, str | None]:
    """The verdict with quality folded in, and what would settle a quality 'no decision'."""
    worse = [c for c in calls if c.call == "worse"]
    if worse:
        drops = ", ".join(f"{c.task} {_pts(c)}" for c in worse)
        return f"worse: quality ({drops})", None
    close = [c for c in calls if c.call == "within noise"]
    if latency_verdict == "better" and close:
        needs = "; ".join(
            f"{c.task}: {c.base_correct}/{c.n} -> {c.variant_correct}/{c.n} (p = {c.p_value:.3g})"
            + (f", about {c.items_to_settle} items of this type would settle it" if c.items_to_settle else "")
            for c in close)
        return ("no decision: quality within noise (" + ", ".join(c.task for c in close) + ")",
                "faster, but a quality drop is inside the items' noise: " + needs)
    return latency_verdict, None


def _pts(call: PairedCall) -> str:
    if not call.n:
        return ""
    return f"{100.0 * (call.variant_correct - call.base_correct) / call.n:+.1f} pts"


def describe(calls: Sequence[PairedCall]) -> list[dict[str, Any]]:
    return [
        {"task": c.task, "items": c.n, "baseline_correct": c.base_correct, "variant_correct": c.variant_correct,
         "baseline_only": c.b, "variant_only": c.c, "p_value": c.p_value, "call": c.call,
         "items_to_settle": c.items_to_settle, "reason": c.reason}
        for c in calls
    ]

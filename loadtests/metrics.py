"""Per-run and per-group measures computed from request records.

Definitions match ``vllm bench serve`` where the two overlap:

- TTFT: send to the first chunk carrying text.
- TPOT (per request): ``(e2e - ttft) / (output_tokens - 1)``, for requests
  with more than one output token; its statistics are over requests.
- ITL: every gap between consecutive text chunks, pooled over all requests.
- E2E: send to the end of the stream.
- Goodput: completed requests meeting *every* configured SLO (ttft, tpot,
  e2el, each ``value <= limit``) per second of run duration; a request with one
  output token counts a TPOT of 0, as in vLLM.
- Percentiles: numpy's linear interpolation; throughput divides by the run's
  duration (the start to the later of the send window's end and the last response).

Latency statistics use completed requests only; cancelled requests are
counted apart, and the error rate is errors over requests sent. The cost per
accepted answer is the GPU time of the run (duration x GPUs x price per
GPU-hour) over the requests accepted: those meeting the goodput SLOs (or every
completed one when no goodput SLO is set) whose answer, when it was checked, is
correct. A request drawn from a task set with a wrong answer is never accepted,
however fast it was; one that could not be judged (an ``agree`` item without a
reference) is accepted on the SLOs alone. Goodput stays vLLM's (the SLOs only).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadtests.client import ERROR_KINDS, RequestRecord

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class GoodputSLO:
    """Per-request limits in milliseconds (vLLM's ``--goodput ttft:MS tpot:MS e2el:MS``)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def configured(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2el_ms))

    @classmethod
    def parse(cls, text: str) -> GoodputSLO:
        """``ttft:500,tpot:50`` (also space separated)."""
        values: dict[str, float] = {}
        for item in text.replace(",", " ").split():
            key, sep, value = item.partition(":")
            if not sep or key not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"goodput SLO {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
            values[key + "_ms"] = float(value)
        return cls(**values)


@dataclass(frozen=True)
class RunSLO:
    """Run-level targets the sweep checks (None: not checked)."""

    ttft_p95_ms: float | None = None
    e2e_p95_ms: float | None = None
    error_rate: float | None = None
    queue_p95_ms: float | None = None


@dataclass(frozen=True)
class CostModel:
    price_per_gpu_hour: float | None = None
    num_gpus: int = 1


def percentile(values: Iterable[float], q: float) -> float | None:
    data = list(values)
    return float(np.percentile(data, q)) if data else None


def mean(values: Iterable[float]) -> float | None:
    data = list(values)
    return float(np.mean(data)) if data else None


def tpot_s(record: RequestRecord) -> float | None:
    if record.output_tokens > 1 and record.latency_s is not None and record.ttft_s is not None:
        return (record.latency_s - record.ttft_s) / (record.output_tokens - 1)
    return None


def is_good(record: RequestRecord, slo: GoodputSLO) -> bool:
    if record.status != "ok":
        return False
    checks = (
        (slo.ttft_ms, record.ttft_s),
        (slo.tpot_ms, tpot_s(record) or 0.0),
        (slo.e2el_ms, record.latency_s),
    )
    return all(limit is None or (value is not None and value * 1000.0 <= limit) for limit, value in checks)


def _stats(prefix: str, values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values_s]
    out: dict[str, float | None] = {f"{prefix}_mean_ms": mean(ms)}
    for q in PERCENTILES:
        out[f"{prefix}_p{q}_ms"] = percentile(ms, q)
    return out


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    goodput: GoodputSLO,
    cost: CostModel,
    offered_rps: float | None = None,
) -> dict[str, Any]:
    """Every client-side measure of one run (or one scenario group of it)."""
    done = [r for r in records if r.status == "ok"]
    errors = [r for r in records if r.status == "error"]
    dur = duration_s if duration_s > 0 else float("nan")
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    good = [r for r in done if is_good(r, goodput)]
    on_time = good if goodput.configured else done
    accepted = sum(1 for r in on_time if r.correct is not False)
    out: dict[str, Any] = {
        "num_requests": len(records),
        "completed": len(done),
        "cancelled": sum(1 for r in records if r.status == "cancelled"),
        "errors": len(errors),
        **{f"errors_{kind}": sum(1 for r in errors if r.error_kind == kind) for kind in ERROR_KINDS},
        "error_rate": len(errors) / len(records) if records else None,
        "duration_s": duration_s,
        "offered_rps": offered_rps,
        "sent_rps": len(records) / dur if records else 0.0,
        "completed_rps": len(done) / dur,
        "output_tok_s": output_tokens / dur,
        "total_tok_s": (input_tokens + output_tokens) / dur,
        "total_output_tokens": output_tokens,
        "total_input_tokens": input_tokens,
        **_stats("ttft", [r.ttft_s for r in done if r.ttft_s is not None]),
        **_stats("tpot", [t for t in (tpot_s(r) for r in done) if t is not None]),
        **_stats("itl", [gap for r in done for gap in r.itl_s]),
        **_stats("e2e", [r.latency_s for r in done if r.latency_s is not None]),
        "good_requests": len(good) if goodput.configured else None,
        "goodput_rps": len(good) / dur if goodput.configured else None,
        "accepted": accepted,
        "accepted_slo_only": len(on_time),
        "cost_per_accepted": cost_per_accepted(duration_s, accepted, cost),
    }
    if any(r.task is not None for r in records):
        from loadtests.quality.judge import quality_summary

        checked = [r for r in done if r.correct is not None]
        out["checked"] = len(checked)
        out["correct"] = sum(1 for r in checked if r.correct)
        out["correct_rate"] = out["correct"] / len(checked) if checked else None
        out["quality"] = quality_summary(records)
    queue = [r.queue_time_s for r in done if r.queue_time_s is not None]
    if queue:
        out.update(_stats("client_reported_queue", queue))
    return out


def cost_per_accepted(duration_s: float, accepted: int, cost: CostModel) -> float | None:
    if cost.price_per_gpu_hour is None or accepted == 0:
        return None
    return cost.price_per_gpu_hour * cost.num_gpus * duration_s / 3600.0 / accepted


def slo_violations(summary: dict[str, Any], slo: RunSLO) -> list[str]:
    """Which run-level targets a run missed; an empty list means it met them all."""
    broken: list[str] = []
    if summary.get("completed", 0) == 0:
        broken.append("no request completed")
    for key, limit, label in (
        ("ttft_p95_ms", slo.ttft_p95_ms, "p95 TTFT"),
        ("e2e_p95_ms", slo.e2e_p95_ms, "p95 end-to-end"),
        ("queue_p95_ms", slo.queue_p95_ms, "p95 queue"),
    ):
        value = summary.get(key)
        if limit is not None and value is not None and value > limit:
            broken.append(f"{label} {value:.0f} ms > {limit:.0f} ms")
    rate = summary.get("error_rate")
    if slo.error_rate is not None and rate is not None and rate > slo.error_rate:
        broken.append(f"error rate {rate:.3f} > {slo.error_rate:.3f}")
    return broken

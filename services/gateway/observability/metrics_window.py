"""Sliding windows behind the live dashboard: recent requests, engine samples, rejections.

Prometheus histograms answer "what happened since start-up"; an operator looking at
the dashboard asks "what is happening now". This module keeps the last minute of
finished requests and the last minutes of engine samples in bounded deques and
derives windowed rates and percentiles from them. It has no Prometheus and no
HTTP in it, so it is cheap to test with hand-built values.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FinishedSample:
    """What the dashboard needs of one finished request."""

    finished_time: float
    ttft_s: float | None
    queue_s: float | None
    e2e_s: float
    num_output_tokens: int
    finish_reason: str


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One EngineStats reduced to the values the dashboard charts or differentiates."""

    time: float
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions_total: int
    generation_tokens_total: int
    prompt_tokens_total: int
    steps_total: int = 0
    step_tokens_total: int = 0
    step_phase_seconds_total: dict[str, float] | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


STEP_SHARE_PHASES = ("forward", "sample", "idle", "schedule")


def _step_split(spans: list[tuple[EngineSample, EngineSample]]) -> dict[str, float | None]:
    """Mean step cycle, tokens per step and each phase's share of the cycle between the first
    and last sample of each engine (several engines: over all their steps together).

    forward + sample + idle make up the cycle; schedule is part of idle unless it
    overlaps the forward (async scheduling), so its share is reported beside them."""
    steps, tokens = 0, 0
    spent = dict.fromkeys(STEP_SHARE_PHASES, 0.0)
    for first, last in spans:
        a, b = first.step_phase_seconds_total or {}, last.step_phase_seconds_total or {}
        mine = {p: b.get(p, 0.0) - a.get(p, 0.0) for p in STEP_SHARE_PHASES}
        if last.steps_total < first.steps_total or any(v < 0 for v in mine.values()):
            continue  # a scheduler restart reset this engine's totals
        steps += last.steps_total - first.steps_total
        tokens += last.step_tokens_total - first.step_tokens_total
        for p, v in mine.items():
            spent[p] += v
    cycle = spent["forward"] + spent["sample"] + spent["idle"]
    if steps <= 0 or cycle <= 0:
        return {}  # no steps in the window
    out: dict[str, float | None] = {
        "step_mean_s": cycle / steps,
        "tokens_per_step": tokens / steps,
    }
    for phase, seconds in spent.items():
        out[f"step_{phase}_share"] = seconds / cycle
    return out


def _counter_rate(first: int, last: int, span_s: float) -> float:
    """Per-second increase of a cumulative counter; a reset (restart) counts from zero."""
    if span_s <= 0:
        return 0.0
    increase = last - first if last >= first else last
    return increase / span_s


class LiveWindow:
    """Bounded recent history: finished requests, engine samples and rejection times.

    ``window_s`` is the span the rates and percentiles cover; ``history_s`` is how
    far back the engine samples go (the chart's x range).
    """

    def __init__(self, window_s: float = 60.0, history_s: float = 300.0, max_requests: int = 20000) -> None:
        self.window_s = window_s
        self.history_s = history_s
        self._finished: deque[FinishedSample] = deque(maxlen=max_requests)
        self._engine: deque[EngineSample] = deque()
        self._rejected: deque[float] = deque(maxlen=max_requests)

    # -- feeding --------------------------------------------------------------

    def add_finished(self, sample: FinishedSample) -> None:
        self._finished.append(sample)
        self._trim(sample.finished_time)

    def add_engine(self, sample: EngineSample) -> None:
        self._engine.append(sample)
        self._trim(sample.time)

    def add_rejected(self, when: float) -> None:
        self._rejected.append(when)
        self._trim(when)

    def _trim(self, now: float) -> None:
        while self._finished and self._finished[0].finished_time < now - self.window_s:
            self._finished.popleft()
        while self._rejected and self._rejected[0] < now - self.window_s:
            self._rejected.popleft()
        while self._engine and self._engine[0].time < now - self.history_s:
            self._engine.popleft()

    # -- reading --------------------------------------------------------------

    def history(self, since: float | None = None) -> list[EngineSample]:
        """Engine samples, oldest first, optionally only those after ``since``."""
        if since is None:
            return list(self._engine)
        return [s for s in self._engine if s.time > since]

    def summary(self, now: float) -> dict[str, float | int | None]:
        """Windowed rates (per second) and latency percentiles (seconds) as of ``now``."""
        start = now - self.window_s
        finished = [f for f in self._finished if f.finished_time >= start]
        ttfts = [f.ttft_s for f in finished if f.ttft_s is not None]
        queues = [f.queue_s for f in finished if f.queue_s is not None]
        e2es = [f.e2e_s for f in finished]
        rejected = sum(1 for t in self._rejected if t >= start)
        # Rates over the span actually observed, so a fresh gateway does not
        # under-report by dividing a few seconds of traffic by a full minute.
        span = min(self.window_s, max(now - self._first_seen(), 1.0))
        out: dict[str, float | int | None] = {
            "window_s": self.window_s,
            "requests_per_s": len(finished) / span if finished else 0.0,
            "rejections_per_s": rejected / span if rejected else 0.0,
            "num_finished": len(finished),
            "num_rejected": rejected,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p95_s": percentile(ttfts, 95),
            "queue_p95_s": percentile(queues, 95),
            "e2e_p50_s": percentile(e2es, 50),
            "e2e_p95_s": percentile(e2es, 95),
            **engine_rates([self], now),
        }
        return out

    def engine_span(self, now: float) -> tuple[EngineSample, EngineSample] | None:
        """The first and last engine sample within the window (None: fewer than two)."""
        engine = [s for s in self._engine if s.time >= now - self.window_s]
        return (engine[0], engine[-1]) if len(engine) >= 2 else None

    def _first_seen(self) -> float:
        times = []
        if self._finished:
            times.append(self._finished[0].finished_time)
        if self._rejected:
            times.append(self._rejected[0])
        if self._engine:
            times.append(self._engine[0].time)
        return min(times) if times else math.inf


ENGINE_RATES = ("generation_tokens_per_s", "prompt_tokens_per_s", "preemptions_per_s")


def engine_rates(windows: list[LiveWindow], now: float) -> dict[str, float | None]:
    """The engine-side rates of ``summary`` over several engines' windows: token and preemption
    rates add up, the step split covers every engine's steps (data parallel: the whole fleet)."""
    out: dict[str, float | None] = dict.fromkeys(ENGINE_RATES, 0.0)
    out.update({"step_mean_s": None, "tokens_per_step": None,
                **{f"step_{phase}_share": None for phase in STEP_SHARE_PHASES}})
    spans = [span for w in windows if (span := w.engine_span(now)) is not None]
    for first, last in spans:
        seconds = last.time - first.time
        for key, a, b in (("generation_tokens_per_s", first.generation_tokens_total, last.generation_tokens_total),
                          ("prompt_tokens_per_s", first.prompt_tokens_total, last.prompt_tokens_total),
                          ("preemptions_per_s", first.num_preemptions_total, last.num_preemptions_total)):
            out[key] = (out[key] or 0.0) + _counter_rate(a, b, seconds)
    out.update(_step_split(spans))
    return out

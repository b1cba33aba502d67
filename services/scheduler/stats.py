"""Counters and per-step samples the scheduler keeps, and the ``EngineStats`` built from them.

Totals only grow (Prometheus counters at the gateway take their rate); per-step
samples are cleared each time stats are taken, and capped so that a caller that
never takes stats cannot make them grow without bound.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from shared.messages import STEP_PHASES, EngineStats, RequestSummary

from .request import Request

MAX_STEP_SAMPLES = 10_000
MAX_SUMMARIES = 50
DRAIN_WINDOW_S = 30.0


class SchedulerCounters:
    """Running totals plus the samples of the steps since the last ``EngineStats``."""

    def __init__(self, start_time: float) -> None:
        self.start_time = start_time
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.rejected: Counter[str] = Counter()
        self.finished: Counter[str] = Counter()
        self.step_num_tokens: list[int] = []
        self.step_num_seqs: list[int] = []
        self.step_duration_s: list[float] = []
        self.step_tokens_total = 0
        # per-step phase samples (see EngineStats.step_schedule_s) and their running sums
        self.step_phases: dict[str, list[float]] = {p: [] for p in STEP_PHASES}
        self.step_phase_seconds_total: dict[str, float] = dict.fromkeys(STEP_PHASES, 0.0)
        self._drains: deque[float] = deque()  # times requests left the waiting queue

    def record_step(self, num_tokens: int, num_seqs: int) -> None:
        self.steps += 1
        self.step_tokens_total += num_tokens
        if len(self.step_num_tokens) < MAX_STEP_SAMPLES:
            self.step_num_tokens.append(num_tokens)
            self.step_num_seqs.append(num_seqs)

    def record_step_duration(self, seconds: float) -> None:
        if len(self.step_duration_s) < MAX_STEP_SAMPLES:
            self.step_duration_s.append(seconds)

    def record_step_phases(self, schedule_s: float, forward_s: float, sample_s: float, idle_s: float) -> None:
        """One completed step's time split (measured by the scheduler service, not the core)."""
        totals = self.step_phase_seconds_total
        for phase, seconds in (("schedule", schedule_s), ("forward", forward_s), ("sample", sample_s),
                               ("idle", idle_s)):
            totals[phase] += seconds
            samples = self.step_phases[phase]
            if len(samples) < MAX_STEP_SAMPLES:
                samples.append(seconds)

    def take_phase_samples(self) -> dict[str, list[float]]:
        samples = self.step_phases
        self.step_phases = {p: [] for p in STEP_PHASES}
        return samples

    def record_drain(self, now: float) -> None:
        drains = self._drains
        drains.append(now)
        while drains and drains[0] < now - DRAIN_WINDOW_S:
            drains.popleft()

    def drain_rate(self, now: float) -> float:
        """Requests per second leaving the waiting queue over the last ``DRAIN_WINDOW_S``."""
        drains = self._drains
        while drains and drains[0] < now - DRAIN_WINDOW_S:
            drains.popleft()
        span = min(DRAIN_WINDOW_S, now - self.start_time)
        if not drains or span <= 0:
            return 0.0
        return len(drains) / max(span, 1.0)

    def take_samples(self) -> tuple[list[int], list[int], list[float]]:
        samples = (self.step_num_tokens, self.step_num_seqs, self.step_duration_s)
        self.step_num_tokens, self.step_num_seqs, self.step_duration_s = [], [], []
        return samples


def build_stats(
    counters: SchedulerCounters,
    now: float,
    running: list[Request],
    waiting: Iterable[Request],
    num_waiting: int,
    num_blocks_total: int,
    num_blocks_free: int,
    config: dict[str, str],
) -> EngineStats:
    """One ``EngineStats`` snapshot; takes (clears) the per-step samples."""
    running_by_prio: Counter[int] = Counter(r.priority for r in running)
    waiting_by_prio: Counter[int] = Counter()
    waiting_rows: list[RequestSummary] = []
    for req in waiting:
        waiting_by_prio[req.priority] += 1
        if len(waiting_rows) < MAX_SUMMARIES:
            waiting_rows.append(req.summary(now))
    step_tokens, step_seqs, step_durations = counters.take_samples()
    phases = counters.take_phase_samples()
    return EngineStats(
        time=now,
        num_running=len(running),
        num_waiting=num_waiting,
        num_kv_blocks_total=num_blocks_total,
        num_kv_blocks_free=num_blocks_free,
        kv_usage=(num_blocks_total - num_blocks_free) / num_blocks_total,
        num_preemptions_total=counters.num_preemptions,
        prefix_cache_queries_total=counters.prefix_cache_queries,
        prefix_cache_hits_total=counters.prefix_cache_hits,
        prompt_tokens_total=counters.prompt_tokens,
        generation_tokens_total=counters.generation_tokens,
        steps_total=counters.steps,
        num_running_by_priority=dict(running_by_prio),
        num_waiting_by_priority=dict(waiting_by_prio),
        rejected_total=dict(counters.rejected),
        finished_total=dict(counters.finished),
        step_num_tokens=step_tokens,
        step_num_seqs=step_seqs,
        step_duration_s=step_durations,
        running=[r.summary(now) for r in running[:MAX_SUMMARIES]],
        waiting=waiting_rows,
        drain_rate_rps=counters.drain_rate(now),
        config=config,
        step_schedule_s=phases["schedule"],
        step_forward_s=phases["forward"],
        step_sample_s=phases["sample"],
        step_idle_s=phases["idle"],
        step_phase_seconds_total=dict(counters.step_phase_seconds_total),
        step_tokens_total=counters.step_tokens_total,
    )

"""The server's own view of a run, read from its Prometheus ``/metrics``.

Three things only the server knows: how long requests waited in its queue,
how many it preempted, and how much memory it held. The tool scrapes
``/metrics`` once before and once after a run and takes deltas of the queue
time histogram and the preemption counter, so traffic from earlier runs does
not leak in; and it samples the running/waiting gauges and the process memory
gauge during the run for the plots and the peak.

Metric names are configurable; the defaults are ferry's names followed by
vLLM's, the first one present wins. A server without ``/metrics`` (or without
one of the metrics) yields ``None`` for those columns, shown as "n/a".
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class MetricNames:
    queue_time: tuple[str, ...] = ("ferry:request_queue_time_seconds", "vllm:request_queue_time_seconds")
    preemptions: tuple[str, ...] = ("ferry:num_preemptions_total", "vllm:num_preemptions_total")
    running: tuple[str, ...] = ("ferry:num_requests_running", "vllm:num_requests_running")
    waiting: tuple[str, ...] = ("ferry:num_requests_waiting", "vllm:num_requests_waiting")
    memory: tuple[str, ...] = (
        "ferry:process_resident_memory_bytes",
        "vllm:process_resident_memory_bytes",
        "process_resident_memory_bytes",
    )
    kv_usage: tuple[str, ...] = ("ferry:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    kv_blocks: tuple[str, ...] = ("ferry:num_kv_blocks",)
    kv_blocks_free: tuple[str, ...] = ("ferry:num_kv_blocks_free",)

    @classmethod
    def with_overrides(cls, items: list[str]) -> MetricNames:
        """``kind=name1,name2`` items replace the candidates of one kind."""
        values: dict[str, tuple[str, ...]] = {}
        kinds = set(cls.__dataclass_fields__)
        for item in items:
            kind, sep, names = item.partition("=")
            if not sep or kind not in kinds or not names:
                raise ValueError(f"--metric-name {item!r}: expected KIND=NAME[,NAME] with KIND in {sorted(kinds)}")
            values[kind] = tuple(n.strip() for n in names.split(",") if n.strip())
        return cls(**values)


def parse_metrics(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def _candidates(name: str) -> list[str]:
    # Counters appear with and without the _total suffix depending on the exporter.
    return [name, name[: -len("_total")]] if name.endswith("_total") else [name, name + "_total"]


def scalar_sum(samples: Samples, names: tuple[str, ...]) -> float | None:
    """Sum over label sets of the first listed metric present."""
    for name in names:
        for candidate in _candidates(name):
            series = samples.get(candidate)
            if series:
                return sum(value for _, value in series)
    return None


def histogram(samples: Samples, names: tuple[str, ...]) -> dict[float, float] | None:
    """Cumulative bucket counts by upper bound, summed over label sets."""
    for name in names:
        series = samples.get(name + "_bucket")
        if not series:
            continue
        buckets: dict[float, float] = {}
        for labels, value in series:
            bound = float(labels.get("le", "+Inf"))
            buckets[bound] = buckets.get(bound, 0.0) + value
        return buckets
    return None


def histogram_delta(before: dict[float, float] | None, after: dict[float, float] | None) -> dict[float, float] | None:
    if after is None:
        return None
    before = before or {}
    return {bound: max(0.0, count - before.get(bound, 0.0)) for bound, count in after.items()}


def histogram_quantile(q: float, buckets: dict[float, float] | None) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket holding the rank."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return prev_bound  # the rank is past the last finite bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def first_bucket_bound(q: float, buckets: dict[float, float] | None) -> float | None:
    """The first bucket's upper bound when the q-quantile falls in it (the estimate is then only a bound)."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total > 0 and buckets[bounds[0]] >= q * total and not math.isinf(bounds[0]):
        return bounds[0]
    return None


@dataclass
class ServerSeries:
    """Samples taken while a run is going."""

    t_s: list[float] = field(default_factory=list)
    running: list[float | None] = field(default_factory=list)
    waiting: list[float | None] = field(default_factory=list)
    memory_bytes: list[float | None] = field(default_factory=list)
    kv_usage: list[float | None] = field(default_factory=list)
    kv_blocks: list[float | None] = field(default_factory=list)
    kv_blocks_free: list[float | None] = field(default_factory=list)

    def peak_memory(self) -> float | None:
        values = [v for v in self.memory_bytes if v is not None]
        return max(values) if values else None

    def peak_kv(self) -> dict[str, float | None]:
        """The highest KV usage seen, as a fraction and (where the server says how many blocks it
        has and how many are free) as blocks in use."""
        usage = [v for v in self.kv_usage if v is not None]
        used = [t - f for t, f in zip(self.kv_blocks, self.kv_blocks_free, strict=False)
                if t is not None and f is not None]
        totals = [t for t in self.kv_blocks if t is not None]
        return {"peak_kv_usage": max(usage) if usage else None,
                "peak_kv_blocks_used": max(used) if used else None,
                "kv_blocks_total": max(totals) if totals else None}

    def to_dict(self) -> dict[str, Any]:
        return {
            "t_s": [round(t, 3) for t in self.t_s],
            "running": self.running,
            "waiting": self.waiting,
            "memory_bytes": self.memory_bytes,
            "kv_usage": self.kv_usage,
        }


class MetricsScraper:
    """Scrapes one /metrics URL; every failure means 'not available', never an exception."""

    def __init__(self, url: str | None, names: MetricNames, timeout_s: float = 5.0) -> None:
        self.url, self.names = url, names
        self.timeout_s = timeout_s
        self.failures = 0
        self.last_error: str | None = None

    async def scrape(self, client: httpx.AsyncClient) -> Samples | None:
        if not self.url:
            return None
        try:
            response = await client.get(self.url, timeout=self.timeout_s)
            if response.status_code != 200:
                raise ValueError(f"HTTP {response.status_code}")
            return parse_metrics(response.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            return None

    async def sample_until(self, stop: asyncio.Event, run_start: float, interval_s: float) -> ServerSeries:
        """Sample the gauges every ``interval_s`` until ``stop`` is set."""
        series = ServerSeries()
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                samples = await self.scrape(client)
                series.t_s.append(time.perf_counter() - run_start)
                for target, names in (
                    (series.running, self.names.running),
                    (series.waiting, self.names.waiting),
                    (series.memory_bytes, self.names.memory),
                    (series.kv_usage, self.names.kv_usage),
                    (series.kv_blocks, self.names.kv_blocks),
                    (series.kv_blocks_free, self.names.kv_blocks_free),
                ):
                    target.append(None if samples is None else scalar_sum(samples, names))
                try:
                    await asyncio.wait_for(stop.wait(), timeout=interval_s)
                    return series
                except TimeoutError:
                    continue


def server_deltas(before: Samples | None, after: Samples | None, names: MetricNames) -> dict[str, Any]:
    """Queue-time quantiles and the preemption count between two scrapes (None: not available)."""
    out: dict[str, Any] = {"queue_p50_s": None, "queue_p95_s": None, "queue_p99_s": None,
                           "queue_mean_s": None, "queue_count": None, "queue_p95_below_s": None,
                           "preemptions": None}
    if after is None:
        return out
    buckets = histogram_delta(histogram(before or {}, names.queue_time), histogram(after, names.queue_time))
    if buckets:
        for q, key in ((0.5, "queue_p50_s"), (0.95, "queue_p95_s"), (0.99, "queue_p99_s")):
            out[key] = histogram_quantile(q, buckets)
        out["queue_p95_below_s"] = first_bucket_bound(0.95, buckets)
        count = buckets[max(buckets)]
        out["queue_count"] = count
        sums = [scalar_sum(s or {}, tuple(n + "_sum" for n in names.queue_time)) for s in (before, after)]
        if sums[1] is not None and count > 0:
            out["queue_mean_s"] = (sums[1] - (sums[0] or 0.0)) / count
    after_pre = scalar_sum(after, names.preemptions)
    if after_pre is not None:
        before_pre = scalar_sum(before or {}, names.preemptions)
        out["preemptions"] = after_pre - (before_pre or 0.0)
    return out

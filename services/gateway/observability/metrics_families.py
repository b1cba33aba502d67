"""Building blocks of the gateway's metrics: bucket edges, the prefix fan-out, scrape-time series.

``Fan`` lets one logical metric live under ``ferry:`` and, in vLLM compatibility
mode, under ``vllm:`` too, with the ``model_name``/``engine`` labels filled in.
``ScrapeTimeCollector`` produces the series whose label sets are only known at
scrape time: the health of each component and the engine's effective knobs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# why the gateway resumed requests: the label of ferry:requests_resumed_total
CAUSE_CONNECTION_LOST = "connection_lost"
CAUSE_SILENT = "scheduler_silent"
CAUSE_NEW_INCARNATION = "new_incarnation"
RESUME_CAUSES = (CAUSE_CONNECTION_LOST, CAUSE_SILENT, CAUSE_NEW_INCARNATION)

# Bucket edges follow vLLM's so quantiles line up when both are on one dashboard.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# ferry's own request-phase series add finer edges below vLLM's first (0.3 s), so a
# p95 queue or prefill time in the tens of milliseconds can be read; the vllm:
# compat series keep exactly vLLM's edges.
FINE_REQUEST_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, *REQUEST_BUCKETS]
STEP_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
STEP_SEQ_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
STEP_TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
N_BUCKETS = [1, 2, 5, 10, 20]
DELIVERY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's length buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > limit:
                return out
            out.append(float(value))
        scale *= 10


class Fan:
    """One logical metric exposed under one or more prefixes, with fixed base labels."""

    def __init__(self, metrics: list[MetricWrapperBase], base: dict[str, str]) -> None:
        self._metrics = metrics
        self._base = base

    def rebased(self, base: dict[str, str]) -> Fan:
        """The same metrics under other base label values (one engine's view of a shared family)."""
        return Fan(self._metrics, base)

    def _children(self, labels: dict[str, str]) -> list[Any]:
        return [m.labels(**self._base, **labels) for m in self._metrics]

    def set(self, value: float, **labels: str) -> None:
        for child in self._children(labels):
            child.set(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        children = self._children(labels)  # creates the series even for a zero increase
        if amount <= 0:
            return
        for child in children:
            child.inc(amount)

    def touch(self, **labels: str) -> None:
        """Create the labelled series now, so scrapes show it (at zero) before its first sample."""
        self._children(labels)

    def observe(self, value: float, **labels: str) -> None:
        for child in self._children(labels):
            child.observe(value)

    def remove(self, **labels: str) -> None:
        values = [*self._base.values(), *labels.values()]
        for metric in self._metrics:
            try:
                metric.remove(*values)
            except KeyError:
                pass


class ScrapeTimeCollector(Collector):
    """``ferry:component_up{component}`` and ``ferry:engine_config_info{knob,value}``, built per scrape.

    ``components`` returns (name, up) pairs (from the gateway's health view);
    ``config`` returns the scheduler's effective knobs (from the latest EngineStats).
    """

    def __init__(self, base: Mapping[str, str], components: Callable[[], Iterable[tuple[str, bool]]],
                 config: Callable[[], Mapping[str, str]]) -> None:
        self._base = dict(base)
        self._components = components
        self._config = config

    def collect(self) -> Iterable[Metric]:
        labels = [*self._base, "component"]
        up = GaugeMetricFamily("ferry:component_up", "1 when a ferry component (gateway, scheduler, "
                               "worker N, redis) is healthy, 0 when it is not.", labels=labels)
        for name, ok in self._components():
            up.add_metric([*self._base.values(), name], 1.0 if ok else 0.0)
        yield up
        info = GaugeMetricFamily("ferry:engine_config_info", "The scheduler's effective knobs (value 1).",
                                 labels=[*self._base, "knob", "value"])
        for knob, value in sorted(self._config().items()):
            info.add_metric([*self._base.values(), knob, str(value)], 1.0)
        yield info

"""The gateway's Prometheus metrics: engine gauges and counters, request histograms.

The scheduler sends ``EngineStats`` (cumulative totals, per-step samples, queue
tables, process memory) a few times a second; the gateway's request handlers
report each finished or rejected request. ``GatewayMetrics`` turns both into
Prometheus series on its own ``CollectorRegistry`` (no process globals, so tests
and several gateways in one process never collide) and keeps a short sliding
window for the live dashboard.

Names follow vLLM's under a ``ferry:`` prefix (``ferry:num_requests_running``,
``ferry:time_to_first_token_seconds``...), with labels ``model_name`` and
``engine`` like vLLM's. With ``vllm_compat=True`` every metric vLLM also has is
exposed a second time under its exact ``vllm:`` name, so vLLM Grafana dashboards
and load tools that scrape those names work unchanged. Counters are declared
without ``_total``; prometheus_client appends it (``ferry:num_preemptions_total``).
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics import MetricWrapperBase

from services.gateway.observability.metrics_families import (
    DELIVERY_BUCKETS,
    FINE_REQUEST_BUCKETS,
    ITL_BUCKETS,
    N_BUCKETS,
    REQUEST_BUCKETS,
    RESUME_CAUSES,
    STEP_SEQ_BUCKETS,
    STEP_TIME_BUCKETS,
    STEP_TOKEN_BUCKETS,
    TTFT_BUCKETS,
    Fan,
    ScrapeTimeCollector,
    one_two_five_buckets,
)
from services.gateway.observability.metrics_window import EngineSample, FinishedSample, LiveWindow
from shared.messages import STEP_PHASES, EngineHealth, EngineStats, RequestTimings

GATEWAY_PROCESS = "gateway"
ComponentSource = Callable[[], Iterable[tuple[str, bool]]]
# Finish reasons shown as zero series from the start (others appear when they occur).
FINISH_REASONS = ("stop", "length", "abort")
# Why an authentication failed (admission/auth_gate.py, admission/ops_auth.py); 'throttled': answered 429 instead.
AUTH_FAILURE_REASONS = ("missing_key", "invalid_key", "missing_admin_key", "not_admin", "throttled")
AUTH_FLOOD_EVENT_S = 10.0  # at most one "failed authentications" event on the dashboard this often
AUTH_FLOOD_MIN = 10  # failures since the last such event that make one


@dataclass
class RequestRecord:
    """One finished request as the gateway saw it, plus the scheduler's timings."""

    req_id: str
    priority: int
    finish_reason: str
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    arrival_time: float
    first_token_time: float | None
    finished_time: float
    token_times: list[float]  # wall time each token batch arrived at the gateway
    timings: RequestTimings | None  # the scheduler's view (queue, prefill, decode)
    max_tokens: int | None = None  # the request's max_tokens, when it set one
    n: int = 1  # choices asked for


@dataclass
class _AuthFlood:
    """Failed authentications since the last flood event on the dashboard."""

    since: float | None = None
    count: int = 0
    addresses: set[str] = field(default_factory=set)


class GatewayMetrics:
    """All of one gateway's metrics, on a private registry."""

    def __init__(
        self,
        model_name: str,
        vllm_compat: bool = False,
        *,
        engine: str = "0",
        max_model_len: int = 32768,
        window_s: float = 60.0,
        history_s: float = 300.0,
    ) -> None:
        self.model_name = model_name
        self.vllm_compat = vllm_compat
        self.registry = CollectorRegistry(auto_describe=True)
        self.window = LiveWindow(window_s=window_s, history_s=history_s)
        self.last_stats: EngineStats | None = None
        self.last_health: EngineHealth | None = None
        self._base = {"model_name": model_name, "engine": engine}
        self._last_totals: dict[str, int] = {}
        self._seen_labels: dict[str, set[str]] = {}
        self._own_process = psutil.Process(os.getpid())
        self._components: ComponentSource = lambda: [(GATEWAY_PROCESS, True)]
        # notable gateway events for the dashboard (time.time(), text), newest last
        self.events: collections.deque[tuple[float, str]] = collections.deque(maxlen=20)
        self._auth_flood = _AuthFlood()  # failures since the last flood event
        self._declare_engine()
        self._declare_requests(max_model_len)
        self.registry.register(ScrapeTimeCollector(
            self._base, lambda: self._components(),
            lambda: dict(self.last_stats.config) if self.last_stats is not None else {},
        ))

    @property
    def engine_name(self) -> str:
        """The ``engine`` label this view's engine-side series carry."""
        return self._base["engine"]

    def set_component_source(self, source: ComponentSource) -> None:
        """Where ``ferry:component_up`` reads (component, healthy) pairs at each scrape."""
        self._components = source

    # -- declaration ----------------------------------------------------------

    def _fan(self, cls: type[MetricWrapperBase], name: str, doc: str, labels: tuple[str, ...] = (),
             vllm: bool = True, ferry: bool = True, vllm_buckets: list[float] | None = None,
             **kwargs: Any) -> Fan:
        """One metric under ``ferry:`` (and ``vllm:`` in compat mode); ``vllm_buckets``
        replaces ``buckets`` for the ``vllm:`` series only, which keep vLLM's exact edges."""
        prefixes = (["ferry"] if ferry else []) + (["vllm"] if vllm and self.vllm_compat else [])
        labelnames = [*self._base, *labels]
        made = []
        for p in prefixes:
            kw = {**kwargs, "buckets": vllm_buckets} if p == "vllm" and vllm_buckets is not None else kwargs
            made.append(cls(f"{p}:{name}", doc, labelnames, registry=self.registry, **kw))
        if not labels:
            # Materialize the series now so scrapes show zeros (and rate() works)
            # before the first stats or request arrive.
            for metric in made:
                metric.labels(**self._base)
        return Fan(made, self._base)

    def _declare_engine(self) -> None:
        """Series fed by EngineStats: state gauges, counters from totals, per-step histograms."""
        g, c, h = Gauge, Counter, Histogram
        # Engine state (gauges from the latest EngineStats).
        self.running = self._fan(g, "num_requests_running", "Requests in the running set.")
        self.waiting = self._fan(g, "num_requests_waiting", "Requests in the waiting queue.")
        self.kv_usage = self._fan(g, "kv_cache_usage_perc", "KV-cache usage, in-use blocks / total (1 = 100%).")
        self.running_prio = self._fan(g, "num_requests_running_by_priority", "Running requests per priority.",
                                      ("priority",), vllm=False)
        self.waiting_prio = self._fan(g, "num_requests_waiting_by_priority", "Waiting requests per priority.",
                                      ("priority",), vllm=False)
        self.kv_blocks = self._fan(g, "num_kv_blocks", "KV blocks the engine has.", vllm=False)
        self.kv_blocks_free = self._fan(g, "num_kv_blocks_free", "KV blocks free or cached-unreferenced.",
                                        vllm=False)
        self.drain_rate = self._fan(g, "queue_drain_rate", "Requests leaving the waiting queue per second.",
                                    vllm=False)
        self.rss = self._fan(g, "process_resident_memory_bytes", "Resident memory of each ferry process.",
                             ("process",), vllm=False)
        self.peak_rss = self._fan(g, "process_peak_resident_memory_bytes",
                                  "Peak resident memory of each ferry process.", ("process",), vllm=False)
        self.device_peak = self._fan(g, "device_memory_peak_bytes", "Peak accelerator memory per worker.",
                                     ("process",), vllm=False)
        self.workers_ready = self._fan(g, "num_workers_ready", "Worker ranks that are up.", vllm=False)
        self.scheduler_ready = self._fan(g, "scheduler_ready", "1 when the scheduler reports ready.",
                                         vllm=False)
        self.stats_time = self._fan(g, "engine_stats_timestamp_seconds",
                                    "Wall time of the latest EngineStats (staleness = time() - this).",
                                    vllm=False)
        # Engine counters (deltas of the scheduler's cumulative totals).
        self.preemptions = self._fan(c, "num_preemptions", "Requests preempted by the scheduler.")
        self.prefix_queries = self._fan(c, "prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.prefix_hits = self._fan(c, "prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.prompt_tokens = self._fan(c, "prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = self._fan(c, "generation_tokens", "Generation tokens processed.")
        self.steps = self._fan(c, "engine_steps", "Scheduler steps run.", vllm=False)
        self.worker_restarts = self._fan(c, "worker_restarts", "Worker processes restarted.", vllm=False)
        # Per-step histograms (from the samples in each EngineStats).
        self.step_tokens = self._fan(h, "iteration_tokens_total", "Tokens per engine step.",
                                     buckets=STEP_TOKEN_BUCKETS)
        self.step_seqs = self._fan(h, "iteration_num_seqs", "Sequences per engine step.", vllm=False,
                                   buckets=STEP_SEQ_BUCKETS)
        self.step_time = self._fan(h, "iteration_duration_seconds", "Wall time of one engine step.",
                                   vllm=False, buckets=STEP_TIME_BUCKETS)
        self.step_phase = self._fan(
            h, "step_phase_seconds", "Where one step cycle goes: phase=schedule (the scheduler's "
            "schedule() and send), forward and sample (the worker's), idle (the rest of the cycle, "
            "in which the worker did not compute).", ("phase",), vllm=False, buckets=STEP_TIME_BUCKETS)
        for phase in STEP_PHASES:
            self.step_phase.touch(phase=phase)

    def _declare_requests(self, max_model_len: int) -> None:
        """Series fed by the gateway's request handlers: outcomes, latencies, lengths."""
        c, h = Counter, Histogram
        length = one_two_five_buckets(max_model_len)
        self.success = self._fan(c, "request_success", "Finished requests by finish reason.",
                                 ("finished_reason",))
        for reason in FINISH_REASONS:
            self.success.inc(0, finished_reason=reason)
        self.rejected = self._fan(c, "request_rejected", "Requests refused by the gateway, by reason.",
                                  ("reason", "status"), vllm=False)
        self.auth_failures = self._fan(c, "auth_failures", "Failed authentications (API and operator pages), "
                                       "by reason; 'throttled': the address was answered 429.", ("reason",),
                                       vllm=False)
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.inc(0, reason=reason)
        self.resumed = self._fan(c, "requests_resumed", "Requests re-submitted to a new scheduler after "
                                 "losing theirs, by cause.", ("cause",), vllm=False)
        for cause in RESUME_CAUSES:
            self.resumed.inc(0, cause=cause)
        self.cached_tokens = self._fan(c, "prompt_tokens_cached", "Prompt tokens served from the prefix cache.",
                                       vllm=False)
        self.ttft = self._fan(h, "time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS)
        self.itl = self._fan(h, "inter_token_latency_seconds", "Time between token batches.",
                             buckets=ITL_BUCKETS)
        self.tpot = self._fan(h, "request_time_per_output_token_seconds", "Decode time per output token.",
                              buckets=ITL_BUCKETS)
        self.tpot_legacy = self._fan(h, "time_per_output_token_seconds", "Deprecated vLLM name of the TPOT.",
                                     ferry=False, buckets=ITL_BUCKETS)
        # request phases: finer low edges under ferry:, vLLM's exact edges under vllm:
        phase: dict[str, Any] = {"buckets": FINE_REQUEST_BUCKETS, "vllm_buckets": REQUEST_BUCKETS}
        self.e2e = self._fan(h, "e2e_request_latency_seconds", "End-to-end request latency.", **phase)
        self.queue = self._fan(h, "request_queue_time_seconds", "Time in the waiting queue.", **phase)
        self.inference = self._fan(h, "request_inference_time_seconds", "Time in the running set.", **phase)
        self.prefill = self._fan(h, "request_prefill_time_seconds", "First scheduled to first token.", **phase)
        self.decode = self._fan(h, "request_decode_time_seconds", "First token to finish.", **phase)
        self.delivery = self._fan(h, "request_delivery_lag_seconds", "Scheduler finish to the gateway's "
                                  "last byte (detokenization, slow clients).", vllm=False, buckets=DELIVERY_BUCKETS)
        self.req_prompt = self._fan(h, "request_prompt_tokens", "Prompt length per request.", buckets=length)
        self.req_output = self._fan(h, "request_generation_tokens", "Output length per request.",
                                    buckets=length)
        self.req_max_gen = self._fan(h, "request_max_num_generation_tokens", "Generated tokens of the longest"
                                     " choice per request.", buckets=length)
        self.req_max_tokens = self._fan(h, "request_params_max_tokens", "The max_tokens parameter.",
                                        buckets=length)
        self.req_n = self._fan(h, "request_params_n", "The n parameter.", buckets=N_BUCKETS)
        self.req_preemptions = self._fan(h, "request_num_preemptions", "Times one request was preempted.",
                                         vllm=False, buckets=[0, 1, 2, 4, 8, 16])

    # -- engine side ----------------------------------------------------------

    def on_engine_stats(self, stats: EngineStats) -> None:
        """Update gauges and counters from one EngineStats and observe its step samples."""
        self.last_stats = stats
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_blocks.set(stats.num_kv_blocks_total)
        self.kv_blocks_free.set(stats.num_kv_blocks_free)
        self.drain_rate.set(stats.drain_rate_rps)
        self.workers_ready.set(len(stats.workers_ready))
        self.stats_time.set(stats.time)
        self._set_labelled(self.running_prio, "priority",
                           {str(k): v for k, v in stats.num_running_by_priority.items()}, absent=0.0)
        self._set_labelled(self.waiting_prio, "priority",
                           {str(k): v for k, v in stats.num_waiting_by_priority.items()}, absent=0.0)
        self._count(self.preemptions, "preemptions", stats.num_preemptions_total)
        self._count(self.prefix_queries, "prefix_queries", stats.prefix_cache_queries_total)
        self._count(self.prefix_hits, "prefix_hits", stats.prefix_cache_hits_total)
        self._count(self.prompt_tokens, "prompt_tokens", stats.prompt_tokens_total)
        self._count(self.generation_tokens, "generation_tokens", stats.generation_tokens_total)
        self._count(self.steps, "steps", stats.steps_total)
        self._count(self.worker_restarts, "worker_restarts", stats.worker_restarts_total)
        for num_tokens in stats.step_num_tokens:
            self.step_tokens.observe(num_tokens)
        for num_seqs in stats.step_num_seqs:
            self.step_seqs.observe(num_seqs)
        for duration in stats.step_duration_s:
            self.step_time.observe(duration)
        for phase, samples in (("schedule", stats.step_schedule_s), ("forward", stats.step_forward_s),
                               ("sample", stats.step_sample_s), ("idle", stats.step_idle_s)):
            for seconds in samples:
                self.step_phase.observe(seconds, phase=phase)
        self._set_labelled(self.rss, "process", stats.process_rss_bytes, absent=None)
        # A peak sampled a moment before the current RSS can read lower: a peak is never below now.
        peaks = {k: max(v, stats.process_rss_bytes.get(k, 0)) for k, v in stats.process_peak_rss_bytes.items()}
        self._set_labelled(self.peak_rss, "process", peaks, absent=None)
        self._set_labelled(self.device_peak, "process", stats.device_memory_peak_bytes, absent=None)
        self._update_own_memory()
        self.window.add_engine(EngineSample(
            time=stats.time, num_running=stats.num_running, num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage, num_preemptions_total=stats.num_preemptions_total,
            generation_tokens_total=stats.generation_tokens_total,
            prompt_tokens_total=stats.prompt_tokens_total,
            steps_total=stats.steps_total, step_tokens_total=stats.step_tokens_total,
            step_phase_seconds_total=stats.step_phase_seconds_total,
        ))

    def on_engine_health(self, health: EngineHealth) -> None:
        self.last_health = health
        self.scheduler_ready.set(1.0 if health.scheduler_ready else 0.0)
        self.workers_ready.set(len(health.workers_ready))

    def _count(self, fan: Fan, key: str, total: int) -> None:
        """Advance a counter by the increase of a scheduler total.

        A total below the previous one means the scheduler restarted and counts
        from zero again, so the whole new total is the increase; our counter stays
        monotonic either way.
        """
        last = self._last_totals.get(key)
        self._last_totals[key] = total
        if last is None or total < last:
            fan.inc(total)
        else:
            fan.inc(total - last)

    def _set_labelled(self, fan: Fan, label: str, values: dict[str, int], absent: float | None) -> None:
        """Set one series per label value; series that vanished go to ``absent`` (None: removed)."""
        key = f"{id(fan)}:{label}"
        previous = self._seen_labels.get(key, set())
        for value_label, value in values.items():
            fan.set(float(value), **{label: value_label})
        for gone in previous - set(values):
            if absent is None:
                fan.remove(**{label: gone})
            else:
                fan.set(absent, **{label: gone})
        if absent is None:
            self._seen_labels[key] = set(values)
        else:
            self._seen_labels[key] = previous | set(values)

    def own_memory(self) -> tuple[int, int]:
        """This gateway process's resident and peak resident memory, in bytes."""
        rss = int(self._own_process.memory_info().rss)
        # ru_maxrss is KiB on Linux, bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = peak if sys.platform == "darwin" else peak * 1024
        return rss, max(int(peak), rss)

    def _update_own_memory(self) -> None:
        rss, peak = self.own_memory()
        self.rss.set(float(rss), process=GATEWAY_PROCESS)
        self.peak_rss.set(float(peak), process=GATEWAY_PROCESS)

    # -- request side ---------------------------------------------------------

    def on_request_finished(self, rec: RequestRecord) -> None:
        """Observe one finished request's latencies, lengths and finish reason."""
        self.success.inc(1, finished_reason=rec.finish_reason)
        self.cached_tokens.inc(rec.num_cached_tokens)
        self.req_prompt.observe(rec.num_prompt_tokens)
        self.req_output.observe(rec.num_output_tokens)
        self.req_max_gen.observe(rec.num_output_tokens)
        self.req_n.observe(rec.n)
        if rec.max_tokens is not None:
            self.req_max_tokens.observe(rec.max_tokens)
        e2e = max(0.0, rec.finished_time - rec.arrival_time)
        self.e2e.observe(e2e)
        ttft = None
        if rec.first_token_time is not None:
            ttft = max(0.0, rec.first_token_time - rec.arrival_time)
            self.ttft.observe(ttft)
        for prev, cur in zip(rec.token_times, rec.token_times[1:], strict=False):
            self.itl.observe(max(0.0, cur - prev))
        if rec.first_token_time is not None and rec.num_output_tokens > 1:
            tpot = max(0.0, rec.finished_time - rec.first_token_time) / (rec.num_output_tokens - 1)
            self.tpot.observe(tpot)
            self.tpot_legacy.observe(tpot)
        queue = self._observe_phases(rec.timings)
        if rec.timings is not None and rec.timings.finished_time is not None:
            self.delivery.observe(max(0.0, rec.finished_time - rec.timings.finished_time))
        self.window.add_finished(FinishedSample(
            finished_time=rec.finished_time, ttft_s=ttft, queue_s=queue, e2e_s=e2e,
            num_output_tokens=rec.num_output_tokens, finish_reason=rec.finish_reason,
        ))

    def _observe_phases(self, t: RequestTimings | None) -> float | None:
        """Queue, prefill, decode and inference times from the scheduler's timings."""
        if t is None or t.first_scheduled_time is None:
            return None
        queue = max(0.0, t.first_scheduled_time - t.arrival_time)
        self.queue.observe(queue)
        self.req_preemptions.observe(t.num_preemptions)
        if t.first_token_time is not None:
            self.prefill.observe(max(0.0, t.first_token_time - t.first_scheduled_time))
            if t.finished_time is not None:
                self.decode.observe(max(0.0, t.finished_time - t.first_token_time))
        if t.finished_time is not None:
            self.inference.observe(max(0.0, t.finished_time - t.first_scheduled_time))
        return queue

    def on_requests_resumed(self, cause: str, num_requests: int) -> None:
        """The engine client re-submitted ``num_requests`` held requests to a new scheduler."""
        self.resumed.inc(num_requests, cause=cause)
        self.events.append((time.time(), f"scheduler lost ({cause}): {num_requests} in-flight request(s) resumed"))

    def on_auth_failure(self, reason: str, address: str, blocked_s: float, block_started: bool,
                        limit: int) -> None:
        """A failed authentication: counted; the dashboard's events show throttled addresses and,
        at most every ``AUTH_FLOOD_EVENT_S``, a burst of failures with how many addresses sent it."""
        self.auth_failures.inc(1, reason=reason)
        now = time.time()
        if block_started:
            self.events.append((now, f"{address} answered 429 for {blocked_s:.0f} s: more than {limit} "
                                     f"failed authentications in a minute"))
        flood = self._auth_flood
        if flood.since is None or (flood.count < AUTH_FLOOD_MIN and now - flood.since >= 60.0):
            flood.since, flood.count, flood.addresses = now, 0, set()
        flood.count += 1
        if len(flood.addresses) < 10_000:  # bounded however many addresses try
            flood.addresses.add(address)
        if flood.count >= AUTH_FLOOD_MIN and now - flood.since >= AUTH_FLOOD_EVENT_S:
            self.events.append((now, f"{flood.count} failed authentications in the last {now - flood.since:.0f} s "
                                     f"from {len(flood.addresses)} address(es)"))
            flood.since, flood.count, flood.addresses = now, 0, set()

    def on_rejected(self, reason: str, status: int) -> None:
        """Count a request the gateway refused (auth, validation, rate limit, queue full...)."""
        self.rejected.inc(1, reason=reason, status=str(status))
        self.window.add_rejected(time.time())

    # -- exposition -----------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type, for GET /metrics."""
        self._update_own_memory()
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4

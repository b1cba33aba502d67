"""One run: a trace sent at one offered rate (or concurrency), measured end to end.

A run scrapes the server's /metrics, starts a sampler of its gauges, sends the
requests on the arrival schedule (open loop) or from a fixed pool of workers
(closed loop), waits for every stream to end, scrapes again, and folds the
request records and the server deltas into one result: the run's summary, a
summary per scenario group, the sampled series, and the SLO verdict.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvloop

from loadtests.arrivals import ArrivalSpec, send_offsets
from loadtests.client import (
    AUTH_STATUSES,
    ClientConfig,
    RequestRecord,
    auth_refused,
    send_request,
    stream_session,
)
from loadtests.metrics import CostModel, GoodputSLO, RunSLO, slo_violations, summarize
from loadtests.progress import Progress
from loadtests.quality.checkers import Answer
from loadtests.quality.judge import judge
from loadtests.saturation import SaturationRule
from loadtests.saturation import judge as judge_saturation
from loadtests.scrape import MetricNames, MetricsScraper, server_deltas
from loadtests.trace import Trace, TraceRequest


class InFlight:
    """The client's count of open requests, recorded at every change (exact, unlike sampling)."""

    def __init__(self, run_start: float) -> None:
        self.run_start = run_start
        self.count = 0
        self.t_s: list[float] = [0.0]
        self.counts: list[int] = [0]

    def change(self, delta: int) -> None:
        self.count += delta
        self.t_s.append(round(time.perf_counter() - self.run_start, 4))
        self.counts.append(self.count)


@dataclass(frozen=True)
class RunPlan:
    name: str
    duration_s: float
    arrival: ArrivalSpec
    rate: float | None = None
    """Offered requests/s (open loop)."""
    concurrency: int | None = None
    """Requests kept in flight (closed loop)."""
    max_concurrency: int | None = None
    """Cap on in-flight requests in the open loop (None: no cap)."""


@dataclass(frozen=True)
class BenchSettings:
    client: ClientConfig
    metrics_url: str | None = None
    metric_names: MetricNames = field(default_factory=MetricNames)
    sample_interval_s: float = 0.5
    goodput: GoodputSLO = field(default_factory=GoodputSLO)
    slo: RunSLO = field(default_factory=RunSLO)
    cost: CostModel = field(default_factory=CostModel)
    quiet: bool = False
    records_dir: Path | None = None
    """Where per-request records are written as JSONL (None: not written)."""
    saturation: SaturationRule = field(default_factory=SaturationRule)
    references: Mapping[str, Answer] | None = None
    """Item id -> a reference run's answer: what ``agree`` task items are judged against."""


def run_once(trace: Trace, plan: RunPlan, settings: BenchSettings) -> dict[str, Any]:
    return uvloop.run(run_once_async(trace, plan, settings))


async def run_once_async(trace: Trace, plan: RunPlan, settings: BenchSettings) -> dict[str, Any]:
    scraper = MetricsScraper(settings.metrics_url, settings.metric_names)
    async with httpx.AsyncClient(trust_env=False) as probe:
        before = await scraper.scrape(probe)
    stop = asyncio.Event()
    async with stream_session(settings.client.request_timeout_s) as client:
        run_start = time.perf_counter()
        in_flight = InFlight(run_start)
        sampler = asyncio.create_task(scraper.sample_until(stop, run_start, settings.sample_interval_s))
        if plan.arrival.kind == "closed":
            records = await _closed_loop(client, trace.requests, plan, settings, run_start, in_flight)
        else:
            records = await _open_loop(client, trace, plan, settings, run_start, in_flight)
        duration = time.perf_counter() - run_start
        stop.set()
        series = await sampler
    async with httpx.AsyncClient(trust_env=False) as probe:
        after = await scraper.scrape(probe)
    samples = series.to_dict() | series.peak_kv() | {"peak_memory_bytes": series.peak_memory(),
                                  "client_t_s": in_flight.t_s, "client_in_flight": in_flight.counts}
    deltas = server_deltas(before, after, settings.metric_names)
    return build_result(plan, settings, records, duration, deltas, samples, after is not None)


def build_result(
    plan: RunPlan,
    settings: BenchSettings,
    records: list[RequestRecord],
    duration: float,
    server: dict[str, Any],
    series: dict[str, Any],
    server_metrics: bool,
) -> dict[str, Any]:
    summary = summarize(records, duration, settings.goodput, settings.cost, plan.rate)
    if plan.rate is not None and records:
        # The send rate over the planned window, not over the drain that follows it.
        summary["sent_rps"] = len(records) / max(plan.duration_s, max(r.sent_s for r in records))
    if summary["offered_rps"] is None:
        summary["offered_rps"] = summary["sent_rps"]  # closed loop: the achieved rate is the offer
    summary.update(_server_columns(summary, server, series))
    summary.update(judge_saturation(summary, series, plan.duration_s, settings.saturation))
    groups = sorted({r.group for r in records})
    by_group = {
        g: summarize([r for r in records if r.group == g], duration, settings.goodput, settings.cost)
        for g in groups
    }
    for group_summary in by_group.values():
        group_summary["queue_p95_ms"] = group_summary.get("client_reported_queue_p95_ms")
    if settings.records_dir is not None:
        write_records(settings.records_dir / f"requests-{plan.name}.jsonl", records)
    return {
        "name": plan.name,
        "rate": plan.rate,
        "concurrency": plan.concurrency,
        "arrival": plan.arrival.kind,
        "duration_limit_s": plan.duration_s,
        "summary": summary,
        "groups": by_group if len(groups) > 1 else {},
        "server_metrics": server_metrics,
        "series": series,
        "slo_violations": slo_violations(summary, settings.slo),
        "slo_targets": any(v is not None for v in vars(settings.slo).values()),
        "error_examples": sorted({f"{r.error_kind}: {r.error}" for r in records if r.status == "error"})[:5],
        **({"items": answered_items(records)} if any(r.task is not None for r in records) else {}),
    }


def answered_items(records: list[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Request id -> what a task request answered and how it was judged (completed ones only):
    what an experiment pairs item by item between configurations."""
    return {
        r.req_id: {"task": r.task, "correct": r.correct, "reason": r.check_reason, "text": r.text,
                   "tool_calls": r.tool_calls, "finish_reason": r.finish_reason}
        for r in records if r.task is not None and r.status == "ok"
    }


def _server_columns(summary: dict[str, Any], server: dict[str, Any], series: dict[str, Any]) -> dict[str, Any]:
    """Queue time (per-request if the server returned it, else histogram delta), preemptions, memory."""
    out: dict[str, Any] = {}
    if summary.get("client_reported_queue_p95_ms") is not None:
        out["queue_source"] = "per-request"
        for q in ("p50", "p95", "p99", "mean"):
            out[f"queue_{q}_ms"] = summary.get(f"client_reported_queue_{q}_ms")
    elif server.get("queue_p95_s") is not None:
        out["queue_source"] = "histogram-delta"
        for q in ("p50", "p95", "p99", "mean"):
            value = server.get(f"queue_{q}_s")
            out[f"queue_{q}_ms"] = None if value is None else value * 1000.0
        below = server.get("queue_p95_below_s")
        # Inside the histogram's first bucket the interpolation is a guess; say only "below".
        out["queue_p95_below_ms"] = None if below is None else below * 1000.0
    else:
        out["queue_source"] = None
        out.update({f"queue_{q}_ms": None for q in ("p50", "p95", "p99", "mean")})
    out["preemptions"] = server.get("preemptions")
    out["peak_memory_bytes"] = series.get("peak_memory_bytes")
    for key in ("peak_kv_usage", "peak_kv_blocks_used", "kv_blocks_total"):
        out[key] = series.get(key)
    return out


async def _tracked(
    client: aiohttp.ClientSession,
    request: TraceRequest,
    settings: BenchSettings,
    run_start: float,
    in_flight: InFlight,
    on_done: Callable[[RequestRecord], None],
) -> RequestRecord:
    in_flight.change(+1)
    try:
        record = await send_request(client, request, settings.client, run_start)
    finally:
        in_flight.change(-1)
    if record.http_status in AUTH_STATUSES:
        # every other request would be refused the same way: stop the run, say why
        raise auth_refused(record.http_status or 0, record.error or "", settings.client.api_key)
    judge(record, request, settings.references)
    on_done(record)
    return record


async def _open_loop(
    client: aiohttp.ClientSession,
    trace: Trace,
    plan: RunPlan,
    settings: BenchSettings,
    run_start: float,
    in_flight: InFlight,
) -> list[RequestRecord]:
    assert plan.rate is not None, "an open-loop run needs a rate"
    natural = float(trace.meta.get("nominal_rate") or trace.natural_rate())
    offsets = send_offsets(plan.arrival, plan.rate, plan.duration_s, [r.offset_s for r in trace.requests], natural)
    progress = Progress(len(offsets), plan.name, settings.quiet)
    gate = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None

    async def one(request: TraceRequest) -> RequestRecord:
        if gate is None:
            return await _tracked(client, request, settings, run_start, in_flight, progress.update)
        async with gate:
            return await _tracked(client, request, settings, run_start, in_flight, progress.update)

    tasks: list[asyncio.Task[RequestRecord]] = []
    failures: list[BaseException] = []  # a request that ends the run (a refusal for auth)

    def note_failure(task: asyncio.Task[RequestRecord]) -> None:
        if not task.cancelled() and task.exception() is not None:
            failures.append(task.exception())  # type: ignore[arg-type]

    try:
        for request, offset in zip(trace.requests, offsets, strict=False):
            delay = run_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if failures:
                for task in tasks:
                    task.cancel()
                raise failures[0]
            tasks.append(asyncio.create_task(one(request)))
            tasks[-1].add_done_callback(note_failure)
        records = list(await asyncio.gather(*tasks))
        # The offered load covers the whole window even when the last arrival came early:
        # a run is never shorter than its window, so throughput is not inflated.
        remaining = run_start + plan.duration_s - time.perf_counter()
        if remaining > 0:
            await asyncio.sleep(remaining)
        return records
    finally:
        progress.close()


async def _closed_loop(
    client: aiohttp.ClientSession,
    requests: list[TraceRequest],
    plan: RunPlan,
    settings: BenchSettings,
    run_start: float,
    in_flight: InFlight,
) -> list[RequestRecord]:
    assert plan.concurrency, "a closed-loop run needs a concurrency"
    progress = Progress(None, plan.name, settings.quiet)
    counter = itertools.count()
    records: list[RequestRecord] = []

    async def worker() -> None:
        while time.perf_counter() - run_start < plan.duration_s:
            index = next(counter)
            if index >= len(requests):
                return
            records.append(await _tracked(client, requests[index], settings, run_start, in_flight, progress.update))

    try:
        await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    finally:
        progress.close()
    return records


def write_records(path: Path, records: list[RequestRecord]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record.to_dict(), separators=(",", ":")) + "\n")


def warmup(trace: Trace, settings: BenchSettings, num_requests: int) -> None:
    """A few requests one at a time before measuring, so lazy start-up costs stay out of the first run."""
    if num_requests <= 0:
        return
    short = Trace(trace.requests[:num_requests], dict(trace.meta))
    quiet = BenchSettings(settings.client, quiet=True)
    plan = RunPlan("warmup", 3600.0, ArrivalSpec("closed"), concurrency=1)
    uvloop.run(_closed_loop_only(short, plan, quiet))


async def _closed_loop_only(trace: Trace, plan: RunPlan, settings: BenchSettings) -> None:
    async with stream_session(settings.client.request_timeout_s) as client:
        start = time.perf_counter()
        await _closed_loop(client, trace.requests, plan, settings, start, InFlight(start))

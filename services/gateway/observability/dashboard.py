"""The live ops dashboard: ``/dashboard`` (page), its static files, and its data stream.

The page is static HTML + JS (``static/dashboard.*``) that charts with the vendored
uPlot library (``static/vendor/uplot``, no CDN). Data is pushed by the server over
Server-Sent Events (``/dashboard/events``): one ``history`` event with the last
minutes of engine samples when the page connects, then a ``snapshot`` event every
``interval_s`` with the current numbers. ``/dashboard/data`` returns one snapshot
as JSON for scripts and tests.

Every number on the page comes from the same ``GatewayMetrics`` objects that
render ``/metrics``, so the two agree (the dashboard lags by at most one push).
With several engines (data parallel) each has its own metrics view (``engines``,
from the engine pool): the top cards, the chart and the step split cover every
engine (running, waiting, token rates add up; KV usage is used blocks over all
blocks), and the request tables list every engine's requests with an ``engine``
column. An engine whose stats went stale is left out of the sums.
The router adds no authentication; the gateway app decides who may see it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from services.gateway.observability.metrics import GATEWAY_PROCESS, GatewayMetrics
from services.gateway.observability.metrics_window import EngineSample, engine_rates
from shared.messages import EngineStats, RequestSummary

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
# Only these files are served: a fixed map, so no path from the URL touches the disk.
STATIC_FILES: dict[str, tuple[str, str]] = {
    "dashboard.js": ("dashboard.js", "text/javascript"),
    "dashboard.css": ("dashboard.css", "text/css"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css"),
}
# EngineStats older than this are shown as stale (the scheduler stopped reporting).
STALE_AFTER_S = 5.0
MAX_TABLE_ROWS = 50
# (engine name, its metrics view) for every engine behind this gateway
EngineViews = Callable[[], list[tuple[str, GatewayMetrics]]]


def _views(metrics: GatewayMetrics, engines: EngineViews | None) -> list[tuple[str, GatewayMetrics]]:
    views = engines() if engines is not None else []
    return views or [(metrics.engine_name, metrics)]


def _rows(per_engine: list[tuple[str, list[RequestSummary]]]) -> list[dict[str, Any]]:
    """Every engine's requests, interleaved (so each engine shows up when the table is cut at
    ``MAX_TABLE_ROWS``) and in each engine's own order (admission, or queue order)."""
    rows: list[dict[str, Any]] = []
    for group in itertools.zip_longest(*(summaries for _, summaries in per_engine)):
        for (engine, _), s in zip(per_engine, group, strict=True):
            if s is not None and len(rows) < MAX_TABLE_ROWS:
                rows.append({"engine": engine, "req_id": s.req_id, "priority": s.priority,
                             "num_prompt_tokens": s.num_prompt_tokens, "num_output_tokens": s.num_output_tokens,
                             "num_computed_tokens": s.num_computed_tokens, "age_s": round(s.age_s, 3)})
    return rows


def _processes(stats: list[tuple[str, EngineStats]], metrics: GatewayMetrics) -> list[dict[str, Any]]:
    """Resident / peak memory per ferry process: the gateway's own plus what each scheduler sent
    (several engines: their processes are named ``engine<name>/scheduler``, ``engine<name>/worker0``...)."""
    rss: dict[str, int] = {}
    peak: dict[str, int] = {}
    device: dict[str, int] = {}
    for engine, st in stats:
        prefix = f"engine{engine}/" if len(stats) > 1 else ""
        rss.update({prefix + k: v for k, v in st.process_rss_bytes.items()})
        peak.update({prefix + k: v for k, v in st.process_peak_rss_bytes.items()})
        device.update({prefix + k: v for k, v in st.device_memory_peak_bytes.items()})
    own = metrics.own_memory()
    rss[GATEWAY_PROCESS], peak[GATEWAY_PROCESS] = own
    for name, value in rss.items():  # a peak sampled a moment earlier can read below the current RSS
        peak[name] = max(peak.get(name, 0), value)
    names = [GATEWAY_PROCESS] + sorted(n for n in rss if n != GATEWAY_PROCESS)
    return [{"name": n, "rss_bytes": rss.get(n), "peak_rss_bytes": peak.get(n),
             "device_memory_peak_bytes": device.get(n)} for n in names]


def _engine(stats: list[tuple[str, EngineStats]], now: float) -> dict[str, Any]:
    """The top cards: every engine's numbers added up (the stale ones left out, unless all are)."""
    if not stats:
        return {"available": False, "stale": True, "num_running": None, "num_waiting": None,
                "num_engines": 0, "engines_reporting": 0}
    fresh = [(e, st) for e, st in stats if now - st.time <= STALE_AFTER_S]
    shown = [st for _, st in (fresh or stats)]  # all stale: the last numbers, marked stale
    queries = sum(st.prefix_cache_queries_total for st in shown)
    total_blocks = sum(st.num_kv_blocks_total for st in shown)
    free_blocks = sum(st.num_kv_blocks_free for st in shown)
    if total_blocks:
        kv_usage = (total_blocks - free_blocks) / total_blocks
    else:
        kv_usage = sum(st.kv_usage for st in shown) / len(shown)
    age = max(0.0, now - min(st.time for st in shown))  # the oldest numbers in the sums
    return {
        "available": True, "stats_time": min(st.time for st in shown), "stats_age_s": round(age, 3),
        "stale": not fresh, "num_engines": len(stats), "engines_reporting": len(fresh),
        "num_running": sum(st.num_running for st in shown), "num_waiting": sum(st.num_waiting for st in shown),
        "kv_usage": kv_usage, "num_kv_blocks_total": total_blocks, "num_kv_blocks_free": free_blocks,
        "num_preemptions_total": sum(st.num_preemptions_total for st in shown),
        "worker_restarts_total": sum(st.worker_restarts_total for st in shown),
        "prefix_cache_hit_rate": sum(st.prefix_cache_hits_total for st in shown) / queries if queries else None,
        "drain_rate_rps": sum(st.drain_rate_rps for st in shown),
        "steps_total": sum(st.steps_total for st in shown),
        "workers_ready": list(shown[0].workers_ready) if len(stats) == 1 else
        [f"{e}/{rank}" for e, st in (fresh or stats) for rank in st.workers_ready],
        "running_by_priority": _sum_by_priority(st.num_running_by_priority for st in shown),
        "waiting_by_priority": _sum_by_priority(st.num_waiting_by_priority for st in shown),
    }


def _sum_by_priority(counts: Iterable[dict[int, int]]) -> dict[str, int]:
    total: dict[int, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return {str(k): v for k, v in sorted(total.items())}


_GOOD = {"ok", "ready", "up", "healthy", "connected", "serving", "true"}


def _detail(d: dict[str, Any], keys: tuple[str, ...]) -> str:
    """The few fields worth a glance, in order; a reason only when it says something."""
    parts = []
    for key in keys:
        value = d.get(key)
        if value is None or value == "" or isinstance(value, dict | list):
            continue
        if key == "reason" and value in ("ready", "ok"):
            continue
        parts.append(f"{key}={value}")
    return "  ".join(parts)


def health_components(health: dict[str, Any], stats: EngineStats | None) -> list[dict[str, Any]]:
    """One row per process (gateway, scheduler, each worker, Redis) from the gateway's /health view.

    ``up`` is True, False, or None where the component is switched off (no Redis
    configured). Worker ranks come from the scheduler's view: ``num_workers`` and
    ``workers_ready``.
    """
    rows: list[dict[str, Any]] = [{
        "name": GATEWAY_PROCESS, "status": str(health.get("status", "ok")), "up": True,
        "detail": _detail(health, ("error", "reason", "gateway_id", "version")),
    }]
    sched = health.get("scheduler")
    if isinstance(sched, dict):
        ready = bool(sched.get("ready", sched.get("status") in _GOOD))
        status = "ready" if ready else ("connected" if sched.get("connected") else "down")
        rows.append({"name": "scheduler", "status": status, "up": ready,
                     "detail": _detail(sched, ("reason", "last_seen_s_ago", "in_flight"))})
        num_workers = sched.get("num_workers") or 0
        ready_ranks = set(sched.get("workers_ready") or [])
        if stats is not None and not ready_ranks:
            ready_ranks = set(stats.workers_ready)
        for rank in range(int(num_workers)):
            up = ready and rank in ready_ranks
            rows.append({"name": f"worker {rank}", "status": "ready" if up else "down", "up": up, "detail": ""})
    redis = health.get("redis")
    if isinstance(redis, dict):
        state = str(redis.get("redis", redis.get("status", "unknown")))
        redis_up = None if state == "disabled" else state in _GOOD
        rows.append({"name": "redis", "status": state, "up": redis_up,
                     "detail": _detail(redis, ("detail", "auth", "degraded_since"))})
    elif isinstance(redis, str):
        rows.append({"name": "redis", "status": redis, "up": None if redis == "disabled" else redis in _GOOD,
                     "detail": ""})
    return rows


def _flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in d.items():
        if isinstance(value, dict):
            out += _flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _config_rows(knobs: dict[str, Any], extra: dict[str, Any]) -> list[tuple[str, Any]]:
    """Scheduler knobs first (what the issue asks operators to see), then everything else, flattened."""
    scheduler = dict(knobs)
    scheduler.update(extra.get("scheduler") or {})
    rest = {k: v for k, v in extra.items() if k != "scheduler"}
    return sorted(_flatten(scheduler, "scheduler.")) + sorted(_flatten(rest))


def _state(state: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return dict(state())
    except Exception as exc:  # the page must keep updating even when a health probe breaks
        logger.warning("dashboard state() failed: %s", exc)
        return {"health": {"status": "error", "error": str(exc)}, "config": {}}


def _stats(views: list[tuple[str, GatewayMetrics]]) -> list[tuple[str, EngineStats]]:
    return [(name, m.last_stats) for name, m in views if m.last_stats is not None]


def dashboard_snapshot(metrics: GatewayMetrics, state: Callable[[], dict[str, Any]],
                       now: float | None = None, engines: EngineViews | None = None) -> dict[str, Any]:
    """Everything the page shows at one instant, as plain JSON-able values.

    ``metrics`` is the gateway's own (requests, refusals, events); ``engines`` lists every
    engine's metrics view (default: ``metrics`` is the only engine)."""
    now = time.time() if now is None else now
    views = _views(metrics, engines)
    stats = _stats(views)
    extra = _state(state)
    first = stats[0][1] if stats else None
    config = _config_rows(dict(first.config) if first else {}, extra.get("config") or {})
    window = metrics.window.summary(now)  # the requests this gateway saw...
    window.update(engine_rates([m.window for _, m in views], now))  # ...and what every engine computed
    fresh = [(e, st) for e, st in stats if now - st.time <= STALE_AFTER_S] or stats
    return {
        "time": now,
        "model": metrics.model_name,
        "engine": _engine(stats, now),
        "window": window,
        "running": _rows([(e, st.running) for e, st in fresh]),
        "waiting": _rows([(e, st.waiting) for e, st in fresh]),
        "processes": _processes(stats, metrics),
        "health": health_components(extra.get("health") or {}, first),
        "config": config,
        "events": [{"time": t, "text": text} for t, text in reversed(metrics.events)],
        # every engine behind this gateway (data parallel): running, waiting, KV, where requests went
        "engines": list((extra.get("health") or {}).get("engines") or []),
    }


def history_points(metrics: GatewayMetrics, now: float | None = None,
                   engines: EngineViews | None = None) -> list[dict[str, Any]]:
    """The chart's back-fill: at most one point per second, oldest first, every engine added up
    (an engine without a sample in a second counts with its last one, until that is stale)."""
    now = time.time() if now is None else now
    views = _views(metrics, engines)
    per_engine: list[dict[int, EngineSample]] = []
    weights: list[int] = []  # KV blocks of each engine: usage is used blocks over all blocks
    for _, m in views:
        per_engine.append({int(s.time): s for s in m.window.history() if s.time <= now})
        weights.append(m.last_stats.num_kv_blocks_total if m.last_stats and m.last_stats.num_kv_blocks_total else 1)
    points = []
    last: list[EngineSample | None] = [None] * len(views)
    for second in sorted(set().union(*per_engine)):
        for i, by_second in enumerate(per_engine):
            last[i] = by_second.get(second, last[i])
        newest = max(by_second[second].time for by_second in per_engine if second in by_second)
        live = [(w, s) for w, s in zip(weights, last, strict=True)
                if s is not None and newest - s.time <= STALE_AFTER_S]
        points.append({"time": newest, "num_running": sum(s.num_running for _, s in live),
                       "num_waiting": sum(s.num_waiting for _, s in live),
                       "kv_usage": sum(w * s.kv_usage for w, s in live) / sum(w for w, _ in live)})
    return points


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


def make_dashboard_router(metrics: GatewayMetrics, state: Callable[[], dict[str, Any]],
                          interval_s: float = 1.0, engines: EngineViews | None = None) -> APIRouter:
    """Routes for the page, its static files, one-shot data and the SSE stream; ``engines``:
    every engine's metrics view (the engine pool's), else ``metrics`` is the one engine."""
    router = APIRouter(tags=["dashboard"])
    metrics.set_component_source(lambda: [
        (row["name"], bool(row["up"]))
        for row in health_components(_state(state).get("health") or {}, metrics.last_stats)
        if row["up"] is not None
    ])

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html",
                            headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise HTTPException(status_code=404, detail="no such file")
        path, media_type = STATIC_FILES[name]
        return FileResponse(STATIC_DIR / path, media_type=media_type)

    @router.get("/dashboard/data")
    async def data() -> JSONResponse:
        return JSONResponse(json.loads(json.dumps(dashboard_snapshot(metrics, state, engines=engines), default=str)))

    @router.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            yield f"retry: {int(interval_s * 1000)}\n\n".encode()
            yield _sse("history", {"interval_s": interval_s, "points": history_points(metrics, engines=engines)})
            while not await request.is_disconnected():
                yield _sse("snapshot", dashboard_snapshot(metrics, state, engines=engines))
                await asyncio.sleep(interval_s)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router

"""The live ops dashboard: ``/dashboard`` (page), its static files, and its data stream.

The page is static HTML + JS (``static/dashboard.*``) that charts with the vendored
uPlot library (``static/vendor/uplot``, no CDN). Data is pushed by the server over
Server-Sent Events (``/dashboard/events``): one ``history`` event with the last
minutes of engine samples when the page connects, then a ``snapshot`` event every
``interval_s`` with the current numbers. ``/dashboard/data`` returns one snapshot
as JSON for scripts and tests.

Every number on the page comes from the same ``GatewayMetrics`` object that
renders ``/metrics``, so the two agree (the dashboard lags by at most one push).
The router adds no authentication; the gateway app decides who may see it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from services.gateway.metrics import GATEWAY_PROCESS, GatewayMetrics
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


def _rows(summaries: list[RequestSummary]) -> list[dict[str, Any]]:
    return [
        {"req_id": s.req_id, "priority": s.priority, "num_prompt_tokens": s.num_prompt_tokens,
         "num_output_tokens": s.num_output_tokens, "num_computed_tokens": s.num_computed_tokens,
         "age_s": round(s.age_s, 3)}
        for s in summaries[:MAX_TABLE_ROWS]
    ]


def _processes(stats: EngineStats | None, metrics: GatewayMetrics) -> list[dict[str, Any]]:
    """Resident / peak memory per ferry process: the gateway's own plus what the scheduler sent."""
    rss: dict[str, int] = dict(stats.process_rss_bytes) if stats else {}
    peak: dict[str, int] = dict(stats.process_peak_rss_bytes) if stats else {}
    device: dict[str, int] = dict(stats.device_memory_peak_bytes) if stats else {}
    own = metrics.own_memory()
    rss[GATEWAY_PROCESS], peak[GATEWAY_PROCESS] = own
    for name, value in rss.items():  # a peak sampled a moment earlier can read below the current RSS
        peak[name] = max(peak.get(name, 0), value)
    names = [GATEWAY_PROCESS] + sorted(n for n in rss if n != GATEWAY_PROCESS)
    return [{"name": n, "rss_bytes": rss.get(n), "peak_rss_bytes": peak.get(n),
             "device_memory_peak_bytes": device.get(n)} for n in names]


def _engine(stats: EngineStats | None, now: float) -> dict[str, Any]:
    if stats is None:
        return {"available": False, "stale": True, "num_running": None, "num_waiting": None}
    hit_rate = (stats.prefix_cache_hits_total / stats.prefix_cache_queries_total
                if stats.prefix_cache_queries_total else None)
    age = max(0.0, now - stats.time)
    return {
        "available": True, "stats_time": stats.time, "stats_age_s": round(age, 3),
        "stale": age > STALE_AFTER_S,
        "num_running": stats.num_running, "num_waiting": stats.num_waiting,
        "kv_usage": stats.kv_usage, "num_kv_blocks_total": stats.num_kv_blocks_total,
        "num_kv_blocks_free": stats.num_kv_blocks_free,
        "num_preemptions_total": stats.num_preemptions_total,
        "worker_restarts_total": stats.worker_restarts_total,
        "prefix_cache_hit_rate": hit_rate, "drain_rate_rps": stats.drain_rate_rps,
        "steps_total": stats.steps_total, "workers_ready": list(stats.workers_ready),
        "running_by_priority": {str(k): v for k, v in sorted(stats.num_running_by_priority.items())},
        "waiting_by_priority": {str(k): v for k, v in sorted(stats.num_waiting_by_priority.items())},
    }


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


def dashboard_snapshot(metrics: GatewayMetrics, state: Callable[[], dict[str, Any]],
                       now: float | None = None) -> dict[str, Any]:
    """Everything the page shows at one instant, as plain JSON-able values."""
    now = time.time() if now is None else now
    stats = metrics.last_stats
    extra = _state(state)
    config = _config_rows(dict(stats.config) if stats else {}, extra.get("config") or {})
    return {
        "time": now,
        "model": metrics.model_name,
        "engine": _engine(stats, now),
        "window": metrics.window.summary(now),
        "running": _rows(stats.running) if stats else [],
        "waiting": _rows(stats.waiting) if stats else [],
        "processes": _processes(stats, metrics),
        "health": health_components(extra.get("health") or {}, stats),
        "config": config,
        "events": [{"time": t, "text": text} for t, text in reversed(metrics.events)],
        # every engine behind this gateway (data parallel): running, waiting, KV, where requests went
        "engines": list((extra.get("health") or {}).get("engines") or []),
    }


def history_points(metrics: GatewayMetrics, now: float | None = None) -> list[dict[str, Any]]:
    """The chart's back-fill: at most one engine sample per second, oldest first."""
    now = time.time() if now is None else now
    by_second: dict[int, dict[str, Any]] = {}
    for s in metrics.window.history():
        if s.time <= now:
            by_second[int(s.time)] = {"time": s.time, "num_running": s.num_running,
                                      "num_waiting": s.num_waiting, "kv_usage": s.kv_usage}
    return [by_second[k] for k in sorted(by_second)]


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, default=str)}\n\n".encode()


def make_dashboard_router(metrics: GatewayMetrics, state: Callable[[], dict[str, Any]],
                          interval_s: float = 1.0) -> APIRouter:
    """Routes for the page, its static files, one-shot data and the SSE stream."""
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
        return JSONResponse(json.loads(json.dumps(dashboard_snapshot(metrics, state), default=str)))

    @router.get("/dashboard/events", include_in_schema=False)
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            yield f"retry: {int(interval_s * 1000)}\n\n".encode()
            yield _sse("history", {"interval_s": interval_s, "points": history_points(metrics)})
            while not await request.is_disconnected():
                yield _sse("snapshot", dashboard_snapshot(metrics, state))
                await asyncio.sleep(interval_s)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router

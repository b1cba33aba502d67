"""The dashboard router: snapshot values agree with /metrics, static whitelist, the SSE stream."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.gateway.observability.dashboard import dashboard_snapshot, history_points, make_dashboard_router
from services.gateway.observability.metrics import GatewayMetrics
from shared.messages import EngineStats, RequestSummary
from tests.browser.helpers import serve_in_thread

HEALTH: dict[str, Any] = {
    "status": "ok", "ready": True, "reason": "", "gateway_id": "gw-1",
    "scheduler": {"endpoint": "ipc:///x", "connected": True, "ready": True, "reason": "", "num_workers": 2,
                  "workers_ready": [1]},
    "redis": {"redis": "degraded", "detail": "connection refused", "auth": "static"},
}


def state() -> dict[str, Any]:
    return {"health": HEALTH, "config": {"max_num_seqs": 4}}


def stats(t: float, running: int, waiting: int) -> EngineStats:
    return EngineStats(time=t, num_running=running, num_waiting=waiting, num_kv_blocks_total=64,
                       num_kv_blocks_free=16, kv_usage=0.75, config={"block_size": "16"},
                       running=[RequestSummary("a", 0, 10, 2, 12, 1.5)],
                       waiting=[RequestSummary("b", 1, 20, 0, 0, 0.2)],
                       process_rss_bytes={"scheduler": 1 << 20})


def test_snapshot_mirrors_latest_stats_and_state() -> None:
    m = GatewayMetrics("m")
    now = time.time()
    m.on_engine_stats(stats(now, running=3, waiting=9))
    snap = dashboard_snapshot(m, state, now=now + 1)
    nested = dashboard_snapshot(m, lambda: {"config": {"gateway": {"port": 8000}, "scheduler": {"x": 1}}})
    assert nested["config"] == [("scheduler.block_size", "16"), ("scheduler.x", 1), ("gateway.port", 8000)]
    assert snap["engine"]["num_running"] == 3 and snap["engine"]["num_waiting"] == 9
    assert snap["engine"]["stale"] is False
    assert snap["running"][0]["req_id"] == "a" and snap["waiting"][0]["priority"] == 1
    assert snap["config"] == [("scheduler.block_size", "16"), ("max_num_seqs", 4)]
    rows = {r["name"]: (r["status"], r["up"]) for r in snap["health"]}
    assert rows == {"gateway": ("ok", True), "scheduler": ("ready", True), "worker 0": ("down", False),
                    "worker 1": ("ready", True), "redis": ("degraded", False)}
    assert [p["name"] for p in snap["processes"]] == ["gateway", "scheduler"]
    assert dashboard_snapshot(m, state, now=now + 60)["engine"]["stale"] is True


def test_snapshot_without_stats_and_with_a_broken_state() -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("redis probe exploded")

    snap = dashboard_snapshot(GatewayMetrics("m"), broken)
    assert snap["engine"]["available"] is False and snap["engine"]["num_running"] is None
    (gateway,) = snap["health"]
    assert gateway["name"] == "gateway" and gateway["status"] == "error" and "exploded" in gateway["detail"]


def test_history_keeps_one_point_per_second() -> None:
    m = GatewayMetrics("m")
    for i in range(12):  # four samples a second for three seconds
        m.on_engine_stats(stats(1000.0 + i * 0.25, running=i, waiting=0))
    points = history_points(m, now=1010.0)
    assert [p["num_running"] for p in points] == [3, 7, 11]


def test_routes_serve_page_data_and_only_whitelisted_files() -> None:
    m = GatewayMetrics("m")
    m.on_engine_stats(stats(time.time(), running=2, waiting=1))
    app = FastAPI()
    app.include_router(make_dashboard_router(m, state))
    client = TestClient(app)
    page = client.get("/dashboard")
    assert page.status_code == 200 and 'id="running-count"' in page.text
    assert "http" not in page.text.split("<body>")[0]  # no CDN links in the head
    js = client.get("/dashboard/static/uPlot.iife.min.js")
    assert js.status_code == 200 and "uPlot" in js.text
    assert client.get("/dashboard/static/..%2Fdashboard.py").status_code == 404
    assert client.get("/dashboard/static/README.md").status_code == 404
    data = client.get("/dashboard/data").json()
    assert data["engine"]["num_running"] == 2


def test_event_stream_sends_history_then_snapshots() -> None:
    m = GatewayMetrics("m")
    m.on_engine_stats(stats(time.time() - 1, running=5, waiting=4))
    app = FastAPI()
    app.include_router(make_dashboard_router(m, state, interval_s=0.1))
    events: list[tuple[str, dict[str, Any]]] = []
    with serve_in_thread(app) as base, httpx.stream("GET", f"{base}/dashboard/events", timeout=10) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        event = ""
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, json.loads(line[6:])))
                if len(events) == 3:
                    break
    assert events[0][0] == "history" and events[0][1]["points"][0]["num_running"] == 5
    assert [e for e, _ in events[1:]] == ["snapshot", "snapshot"]
    assert events[2][1]["engine"]["num_waiting"] == 4
    assert events[2][1]["time"] > events[1][1]["time"]


def test_component_up_and_config_info_series_at_scrape_time() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    m = GatewayMetrics("m")
    m.on_engine_stats(stats(time.time(), running=1, waiting=0))
    make_dashboard_router(m, state)
    body, _ = m.render()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
    base = (("engine", "0"), ("model_name", "m"))

    def up(name: str) -> float:
        return got[("ferry:component_up", tuple(sorted((*base, ("component", name)))))]
    assert (up("gateway"), up("scheduler"), up("worker 0"), up("worker 1"), up("redis")) == (1, 1, 0, 1, 0)
    assert got[("ferry:engine_config_info", tuple(sorted((*base, ("knob", "block_size"), ("value", "16")))))] == 1


def test_disabled_redis_is_neither_up_nor_down() -> None:
    from services.gateway.observability.dashboard import health_components

    rows = health_components({"status": "ok", "redis": {"redis": "disabled"}}, None)
    assert rows[-1] == {"name": "redis", "status": "disabled", "up": None, "detail": ""}


def two_engines() -> tuple[GatewayMetrics, GatewayMetrics, Any]:
    """The gateway's metrics (engine "0") and engine "1"'s view, as the engine pool makes them."""
    from services.gateway.engines.engine_pool import engine_metrics

    base = GatewayMetrics("m")
    other = engine_metrics(base, "1")
    return base, other, lambda: [("0", base), ("1", other)]


def engine_stats(t: float, running: list[str], waiting: list[str], free: int, total: int = 64,
                 generated: int = 0) -> EngineStats:
    return EngineStats(time=t, num_running=len(running), num_waiting=len(waiting), num_kv_blocks_total=total,
                       num_kv_blocks_free=free, kv_usage=(total - free) / total, generation_tokens_total=generated,
                       running=[RequestSummary(r, 0, 10, 2, 12, 1.0) for r in running],
                       waiting=[RequestSummary(w, 0, 10, 0, 0, 0.5) for w in waiting],
                       process_rss_bytes={"scheduler": 1 << 20, "worker0": 2 << 20},
                       num_running_by_priority={0: len(running)})


def test_snapshot_adds_up_every_engine_and_lists_every_engines_requests() -> None:
    base, other, engines = two_engines()
    now = 1000.0
    base.on_engine_stats(engine_stats(now - 10, ["a"], [], free=60, generated=0))
    base.on_engine_stats(engine_stats(now, ["a"], [], free=60, generated=100))  # 10 tok/s
    other.on_engine_stats(engine_stats(now - 10, ["b", "c"], ["d"], free=32, total=128, generated=0))
    other.on_engine_stats(engine_stats(now, ["b", "c"], ["d"], free=32, total=128, generated=300))  # 30 tok/s
    snap = dashboard_snapshot(base, state, now=now + 1, engines=engines)
    e = snap["engine"]
    assert (e["num_running"], e["num_waiting"], e["num_engines"], e["engines_reporting"]) == (3, 1, 2, 2)
    assert (e["num_kv_blocks_total"], e["num_kv_blocks_free"]) == (192, 92)
    assert e["kv_usage"] == 100 / 192  # used blocks over all blocks, not the mean of the two usages
    assert e["running_by_priority"] == {"0": 3} and e["stale"] is False
    assert snap["window"]["generation_tokens_per_s"] == 40.0
    assert [(r["engine"], r["req_id"]) for r in snap["running"]] == [("0", "a"), ("1", "b"), ("1", "c")]
    assert [(r["engine"], r["req_id"]) for r in snap["waiting"]] == [("1", "d")]
    assert [p["name"] for p in snap["processes"]] == [
        "gateway", "engine0/scheduler", "engine0/worker0", "engine1/scheduler", "engine1/worker0"]
    # the one-engine default keeps the plain names and its own numbers
    alone = dashboard_snapshot(base, state, now=now + 1)
    assert alone["engine"]["num_running"] == 1 and [r["engine"] for r in alone["running"]] == ["0"]
    assert alone["window"]["generation_tokens_per_s"] == 10.0


def test_a_stale_engine_leaves_the_sums_and_the_tables() -> None:
    base, other, engines = two_engines()
    base.on_engine_stats(engine_stats(1000.0, ["a"], ["x"], free=60))
    other.on_engine_stats(engine_stats(1020.0, ["b"], [], free=32))
    snap = dashboard_snapshot(base, state, now=1021.0, engines=engines)
    assert (snap["engine"]["num_running"], snap["engine"]["num_waiting"]) == (1, 0)
    assert (snap["engine"]["engines_reporting"], snap["engine"]["stale"]) == (1, False)
    assert [r["req_id"] for r in snap["running"]] == ["b"] and snap["waiting"] == []
    both_stale = dashboard_snapshot(base, state, now=1100.0, engines=engines)["engine"]
    assert both_stale["stale"] is True and both_stale["num_running"] == 2  # the last numbers, marked stale


def test_history_adds_up_the_engines_second_by_second() -> None:
    base, other, engines = two_engines()
    for i in range(3):
        base.on_engine_stats(engine_stats(1000.0 + i, ["a"] * (i + 1), [], free=32))
    other.on_engine_stats(engine_stats(1000.5, ["b", "c"], ["d"], free=0))  # one sample, then silent
    points = history_points(base, now=1010.0, engines=engines)
    assert [(p["num_running"], p["num_waiting"]) for p in points] == [(3, 1), (4, 1), (5, 1)]
    assert points[0]["kv_usage"] == (32 + 64) / 128
    assert [p["num_running"] for p in history_points(base, now=1010.0)] == [1, 2, 3]


def test_table_rows_interleave_engines_up_to_the_cap() -> None:
    from services.gateway.observability.dashboard import MAX_TABLE_ROWS

    base, other, engines = two_engines()
    base.on_engine_stats(engine_stats(1000.0, [f"a{i}" for i in range(40)], [], free=0))
    other.on_engine_stats(engine_stats(1000.0, [f"b{i}" for i in range(40)], [], free=0))
    rows = dashboard_snapshot(base, state, now=1000.5, engines=engines)["running"]
    assert len(rows) == MAX_TABLE_ROWS
    assert [r["req_id"] for r in rows[:4]] == ["a0", "b0", "a1", "b1"]
    assert sum(r["engine"] == "1" for r in rows) == MAX_TABLE_ROWS // 2

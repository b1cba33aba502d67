"""The provisioned Grafana dashboard queries only metrics the gateway really exposes.

Every PromQL expression in deploy/grafana/dashboards/ferry.json is reduced to the
metric names it reads; each must appear in the exposition of a GatewayMetrics that
has seen engine stats, a finished request, a rejection and a health view. The
provisioning files and the Prometheus scrape config are checked to meet each other.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.observability.dashboard import make_dashboard_router
from services.gateway.observability.metrics import GatewayMetrics, RequestRecord
from shared.messages import EngineStats, RequestSummary, RequestTimings

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "ferry.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"

FUNCTIONS = {"histogram_quantile", "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "time",
             "label_values", "clamp_min", "clamp_max", "abs", "delta", "deriv", "topk"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
            "unless"}


def exposed_names() -> set[str]:
    m = GatewayMetrics("m")
    now = time.time()
    m.on_engine_stats(EngineStats(
        time=now, num_running=2, num_waiting=1, num_kv_blocks_total=10, num_kv_blocks_free=5, kv_usage=0.5,
        num_preemptions_total=1, prefix_cache_queries_total=8, prefix_cache_hits_total=4, prompt_tokens_total=8,
        generation_tokens_total=3, steps_total=4, worker_restarts_total=1, num_running_by_priority={0: 2},
        num_waiting_by_priority={1: 1}, step_num_tokens=[8], step_num_seqs=[2], step_duration_s=[0.01],
        running=[RequestSummary("a", 0, 4, 1, 5, 0.1)], config={"max_num_seqs": "2"},
        process_rss_bytes={"scheduler": 1, "worker0": 2}, process_peak_rss_bytes={"scheduler": 1, "worker0": 2},
        device_memory_peak_bytes={"worker0": 3}, workers_ready=[0],
    ))
    m.on_request_finished(RequestRecord(
        "r", 0, "stop", 4, 2, 0, now - 1, now - 0.5, now, [now - 0.5, now],
        RequestTimings(arrival_time=now - 1, first_scheduled_time=now - 0.9, first_token_time=now - 0.5,
                       finished_time=now), max_tokens=2))
    m.on_rejected("queue_full", 429)
    make_dashboard_router(m, lambda: {"health": {"status": "ok", "scheduler": {"ready": True, "num_workers": 1,
                                                                               "workers_ready": [0]}}})
    body, _ = m.render()
    return {s.name for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def all_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in all_panels(dashboard["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads; fails on identifiers it cannot place."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping label lists
    text = re.sub(r"label_values\(([^,()]+),[^)]*\)", r"label_values(\1)", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        token = match.group(0)
        after = text[match.end():].lstrip()
        if after.startswith("("):
            assert token in FUNCTIONS, f"unknown function {token} in {expr}"
        elif token in KEYWORDS:
            continue
        else:
            assert ":" in token, f"{token!r} in {expr!r} is not a ferry metric"
            names.add(token)
    return names


def test_metric_name_extraction() -> None:
    expr = ('histogram_quantile(0.95, sum by (le) (rate(ferry:a_bucket{model_name=~"$m"}[$__rate_interval])))'
            ' / max(ferry:b{x="y"}) - time()')
    assert metric_names(expr) == {"ferry:a_bucket", "ferry:b"}


def test_every_queried_metric_is_exposed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exposed = exposed_names()
    queried = set().union(*(metric_names(e) for e in expressions(dashboard)))
    assert queried, "the dashboard queries nothing"
    missing = sorted(queried - exposed)
    assert not missing, f"Grafana queries metrics the gateway does not expose: {missing}"
    # The dashboard covers what the live page shows.
    for needed in ("ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc",
                   "ferry:time_to_first_token_seconds_bucket", "ferry:request_queue_time_seconds_bucket",
                   "ferry:num_preemptions_total", "ferry:request_rejected_total", "ferry:generation_tokens_total",
                   "ferry:request_success_total", "ferry:component_up", "ferry:engine_config_info",
                   "ferry:process_resident_memory_bytes"):
        assert needed in queried, needed


def test_dashboard_structure() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = all_panels(dashboard["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]


def test_provisioning_and_scrape_config_meet() -> None:
    datasource = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    dashboard = json.loads(DASHBOARD.read_text())
    ds_var = next(v for v in dashboard["templating"]["list"] if v["name"] == "datasource")
    assert ds_var["current"]["value"] == datasource["uid"]
    assert datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "ferry.yml").read_text())["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    assert scrape["static_configs"][0]["targets"] == ["gateway:8000"]


def test_committed_json_is_the_builder_output() -> None:
    import subprocess
    import sys

    built = subprocess.run([sys.executable, str(ROOT / "deploy" / "grafana" / "build_dashboard.py")],
                           capture_output=True, text=True, check=True).stdout
    assert json.loads(built) == json.loads(DASHBOARD.read_text()), (
        "run: python deploy/grafana/build_dashboard.py > deploy/grafana/dashboards/ferry.json")

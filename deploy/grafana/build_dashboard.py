"""Build deploy/grafana/dashboards/ferry.json, the provisioned Grafana dashboard.

    python deploy/grafana/build_dashboard.py > deploy/grafana/dashboards/ferry.json

The panels mirror the gateway's live /dashboard page. Engine-level series (the same
values reported by every gateway of one engine) are aggregated with max(); request
histograms, which each gateway observes for its own requests, with sum().
tests/unit/deploy/test_grafana_dashboard.py checks that the committed JSON equals this
script's output and that every metric it queries is one the gateway exposes.
"""

from __future__ import annotations

import json

DS = {"type": "prometheus", "uid": "${datasource}"}
M = 'model_name=~"$model_name"'
panels = []
pid = [0]
y = [0]


def nid():
    pid[0] += 1
    return pid[0]


def row(title):
    panels.append({"type": "row", "title": title, "collapsed": False, "id": nid(),
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y[0]}, "panels": []})
    y[0] += 1


def target(expr, legend, ref, instant=False, fmt=None):
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": not instant,
         "instant": instant, "editorMode": "code"}
    if fmt:
        t["format"] = fmt
    return t


def panel(kind, title, desc, targets, x, w, h, unit="short", extra=None):
    p = {"type": kind, "title": title, "description": desc, "datasource": DS, "id": nid(),
         "gridPos": {"h": h, "w": w, "x": x, "y": y[0]},
         "targets": [target(e, legend, chr(65 + i)) for i, (e, legend) in enumerate(targets)],
         "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}, "options": {}}
    if kind == "timeseries":
        p["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 2, "fillOpacity": 10,
                                                  "showPoints": "never", "spanNulls": True}
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}}
    if kind == "stat":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    if extra:
        p.update(extra)
    panels.append(p)
    return p


def q(quant, metric, by="le"):
    return f'histogram_quantile({quant}, sum by ({by}) (rate({metric}_bucket{{{M}}}[$__rate_interval])))'


# --- now ---------------------------------------------------------------------
row("Now")
stats = [
    ("Running", f'max(ferry:num_requests_running{{{M}}})', "short", "Requests in the running set (the engine's batch)."),
    ("Waiting", f'max(ferry:num_requests_waiting{{{M}}})', "short", "Requests in the waiting queue."),
    ("KV usage", f'max(ferry:kv_cache_usage_perc{{{M}}})', "percentunit", "In-use KV blocks / total."),
    ("Requests/s", f'sum(rate(ferry:request_success_total{{{M}}}[1m]))', "reqps", "Finished requests per second (all gateways)."),
    ("Gen tokens/s", f'max(rate(ferry:generation_tokens_total{{{M}}}[1m]))', "short", "Generated tokens per second (engine)."),
    ("TTFT p95", q(0.95, "ferry:time_to_first_token_seconds").replace("$__rate_interval", "1m"), "s", "95th percentile time to first token, last minute."),
    ("Queue p95", q(0.95, "ferry:request_queue_time_seconds").replace("$__rate_interval", "1m"), "s", "95th percentile time in the waiting queue, last minute."),
    ("Preemptions/s", f'max(rate(ferry:num_preemptions_total{{{M}}}[1m]))', "short", "Running requests evicted for KV space per second."),
    ("Rejections/s", f'sum(rate(ferry:request_rejected_total{{{M}}}[1m]))', "short", "Requests refused by the gateways per second (429, 503, 4xx)."),
]
w = [3, 3, 3, 3, 3, 3, 2, 2, 2]
x = 0
for (title, expr, unit, desc), width in zip(stats, w, strict=True):
    panel("stat", title, desc, [(expr, title)], x, width, 4, unit)
    x += width
y[0] += 4

# --- queues --------------------------------------------------------------------
row("Scheduling and KV cache")
panel("timeseries", "Running and waiting", "The running set and the waiting queue, as the scheduler reports them.",
      [(f'max(ferry:num_requests_running{{{M}}})', "running"), (f'max(ferry:num_requests_waiting{{{M}}})', "waiting")],
      0, 8, 8)
panel("timeseries", "Running and waiting by priority", "Lower priority value runs first.",
      [(f'max by (priority) (ferry:num_requests_running_by_priority{{{M}}})', "running p{{priority}}"),
       (f'max by (priority) (ferry:num_requests_waiting_by_priority{{{M}}})', "waiting p{{priority}}")],
      8, 8, 8)
panel("timeseries", "KV cache usage", "Fraction of KV blocks in use; near 1 means admissions stall and preemptions start.",
      [(f'max(ferry:kv_cache_usage_perc{{{M}}})', "in use"),
       (f'max(rate(ferry:prefix_cache_hits_total{{{M}}}[$__rate_interval])) / max(rate(ferry:prefix_cache_queries_total{{{M}}}[$__rate_interval]))', "prefix cache hit rate")],
      16, 8, 8, "percentunit")
y[0] += 8
panel("timeseries", "Preemptions and rejections", "Preemptions (engine) and refusals by reason (gateways), per second.",
      [(f'max(rate(ferry:num_preemptions_total{{{M}}}[$__rate_interval]))', "preemptions"),
       (f'sum by (reason) (rate(ferry:request_rejected_total{{{M}}}[$__rate_interval]))', "rejected: {{reason}}")],
      0, 8, 8)
panel("timeseries", "Tokens and sequences per step", "How full each scheduling step is.",
      [(q(0.5, "ferry:iteration_tokens_total"), "tokens p50"), (q(0.95, "ferry:iteration_tokens_total"), "tokens p95"),
       (q(0.5, "ferry:iteration_num_seqs"), "seqs p50"), (q(0.95, "ferry:iteration_num_seqs"), "seqs p95")],
      8, 8, 8)
panel("timeseries", "Step duration", "Wall time of one engine step.",
      [(q(0.5, "ferry:iteration_duration_seconds"), "p50"), (q(0.95, "ferry:iteration_duration_seconds"), "p95"),
       (f'max(rate(ferry:engine_steps_total{{{M}}}[$__rate_interval]))', "steps/s")],
      16, 8, 8, "s")
y[0] += 8

# --- latency -------------------------------------------------------------------
row("Latency")
for i, (title, metric, desc) in enumerate([
    ("Time to first token", "ferry:time_to_first_token_seconds", "Arrival at the gateway to the first token sent."),
    ("Inter-token latency", "ferry:inter_token_latency_seconds", "Time between consecutive token batches of one request."),
    ("End-to-end latency", "ferry:e2e_request_latency_seconds", "Arrival to the last token."),
]):
    panel("timeseries", title, desc,
          [(q(0.5, metric), "p50"), (q(0.95, metric), "p95"), (q(0.99, metric), "p99"),
           (f'sum(rate({metric}_sum{{{M}}}[$__rate_interval])) / sum(rate({metric}_count{{{M}}}[$__rate_interval]))', "mean")],
          8 * i, 8, 8, "s")
y[0] += 8
for i, (title, metric, desc) in enumerate([
    ("Queue time", "ferry:request_queue_time_seconds", "Arrival to first scheduled: time spent waiting for admission."),
    ("Prefill time", "ferry:request_prefill_time_seconds", "First scheduled to first token (chunked prefill included)."),
    ("Decode time", "ferry:request_decode_time_seconds", "First token to finish."),
    ("Delivery lag (client side)", "ferry:request_delivery_lag_seconds",
     "Scheduler finish to the gateway's last byte: detokenization and slow clients."),
]):
    panel("timeseries", title, desc, [(q(0.5, metric), "p50"), (q(0.95, metric), "p95")], 6 * i, 6, 8, "s")
y[0] += 8

# --- traffic -------------------------------------------------------------------
row("Traffic")
panel("timeseries", "Requests by finish reason", "Finished requests per second.",
      [(f'sum by (finished_reason) (rate(ferry:request_success_total{{{M}}}[$__rate_interval]))', "{{finished_reason}}")],
      0, 8, 8, "reqps")
panel("timeseries", "Token throughput", "Prompt tokens prefilled and tokens generated per second (engine).",
      [(f'max(rate(ferry:prompt_tokens_total{{{M}}}[$__rate_interval]))', "prompt"),
       (f'max(rate(ferry:generation_tokens_total{{{M}}}[$__rate_interval]))', "generation"),
       (f'sum(rate(ferry:prompt_tokens_cached_total{{{M}}}[$__rate_interval]))', "prompt from prefix cache")],
      8, 8, 8)
panel("timeseries", "Prompt and output lengths", "Per-request token counts.",
      [(q(0.5, "ferry:request_prompt_tokens"), "prompt p50"), (q(0.95, "ferry:request_prompt_tokens"), "prompt p95"),
       (q(0.5, "ferry:request_generation_tokens"), "output p50"), (q(0.95, "ferry:request_generation_tokens"), "output p95")],
      16, 8, 8)
y[0] += 8

# --- processes -----------------------------------------------------------------
row("Processes")
panel("state-timeline", "Component health", "1 = healthy: gateway, scheduler, each worker, Redis (per gateway).",
      [(f'min by (component) (ferry:component_up{{{M}}})', "{{component}}")], 0, 8, 8, "short",
      {"fieldConfig": {"defaults": {"unit": "short", "min": 0, "max": 1,
                                    "mappings": [{"type": "value", "options": {"0": {"text": "down", "color": "red"},
                                                                              "1": {"text": "up", "color": "green"}}}],
                                    "thresholds": {"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                                                 {"color": "green", "value": 1}]}},
                       "overrides": []}})
panel("timeseries", "Resident memory", "RSS of every ferry process (gateway, scheduler, workerN).",
      [(f'max by (process) (ferry:process_resident_memory_bytes{{{M}}})', "{{process}}"),
       (f'max by (process) (ferry:process_peak_resident_memory_bytes{{{M}}})', "{{process}} peak")],
      8, 8, 8, "bytes")
panel("timeseries", "Device memory peak and restarts", "Peak accelerator memory per worker; worker restarts; seconds since the last engine stats.",
      [(f'max by (process) (ferry:device_memory_peak_bytes{{{M}}})', "{{process}} device peak"),
       (f'max(increase(ferry:worker_restarts_total{{{M}}}[$__range]))', "worker restarts in range"),
       (f'time() - max(ferry:engine_stats_timestamp_seconds{{{M}}})', "stats age (s)")],
      16, 8, 8, "bytes",
      {"fieldConfig": {"defaults": {"unit": "bytes"}, "overrides": [
          {"matcher": {"id": "byRegexp", "options": "worker restarts.*|stats age.*"},
           "properties": [{"id": "unit", "value": "short"}, {"id": "custom.axisPlacement", "value": "right"}]}]}})
y[0] += 8
panel("timeseries", "Step time split",
      "Share of each engine step cycle per phase (ferry:step_phase_seconds): forward and sample are the worker's, "
      "idle is the rest of the cycle in which the worker did not compute; schedule is part of idle unless "
      "--async-scheduling overlaps it with the forward. Right axis: tokens per step.",
      [(f'sum by (phase) (rate(ferry:step_phase_seconds_sum{{{M}}}[1m])) / ignoring(phase) group_left '
        f'sum(rate(ferry:step_phase_seconds_sum{{{M},phase!="schedule"}}[1m]))', "{{phase}}"),
       (f'sum(rate(ferry:iteration_tokens_total_sum{{{M}}}[1m])) / '
        f'sum(rate(ferry:iteration_tokens_total_count{{{M}}}[1m]))', "tokens per step")],
      0, 24, 8, "percentunit",
      {"fieldConfig": {"defaults": {"unit": "percentunit"}, "overrides": [
          {"matcher": {"id": "byName", "options": "tokens per step"},
           "properties": [{"id": "unit", "value": "short"}, {"id": "custom.axisPlacement", "value": "right"}]}]}})
y[0] += 8
cfg = panel("table", "Effective scheduler knobs", "The scheduler's configuration as it runs (ferry:engine_config_info).",
            [], 0, 24, 8)
cfg["targets"] = [target(f'max by (knob, value) (ferry:engine_config_info{{{M}}})', "", "A", instant=True, fmt="table")]
cfg["transformations"] = [{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True},
                                                          "renameByName": {"knob": "knob", "value": "value"}}}]
y[0] += 8

dashboard = {
    "uid": "ferry-overview",
    "title": "ferry",
    "description": "ferry serving: queues, KV cache, latency, throughput, processes (the /dashboard page's panels).",
    "tags": ["ferry", "llm-serving"],
    "timezone": "browser",
    "editable": True,
    "graphTooltip": 1,
    "refresh": "5s",
    "schemaVersion": 39,
    "version": 1,
    "time": {"from": "now-30m", "to": "now"},
    "annotations": {"list": []},
    "links": [],
    "templating": {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {"text": "Prometheus", "value": "ferry-prometheus"}, "hide": 0, "refresh": 1},
        {"name": "model_name", "label": "model", "type": "query", "datasource": DS,
         "definition": "label_values(ferry:num_requests_running, model_name)",
         "query": {"query": "label_values(ferry:num_requests_running, model_name)", "refId": "model_name"},
         "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1, "hide": 0,
         "current": {"text": "All", "value": "$__all"}},
    ]},
    "panels": panels,
}
if __name__ == "__main__":
    print(json.dumps(dashboard, indent=2))

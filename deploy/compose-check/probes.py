"""What the compose check asks of a running stack, over its published ports or through
``podman exec``: a chat completion, a stream (optionally with an action mid-stream),
Prometheus queries, and the Grafana dashboard's panel queries.

Standard library only: the check runs with the host's python3, outside the project venv.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> tuple[int, Any]:
    """(status, parsed JSON body) of a GET, or of a POST when ``body`` is given."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")


def wait_until(what: str, probe: Callable[[], bool], timeout_s: float, every_s: float = 2.0) -> float:
    """Seconds until ``probe()`` was true; TimeoutError naming ``what`` after ``timeout_s``."""
    start = time.monotonic()
    while True:
        try:
            if probe():
                return time.monotonic() - start
        except (OSError, urllib.error.URLError, ValueError):
            pass  # not up yet: connection refused or reset, half-written answer
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f}s")
        time.sleep(every_s)


def chat(base: str, model: str, content: str, max_tokens: int) -> dict[str, Any]:
    """A non-streamed chat completion; raises unless it is a 200 with generated text."""
    status, body = http_json(f"{base}/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0,
    })
    if status != 200:
        raise AssertionError(f"chat completion: HTTP {status}: {body}")
    text = body["choices"][0]["message"]["content"]
    usage = body["usage"]
    if not text or usage["completion_tokens"] < 1:
        raise AssertionError(f"chat completion generated nothing: {body}")
    return {"status": status, "text": text, "finish_reason": body["choices"][0]["finish_reason"],
            "usage": usage}


@dataclass
class Stream:
    """What one streamed completion delivered."""

    chunks: int = 0
    text: str = ""
    finish_reason: str | None = None
    done: bool = False  # the terminating ``data: [DONE]`` arrived
    errors: list[str] = field(default_factory=list)
    longest_gap_s: float = 0.0  # the longest wait between two events (a worker restart shows here)
    seconds: float = 0.0
    usage: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"chunks": self.chunks, "chars": len(self.text), "finish_reason": self.finish_reason,
                "done": self.done, "errors": self.errors, "longest_gap_s": round(self.longest_gap_s, 2),
                "seconds": round(self.seconds, 2), "usage": self.usage}


def stream_completion(base: str, model: str, prompt: str, max_tokens: int, *, ignore_eos: bool = False,
                      at_chunk: int = 0, action: Callable[[], None] | None = None,
                      timeout_s: float = 300.0) -> Stream:
    """A streamed completion read event by event; ``action`` runs once ``at_chunk`` chunks
    have arrived (the stream stays open meanwhile)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    out = Stream()
    start = last = time.monotonic()
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        if resp.status != 200:
            raise AssertionError(f"stream: HTTP {resp.status}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            now = time.monotonic()
            out.longest_gap_s = max(out.longest_gap_s, now - last)
            last = now
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                out.done = True
                break
            event = json.loads(payload)
            if "error" in event:
                out.errors.append(json.dumps(event["error"]))
                continue
            if event.get("usage"):
                out.usage = event["usage"]
            for choice in event.get("choices", []):
                out.text += choice.get("text") or ""
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
                out.chunks += 1
                if action is not None and out.chunks == at_chunk:
                    action()
    out.seconds = time.monotonic() - start
    return out


# --- Prometheus and the Grafana dashboard ------------------------------------------------

PromQuery = Callable[[str, dict[str, str]], dict[str, Any]]
"""(API path, parameters) -> the decoded answer of Prometheus's HTTP API."""

PromQueries = Callable[[list[tuple[str, dict[str, str]]]], list[dict[str, Any]]]
"""Many queries at once (one ``podman exec`` instead of one per query)."""


def prom_value(query: PromQuery, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector; raises on an API error."""
    answer = query("/api/v1/query", {"query": expr})
    if answer.get("status") != "success":
        raise AssertionError(f"prometheus: {expr}: {answer}")
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


# What Grafana substitutes before it sends a panel's query: the dashboard's variables
# (every model: the "All" value) and the built-in intervals of a last-15-minutes view.
GRAFANA_VARIABLES = {
    "$model_name": ".*", "${model_name}": ".*",
    "$__rate_interval": "1m", "$__interval": "15s", "$__range": "15m",
}


def grafana_expr(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    if re.search(r"\$\{?\w+", expr):
        raise ValueError(f"unresolved dashboard variable in {expr!r}")
    return expr


def dashboard_queries(path: Path, query_many: PromQueries, window_s: int) -> dict[str, Any]:
    """Every panel's every query of the provisioned dashboard as a range query over the
    last ``window_s`` seconds, exactly as Grafana's Prometheus data source would send it."""
    dashboard = json.loads(path.read_text())
    end = time.time()
    wanted = [(panel, target) for panel in dashboard["panels"] for target in panel.get("targets", [])]
    answers = query_many([("/api/v1/query_range", {"query": grafana_expr(t["expr"]), "start": f"{end - window_s:.0f}",
                                                   "end": f"{end:.0f}", "step": "5"}) for _, t in wanted])
    by_panel: dict[int, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for (panel, target), answer in zip(wanted, answers, strict=True):
        by_panel.setdefault(id(panel), []).append((target, answer))
    panels = []
    for panel in dashboard["panels"]:
        targets = []
        for target, answer in by_panel.get(id(panel), []):
            ok = answer.get("status") == "success"
            series = answer["data"]["result"] if ok else []
            values = [v for s in series for _, v in s["values"]]
            nonzero = sum(v not in ("0", "NaN", "+Inf", "-Inf") for v in values)
            targets.append({"expr": target["expr"], "ok": ok, "series": len(series), "points": len(values),
                            "nonzero": nonzero, "error": None if ok else answer.get("error")})
        if targets:
            panels.append({"title": panel.get("title"), "type": panel.get("type"), "targets": targets})
    all_targets = [t for p in panels for t in p["targets"]]
    return {
        "uid": dashboard.get("uid"), "title": dashboard.get("title"), "panels": len(panels),
        "queries": len(all_targets),
        "queries_ok": sum(t["ok"] for t in all_targets),
        "panels_with_data": sum(any(t["points"] for t in p["targets"]) for p in panels),
        "panels_without_data": [p["title"] for p in panels if not any(t["points"] for t in p["targets"])],
        # A gauge at 0 is data too; these panels showed the requests actually served.
        "panels_with_nonzero": [p["title"] for p in panels if any(t["nonzero"] for t in p["targets"])],
        "detail": panels,
    }

"""Shared pieces of the dashboard browser tests: Debian's Chromium via Playwright, /metrics polling.

Playwright drives the system Chromium (``/usr/bin/chromium``, installed by
``make browser``); ``playwright install`` is never used, so no browser download
happens. Every network request the page makes is recorded so a test can assert
that nothing left 127.0.0.1 (no CDN).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def require_chromium() -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make browser` (apt-get install -y chromium)")


@dataclass
class PageLog:
    urls: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@contextmanager
def open_dashboard(base_url: str, width: int = 1400, height: int = 1100) -> Iterator[tuple[Any, PageLog]]:
    """A Playwright page on ``{base_url}/dashboard`` in headless Debian Chromium."""
    require_chromium()
    from playwright.sync_api import sync_playwright

    log = PageLog()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.on("request", lambda req: log.urls.append(req.url))
            page.on("pageerror", lambda exc: log.errors.append(str(exc)))
            page.on("console", lambda msg: log.errors.append(msg.text) if msg.type == "error" else None)
            page.goto(f"{base_url}/dashboard", wait_until="load")
            page.wait_for_function("document.getElementById('conn-status').textContent === 'live'",
                                   timeout=15000)
            yield page, log
        finally:
            browser.close()


def metric_value(base_url: str, name: str) -> float:
    """One sample of ``name`` from ``/metrics`` (summed over label sets)."""
    body = httpx.get(f"{base_url}/metrics", timeout=5.0).text
    total, found = 0.0, False
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name == name:
                total, found = total + sample.value, True
    if not found:
        raise KeyError(name)
    return total


def page_int(page: Any, element_id: str) -> int | None:
    text = page.text_content(f"#{element_id}")
    return int(text) if text and text.strip().isdigit() else None


def check_page_tracks_metrics(page: Any, base_url: str, duration_s: float, refresh_s: float) -> tuple[int, int]:
    """Sample the page's running/waiting numbers and /metrics side by side.

    Each page reading must equal a /metrics reading taken within one refresh
    (plus a little slack for the two clocks' sampling) of it. Returns how many
    page readings were compared and how many distinct (running, waiting) pairs
    the page showed.
    """
    readings: list[tuple[float, str, float]] = []  # (time, source:metric, value)
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        now = time.monotonic()
        for metric, element in (("running", "running-count"), ("waiting", "waiting-count")):
            readings.append((now, f"metrics:{metric}", metric_value(base_url, f"ferry:num_requests_{metric}")))
            value = page_int(page, element)
            if value is not None:
                readings.append((now, f"page:{metric}", float(value)))
        time.sleep(0.1)
    tolerance = refresh_s + 0.5
    compared = 0
    shown: set[tuple[float, ...]] = set()
    for t, source, value in readings:
        if not source.startswith("page:"):
            continue
        metric = source.split(":", 1)[1]
        nearby = {v for (t2, s2, v) in readings if s2 == f"metrics:{metric}" and abs(t2 - t) <= tolerance}
        assert value in nearby, f"page {metric}={value} not among /metrics values {sorted(nearby)} within {tolerance}s"
        compared += 1
    page_times = sorted({t for t, s, _ in readings if s.startswith("page:")})
    for t in page_times:
        shown.add(tuple(v for (t2, s2, v) in readings if t2 == t and s2.startswith("page:")))
    return compared, len(shown)


@contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free 127.0.0.1 port in a daemon thread."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

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


def _sample_metrics(base_url: str, stop: threading.Event, out: list[tuple[float, float, float]]) -> None:
    """Background sampler: (time, running, waiting) from /metrics as fast as it answers."""
    with httpx.Client(timeout=5.0) as client:
        while not stop.is_set():
            body = client.get(f"{base_url}/metrics").text
            values = {"running": 0.0, "waiting": 0.0}
            for family in text_string_to_metric_families(body):
                for sample in family.samples:
                    for key in values:
                        if sample.name == f"ferry:num_requests_{key}":
                            values[key] += sample.value
            out.append((time.monotonic(), values["running"], values["waiting"]))
            stop.wait(0.05)


def check_page_tracks_metrics(page: Any, base_url: str, duration_s: float,
                              refresh_s: float, slack_s: float = 0.5, min_readings: int = 8,
                              max_s: float = 60.0) -> tuple[int, int]:
    """Compare the page's running/waiting numbers with /metrics sampled in the background.

    Each page reading must equal a /metrics reading taken at most one refresh
    (plus ``slack_s`` for delivery and rendering) before it, or just after it.
    Reads for ``duration_s``, and on past it (up to ``max_s``) until ``min_readings``
    numeric readings were taken: on a loaded 2-core CI machine one ``page.evaluate``
    can take seconds. Returns how many page readings were compared and how many
    distinct (running, waiting) pairs the page showed.
    """
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_metrics, args=(base_url, stop, samples), daemon=True)
    sampler.start()
    time.sleep(refresh_s + slack_s)  # history for the first page reading to be compared against
    readings: list[tuple[float, float | None, float | None]] = []
    start, numeric = time.monotonic(), 0
    while True:
        elapsed = time.monotonic() - start
        if (elapsed >= duration_s and numeric >= min_readings) or elapsed >= max_s:
            break
        pair = page.evaluate("[document.getElementById('running-count').textContent,"
                             " document.getElementById('waiting-count').textContent]")
        now = time.monotonic()
        reading = (now, *(float(v) if v.strip().isdigit() else None for v in pair))
        readings.append(reading)
        numeric += reading[1] is not None and reading[2] is not None
        time.sleep(0.15)
    time.sleep(0.3)
    stop.set()
    sampler.join(timeout=10)
    compared, shown = 0, set()
    misses: list[str] = []
    for t, running, waiting in readings:
        if running is None or waiting is None:
            continue
        near = [(r, w) for (t2, r, w) in samples if t - refresh_s - slack_s <= t2 <= t + 0.2]
        # Both numbers come from one EngineStats, so the pair must match one scrape; but a
        # state shorter than the sampler's own round trip (one scrape on a loaded 2-core
        # machine, while a fast engine moves its queues every few tens of ms) can reach the
        # page and never the sampler: one reading in five may go unmatched, no more.
        if (running, waiting) not in near:
            misses.append(f"page shows running={running} waiting={waiting}; /metrics had {sorted(set(near))} "
                          f"within {refresh_s + slack_s}s before")
        compared += 1
        shown.add((running, waiting))
    assert len(misses) <= compared // 5, "\n".join(misses)
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

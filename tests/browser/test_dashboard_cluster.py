"""The dashboard of a real cluster under load, in headless Chromium.

``ferry serve`` runs the tiny random-weight model with a small running set
(``--max-num-seqs 4``) while client threads keep more streams open than that, so
both the running set and the waiting queue are non-empty. The page's running and
waiting numbers must match the gateway's /metrics within one refresh, the chart
must gain points, and a screenshot is written under the test's tmp dir (set
FERRY_DASHBOARD_SCREENSHOT=path to also keep a copy, e.g. for the docs).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.browser.helpers import check_page_tracks_metrics, open_dashboard
from tests.integration.conftest import ServeProcess

pytestmark = pytest.mark.slow

MAX_NUM_SEQS = 4
NUM_CLIENTS = 10
REFRESH_S = 1.0  # the gateway's push interval


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    serve = ServeProcess(tiny_model_dir, tmp_path_factory.mktemp("dash"),
                         ["--max-num-seqs", str(MAX_NUM_SEQS), "--metrics-compat", "vllm"]).start()
    try:
        serve.wait_ready()
        yield serve
    finally:
        serve.kill()


class Load:
    """Client threads that keep streaming completions until stopped."""

    def __init__(self, base_url: str, model: str, num_clients: int) -> None:
        self.base_url, self.model = base_url, model
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(num_clients)]

    def run(self, i: int) -> None:
        body = {"model": self.model, "prompt": f"client {i} says hello to the dashboard", "max_tokens": 48,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.base_url, timeout=120, trust_env=False) as client:
            while not self.stop.is_set():
                with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        self.errors.append(f"{resp.status_code}: {resp.read()[:200]!r}")
                        time.sleep(0.2)
                        continue
                    for _ in resp.iter_lines():
                        pass
                self.done += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def test_dashboard_under_load(cluster: ServeProcess, tmp_path: Path) -> None:
    base = cluster.base_url
    with Load(base, cluster.model, NUM_CLIENTS) as load, open_dashboard(base) as (page, log):
        # Wait until the page shows the load: a full running set and a queue behind it.
        page.wait_for_function(
            f"Number(document.getElementById('running-count').textContent) === {MAX_NUM_SEQS}"
            " && Number(document.getElementById('waiting-count').textContent) > 0", timeout=60000)
        points_before = page.evaluate("window.ferryDashboard.points()")

        compared, _ = check_page_tracks_metrics(page, base, duration_s=6.0, refresh_s=REFRESH_S)
        assert compared >= 5

        page.wait_for_function(f"window.ferryDashboard.points() >= {points_before + 3}", timeout=15000)
        page.wait_for_function("document.getElementById('ttft-p95').textContent !== '–'", timeout=30000)
        health = page.text_content("#health") or ""
        assert "scheduler" in health and "worker 0" in health
        # The tables follow the running set from push to push; between two pushes a few
        # clients may be reconnecting, so wait for a push that shows it full rather than
        # reading one instant.
        page.wait_for_function(
            f"document.querySelectorAll('#running-table tbody tr').length === {MAX_NUM_SEQS}"
            " && document.querySelectorAll('#waiting-table tbody tr').length >= 1", timeout=15000)
        assert page.locator("#running-table tbody tr").count() <= MAX_NUM_SEQS
        assert "max_num_seqs" in (page.text_content("#config-scheduler") or "")

        shot = tmp_path / "dashboard-under-load.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("FERRY_DASHBOARD_SCREENSHOT"):
            shutil.copy(shot, os.environ["FERRY_DASHBOARD_SCREENSHOT"])

    assert load.done > 0 and not load.errors, load.errors[:3]
    assert not log.errors, log.errors
    assert all(u.startswith(base) for u in log.urls), [u for u in log.urls if not u.startswith(base)]


def test_metrics_of_the_cluster(cluster: ServeProcess) -> None:
    """After the load above: engine, request and process series are real, and vLLM's names agree."""
    def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(f"{cluster.base_url}/metrics", timeout=10, trust_env=False).text
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine")))):
                s.value for fam in text_string_to_metric_families(text) for s in fam.samples}

    def get(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    # The engine's counters arrive with the next stats message (every 0.25 s), the
    # gateway's request histograms at once: give the stats a moment to catch up.
    deadline = time.monotonic() + 10
    while True:
        samples = scrape()
        caught_up = get("ferry:generation_tokens_total") >= get("ferry:request_generation_tokens_sum")
        if caught_up or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert get("ferry:request_success_total", finished_reason="length") > 0
    assert get("ferry:generation_tokens_total") >= get("ferry:request_generation_tokens_sum") > 0
    assert time.time() - get("ferry:engine_stats_timestamp_seconds") < 5, "the scheduler stopped sending stats"
    assert get("ferry:time_to_first_token_seconds_count") == get("vllm:time_to_first_token_seconds_count") > 0
    assert get("ferry:request_queue_time_seconds_count") > 0
    assert get("ferry:iteration_tokens_total_count") > 0
    assert get("vllm:generation_tokens_total") == get("ferry:generation_tokens_total")
    for process in ("gateway", "scheduler", "worker0"):
        assert get("ferry:process_resident_memory_bytes", process=process) > 1 << 20, process
    for component in ("gateway", "scheduler", "worker 0"):
        assert get("ferry:component_up", component=component) == 1, component
    assert get("ferry:engine_config_info", knob="max_num_seqs", value=str(MAX_NUM_SEQS)) == 1

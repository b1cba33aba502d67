"""The dashboard page in real headless Chromium, fed by synthetic engine stats (no model).

Checks the page against /metrics (running and waiting agree within one refresh),
that the chart gains points, that every metric card is filled, that nothing is
fetched from outside 127.0.0.1, and writes a screenshot under the test's tmp dir.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.browser.helpers import check_page_tracks_metrics, open_dashboard, serve_in_thread
from tests.browser.synthetic_app import build_app

REFRESH_S = 1.0  # the gateway default push interval


def test_dashboard_tracks_metrics_and_draws(tmp_path: Path) -> None:
    app = build_app(tick_s=0.2, interval_s=REFRESH_S)
    with serve_in_thread(app) as base_url, open_dashboard(base_url) as (page, log):
        page.wait_for_function("window.ferryDashboard.points() >= 2", timeout=10000)
        points_before = page.evaluate("window.ferryDashboard.points()")

        compared, distinct = check_page_tracks_metrics(page, base_url, duration_s=3.0, refresh_s=REFRESH_S)
        assert compared >= 6
        assert distinct >= 2, "the page's numbers never changed while the engine's did"

        page.wait_for_function(f"window.ferryDashboard.points() >= {points_before + 3}", timeout=10000)
        assert int(page.get_attribute("#queue-chart", "data-points") or 0) >= points_before + 3
        # uPlot drew a canvas for each chart.
        assert page.locator("#queue-chart canvas").count() == 1
        assert page.locator("#kv-chart canvas").count() == 1

        for element in ("kv-usage", "requests-per-s", "tokens-per-s", "ttft-p50", "ttft-p95", "queue-p95",
                        "preemption-rate", "rejection-rate"):
            text = page.text_content(f"#{element}") or ""
            assert re.search(r"\d", text), f"#{element} shows {text!r}"
        # The step-time panel: a mean step, tokens per step, and phase shares that add up.
        page.wait_for_function("/\\d/.test(document.getElementById('step-forward').textContent)", timeout=10000)
        for element in ("step-mean", "tokens-per-step", "step-forward", "step-sample", "step-idle", "step-schedule"):
            text = page.text_content(f"#{element}") or ""
            assert re.search(r"\d", text), f"#{element} shows {text!r}"
        shares = [float((page.text_content(f"#step-{p}") or "").rstrip("%")) for p in ("forward", "sample", "idle")]
        assert abs(sum(shares) - 100.0) < 0.5, shares
        assert shares[0] > shares[1] and shares[0] > shares[2], shares  # the feeder's forward dominates
        width = page.evaluate("document.getElementById('step-bar-forward').getBoundingClientRect().width")
        assert width > 0, "the step bar drew no forward segment"
        health = page.text_content("#health") or ""
        for name in ("gateway", "scheduler", "worker 0", "worker 1", "redis", "degraded"):
            assert name in health, health
        config = page.text_content("#config") or ""
        assert "max_num_seqs" in config and "scheduling_policy" in (page.text_content("#config-scheduler") or "")
        assert "gateway.port" in config
        assert page.locator("#running-table tbody tr").count() >= 1
        assert "scheduler" in (page.text_content("#processes") or "")

        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000

    assert not log.errors, log.errors
    outside = [u for u in log.urls if not u.startswith(base_url)]
    assert not outside, outside

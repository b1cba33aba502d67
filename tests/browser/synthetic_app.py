"""A gateway stand-in for developing the dashboard: the real router, synthetic engine stats.

It mounts ``make_dashboard_router`` and ``/metrics`` over a ``GatewayMetrics`` that a
background task feeds with made-up ``EngineStats`` (a running set that breathes, a
waiting queue that builds and drains, KV usage that follows) and finished requests.
The browser test uses it to check the page without a model; run it by hand with
``python -m tests.browser.synthetic_app --port 8099`` to look at the page.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from services.gateway.observability.dashboard import make_dashboard_router
from services.gateway.observability.metrics import GatewayMetrics, RequestRecord
from shared.messages import EngineStats, RequestSummary, RequestTimings

CONFIG = {"max_num_seqs": "8", "max_num_batched_tokens": "512", "block_size": "16",
          "scheduling_policy": "priority", "enable_prefix_caching": "True", "max_waiting_requests": "64",
          "queue_timeout_s": "30.0"}


class Feeder:
    """Produces one EngineStats per tick and a few finished requests, deterministically seeded."""

    def __init__(self, metrics: GatewayMetrics, seed: int = 0) -> None:
        self.metrics = metrics
        self.rng = random.Random(seed)
        self.step = 0
        self.totals = {"gen": 0, "prompt": 0, "preempt": 0, "steps": 0}
        self.phase_totals: dict[str, float] = {}

    def tick(self, now: float) -> None:
        self.step += 1
        phase = self.step / 12.0
        running = 4 + round(4 * math.sin(phase))
        waiting = max(0, round(6 * math.sin(phase / 2.0)))
        blocks_total = 256
        in_use = min(blocks_total, running * 20 + self.rng.randint(0, 10))
        self.totals["gen"] += running * 4
        self.totals["prompt"] += self.rng.randint(0, 200)
        self.totals["steps"] += 4
        self.totals["step_tokens"] = self.totals.get("step_tokens", 0) + 4 * (running + 30)
        phases = {"schedule": 0.001, "forward": 0.015 + 0.001 * running, "sample": 0.002, "idle": 0.003}
        for phase, seconds in phases.items():
            self.phase_totals[phase] = self.phase_totals.get(phase, 0.0) + 4 * seconds
        if waiting > 4 and self.step % 5 == 0:
            self.totals["preempt"] += 1
        reqs = [RequestSummary(f"req-{self.step}-{i}", i % 3, 40 + i, 10 + i, 50 + i, 0.5 * i)
                for i in range(running + waiting)]
        stats = EngineStats(
            time=now, num_running=running, num_waiting=waiting, num_kv_blocks_total=blocks_total,
            num_kv_blocks_free=blocks_total - in_use, kv_usage=in_use / blocks_total,
            num_preemptions_total=self.totals["preempt"], prefix_cache_queries_total=self.totals["prompt"],
            prefix_cache_hits_total=self.totals["prompt"] // 3, prompt_tokens_total=self.totals["prompt"],
            generation_tokens_total=self.totals["gen"], steps_total=self.totals["steps"],
            num_running_by_priority={0: running // 2, 1: running - running // 2},
            num_waiting_by_priority={1: waiting},
            step_num_tokens=[running + 30] * 4, step_num_seqs=[running] * 4, step_duration_s=[0.02] * 4,
            running=reqs[:running], waiting=reqs[running:], config=CONFIG,
            process_rss_bytes={"scheduler": 90 << 20, "worker0": 700 << 20},
            process_peak_rss_bytes={"scheduler": 95 << 20, "worker0": 760 << 20}, workers_ready=[0],
            step_schedule_s=[phases["schedule"]] * 4, step_forward_s=[phases["forward"]] * 4,
            step_sample_s=[phases["sample"]] * 4, step_idle_s=[phases["idle"]] * 4,
            step_phase_seconds_total=dict(self.phase_totals), step_tokens_total=self.totals["step_tokens"],
        )
        self.metrics.on_engine_stats(stats)
        if self.step % 2 == 0:
            self.metrics.on_request_finished(self._record(now))
        if waiting >= 6 and self.step % 3 == 0:
            self.metrics.on_rejected("queue_full", 429)

    def _record(self, now: float) -> RequestRecord:
        arrival = now - 1.5 - self.rng.random()
        scheduled = arrival + self.rng.random() * 0.4
        first = scheduled + 0.1 + self.rng.random() * 0.2
        tokens = [first + 0.05 * i for i in range(8)]
        return RequestRecord(
            req_id=f"done-{self.step}", priority=0, finish_reason="stop" if self.step % 6 else "length",
            num_prompt_tokens=60, num_output_tokens=8, num_cached_tokens=16, arrival_time=arrival,
            first_token_time=first, finished_time=tokens[-1], token_times=tokens,
            timings=RequestTimings(arrival_time=arrival, first_scheduled_time=scheduled,
                                   first_token_time=first, finished_time=tokens[-1]),
            max_tokens=8,
        )


def health() -> dict[str, Any]:
    """The shape of the gateway's /health (GatewayState.health)."""
    return {
        "status": "ok", "ready": True, "reason": "", "gateway_id": "gw-synthetic", "model": "synthetic-model",
        "scheduler": {"endpoint": "ipc:///tmp/x", "connected": True, "ready": True, "reason": "",
                      "last_seen_s_ago": 0.1, "num_workers": 2, "workers_ready": [0, 1]},
        "redis": {"redis": "degraded", "detail": "connection refused", "auth": "static"},
    }


def build_app(tick_s: float = 0.25, interval_s: float = 1.0, seed: int = 0) -> FastAPI:
    metrics = GatewayMetrics("synthetic-model", vllm_compat=True)
    feeder = Feeder(metrics, seed)

    async def feed() -> None:
        while True:
            feeder.tick(time.time())
            await asyncio.sleep(tick_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(feed())
        yield
        task.cancel()

    app = FastAPI(lifespan=lifespan)
    app.state.metrics = metrics

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    state = lambda: {"health": health(), "config": {"gateway": {"port": 8000, "metrics_compat": "vllm"}}}  # noqa: E731
    app.include_router(make_dashboard_router(metrics, state, interval_s=interval_s))
    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8099)
    args = parser.parse_args()
    uvicorn.run(build_app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

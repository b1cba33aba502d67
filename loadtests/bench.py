"""A benchmark job: one trace, a list of offered rates, one server configuration.

``run_config`` runs the rates in ascending order and, for a sweep, stops by
itself after the first rate that breaks the run-level SLO, reporting the
highest rate that met it. ``bench_meta`` records what is needed to repeat the
job: the exact command, the trace's hash and version, the tokenizer, the
server's model list and version, the host.
"""

from __future__ import annotations

import asyncio
import math
import platform
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from loadtests.arrivals import ArrivalSpec
from loadtests.runner import BenchSettings, RunPlan, run_once
from loadtests.scenarios import generate
from loadtests.textgen import TextBuilder, load_tokenizer
from loadtests.trace import Trace, read_trace

Log = Callable[[str], None]


@dataclass(frozen=True)
class BenchJob:
    trace: Trace
    duration_s: float
    arrival: ArrivalSpec
    rates: tuple[float, ...] = ()
    concurrencies: tuple[int, ...] = ()
    max_concurrency: int | None = None
    stop_on_slo: bool = False
    cooldown_s: float = 1.0
    stop_on_saturation: bool = False

    def plans(self) -> list[RunPlan]:
        if self.arrival.kind == "closed":
            if not self.concurrencies:
                raise ValueError("the closed loop needs --concurrency")
            return [RunPlan(f"c{c}", self.duration_s, self.arrival, concurrency=c) for c in sorted(self.concurrencies)]
        if not self.rates:
            raise ValueError("an open-loop run needs --rates")
        return [
            RunPlan(f"{r:g}rps", self.duration_s, self.arrival, rate=r, max_concurrency=self.max_concurrency)
            for r in sorted(self.rates)
        ]


def run_config(name: str, job: BenchJob, settings: BenchSettings, log: Log) -> dict[str, Any]:
    """Every rate of the job against one server; the sweep verdict when it stops on the SLO."""
    runs: list[dict[str, Any]] = []
    best: float | None = None
    stopped_at: float | None = None
    broken: list[str] = []
    for i, plan in enumerate(job.plans()):
        if i and job.cooldown_s > 0:
            time.sleep(job.cooldown_s)  # let the server drain the previous run's tail
        log(f"[{name}] run {plan.name}: {plan.arrival.kind} arrivals for {plan.duration_s:g}s")
        result = run_once(job.trace, plan, settings)
        runs.append(result)
        summary = result["summary"]
        log(
            f"[{name}] {plan.name}: {summary['completed']}/{summary['num_requests']} completed, "
            f"{summary['completed_rps']:.2f} req/s, p95 TTFT {_ms(summary['ttft_p95_ms'])}, "
            f"p95 e2e {_ms(summary['e2e_p95_ms'])}, errors {summary['errors']}, cancelled {summary['cancelled']}"
        )
        point = plan.rate if plan.rate is not None else float(plan.concurrency or 0)
        if summary.get("saturated"):
            log(f"[{name}] {plan.name}: saturated ({'; '.join(summary['saturation_reasons'])})")
        if result["slo_violations"]:
            if job.stop_on_slo:
                stopped_at, broken = point, result["slo_violations"]
                log(f"[{name}] SLO broken at {point:g}: {'; '.join(broken)}; stopping the sweep")
                break
        elif stopped_at is None:
            best = point
        if summary.get("saturated") and job.stop_on_saturation:
            # Past saturation a higher offered rate only measures the queue.
            stopped_at, broken = point, ["saturated: " + "; ".join(summary["saturation_reasons"])]
            log(f"[{name}] stopping the sweep at the first saturated {plan.name}")
            break
    checked = job.stop_on_slo or any(v is not None for v in vars(settings.slo).values())
    sweep = {"checked": checked, "max_rate_meeting_slo": best, "stopped_at": stopped_at, "broken": broken,
             "axis": "concurrency" if job.arrival.kind == "closed" else "offered req/s"}
    return {"name": name, "runs": runs, "sweep": sweep}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def sweep_rates(start: float, factor: float, max_rate: float) -> list[float]:
    """``start, start*factor, ...`` up to ``max_rate``."""
    if start <= 0 or factor <= 1 or max_rate < start:
        raise ValueError("a sweep needs 0 < start <= max-rate and factor > 1")
    rates, rate = [], start
    while rate <= max_rate * (1 + 1e-9):
        rates.append(round(rate, 6))
        rate *= factor
    return rates


def requests_needed(arrival: ArrivalSpec, rates: list[float], concurrencies: list[int], duration_s: float) -> int:
    """How long a generated trace must be so no run runs out of requests."""
    if arrival.kind == "closed":
        return min(4000, max(32, int(max(concurrencies or [1]) * max(duration_s, 4.0) * 4)))
    peak = max(rates or [1.0]) * duration_s
    # Poisson counts over a window spread by about sqrt(n); 3 sigma keeps the tail covered.
    return int(math.ceil(peak + 3 * math.sqrt(peak) + 8))


def load_or_generate(
    trace_path: Path | None,
    scenario: str | None,
    seed: int,
    tokenizer: str,
    num_requests: int,
    overrides: dict[str, object] | None = None,
) -> Trace:
    if trace_path is not None:
        return read_trace(trace_path)
    if scenario is None:
        raise ValueError("pass --scenario or --trace")
    builder = TextBuilder(load_tokenizer(tokenizer))
    return generate(scenario, num_requests, seed, builder, overrides)


def server_info(base_url: str, api_key: str = "") -> dict[str, Any]:
    """What the server says about itself: /v1/models and, where they exist, /version and /v1/config."""
    return asyncio.run(_server_info(base_url, api_key))


async def _server_info(base_url: str, api_key: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info: dict[str, Any] = {}
    async with httpx.AsyncClient(trust_env=False, timeout=5.0) as client:
        for path in ("/v1/models", "/version", "/v1/config"):
            try:
                response = await client.get(base_url.rstrip("/") + path, headers=headers)
                if response.status_code == 200:
                    info[path] = response.json()
            except (httpx.HTTPError, ValueError):
                continue
    return info


def bench_meta(command: list[str], trace: Trace, extra: dict[str, Any]) -> dict[str, Any]:
    try:
        from importlib.metadata import version

        tool_version = version("ferry")
    except Exception:  # noqa: BLE001 - a source checkout without metadata is fine
        tool_version = "unknown"
    return {
        "command": " ".join(_quote(a) for a in command),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "trace": trace.describe(),
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": _cpu_count(),
            "ferry": tool_version,
        },
        **extra,
    }


def _cpu_count() -> int | None:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)

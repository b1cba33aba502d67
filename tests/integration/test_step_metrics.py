"""Step time in production: /metrics and the dashboard say where each engine step goes.

A real ``ferry serve`` on the tiny model: after a handful of concurrent requests the
per-phase histograms (schedule, forward, sample, idle) and tokens per step have
moved, forward time is non-zero, and the dashboard's window reports shares that add
up to the whole step cycle.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import ServeProcess, openai_client, read_metrics, serve_cluster, wait_for

__all__ = ["serve_cluster"]  # the module-scoped fixture, re-exported for pytest

PHASES = ("schedule", "forward", "sample", "idle")


def phase_metrics(base_url: str) -> dict[str, dict[str, float]]:
    """{phase: {"count": n, "sum": seconds}} of ferry:step_phase_seconds."""
    text = httpx.get(f"{base_url}/metrics", timeout=5.0, trust_env=False).text
    out: dict[str, dict[str, float]] = {p: {"count": 0.0, "sum": 0.0} for p in PHASES}
    for family in text_string_to_metric_families(text):
        if family.name != "ferry:step_phase_seconds":
            continue
        for sample in family.samples:
            kind = sample.name.rsplit("_", 1)[-1]
            if kind in ("count", "sum"):
                out[sample.labels["phase"]][kind] += sample.value
    return out


def iteration_tokens(base_url: str) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5.0, trust_env=False).text
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "ferry:iteration_tokens_total":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count += sample.value
                elif sample.name.endswith("_sum"):
                    total += sample.value
    return count, total


def test_step_phases_exist_and_move_under_load(serve_cluster: ServeProcess, tmp_path: Path) -> None:
    base = serve_cluster.base_url
    before = phase_metrics(base)
    assert set(before) == set(PHASES)  # every phase is exposed, at zero or more, before any load
    steps_before, tokens_before = iteration_tokens(base)
    client = openai_client(base)

    def one(i: int) -> int:
        out = client.completions.create(model=client.models.list().data[0].id, prompt=f"count {i}:",
                                        max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [12] * 8

    # EngineStats reach the gateway every stats_interval_s: wait until the last steps are in.
    def moved() -> bool:
        now = phase_metrics(base)
        return now["forward"]["count"] - before["forward"]["count"] >= 12

    wait_for(moved, 20.0, what="step phase samples at the gateway")
    after = phase_metrics(base)
    num_steps = after["forward"]["count"] - before["forward"]["count"]
    for phase in PHASES:
        assert after[phase]["count"] - before[phase]["count"] == num_steps, (phase, before, after)
    assert after["forward"]["sum"] > before["forward"]["sum"]
    assert after["sample"]["sum"] > before["sample"]["sum"]
    assert after["schedule"]["sum"] > before["schedule"]["sum"]
    steps_after, tokens_after = iteration_tokens(base)
    assert steps_after - steps_before >= num_steps
    # 8 prompts of a few tokens plus 8 x 12 decodes (11 of them after the prefill's token).
    assert tokens_after - tokens_before >= 8 * 11

    window = httpx.get(f"{base}/dashboard/data", timeout=5.0, trust_env=False).json()["window"]
    shares = [window[f"step_{p}_share"] for p in ("forward", "sample", "idle")]
    assert all(s is not None and 0.0 <= s <= 1.0 for s in shares), window
    assert abs(sum(shares) - 1.0) < 1e-6, shares
    assert window["step_mean_s"] > 0 and window["tokens_per_step"] >= 1.0


def _kv_free(base_url: str) -> tuple[float, float]:
    m = read_metrics(base_url)
    return m["ferry:num_kv_blocks_free"], m["ferry:num_kv_blocks"]


def test_async_scheduling_gives_identical_outputs_and_leaks_no_blocks(serve_cluster: ServeProcess,
                                                                       tmp_path: Path) -> None:
    """The same greedy prompts (stops by EOS, by length, by stop id) on the synchronous
    server and on one with --async-scheduling: the same tokens, and every KV block free after."""
    prompts = [f"Story {i}: once upon a time" for i in range(10)]
    stop_ids = [[], [], [13], [], [29], [], [], [], [], []]

    def run(base: str) -> list[tuple[str, str]]:
        client = openai_client(base)
        model = client.models.list().data[0].id

        def one(i: int) -> tuple[str, str]:
            extra: dict[str, object] = {"ignore_eos": i % 3 == 0}
            if stop_ids[i]:
                extra["stop_token_ids"] = stop_ids[i]
            out = client.completions.create(model=model, prompt=prompts[i], max_tokens=5 + 3 * i, temperature=0,
                                            extra_body=extra)
            return out.choices[0].text, out.choices[0].finish_reason

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, range(len(prompts))))

    serve_async = ServeProcess(serve_cluster.model, tmp_path, ["--async-scheduling", "true"]).start()
    try:
        serve_async.wait_ready()
        got_async = run(serve_async.base_url)
        got_sync = run(serve_cluster.base_url)
        assert got_async == got_sync
        assert {reason for _, reason in got_sync} >= {"length"}
        for base in (serve_async.base_url, serve_cluster.base_url):
            wait_for(lambda b=base: _kv_free(b)[0] == _kv_free(b)[1], 20.0, what="every KV block free")  # type: ignore[misc]
        assert "async_scheduling" in httpx.get(f"{serve_async.base_url}/v1/config", timeout=5,
                                               trust_env=False).text
    finally:
        serve_async.kill()

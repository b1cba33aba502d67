"""GatewayMetrics: exposition text, counter deltas, request histograms, vLLM names."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.observability.metrics import GatewayMetrics, RequestRecord
from shared.messages import EngineHealth, EngineStats, RequestTimings

T0 = 1_700_000_000.0


def samples(metrics: GatewayMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, _ = metrics.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    labels = {"model_name": "m", "engine": "0", **labels}
    return samples(metrics)[(name, frozenset(labels.items()))]


def names(metrics: GatewayMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


def stats(**kw: object) -> EngineStats:
    base: dict[str, object] = dict(time=T0, num_running=0, num_waiting=0, num_kv_blocks_total=100,
                                   num_kv_blocks_free=100, kv_usage=0.0)
    base.update(kw)
    return EngineStats(**base)  # type: ignore[arg-type]


def record(**kw: object) -> RequestRecord:
    base: dict[str, object] = dict(
        req_id="r1", priority=0, finish_reason="stop", num_prompt_tokens=12, num_output_tokens=4,
        num_cached_tokens=8, arrival_time=T0, first_token_time=T0 + 0.5, finished_time=T0 + 1.1,
        token_times=[T0 + 0.5, T0 + 0.7, T0 + 0.9, T0 + 1.1],
        timings=RequestTimings(arrival_time=T0, first_scheduled_time=T0 + 0.25,
                               first_token_time=T0 + 0.5, finished_time=T0 + 1.0, num_preemptions=1),
        max_tokens=16,
    )
    base.update(kw)
    return RequestRecord(**base)  # type: ignore[arg-type]


def test_exposition_names_content_type_and_counter_suffix() -> None:
    m = GatewayMetrics("m")
    body, content_type = m.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    text = body.decode()
    # Counters get exactly one _total; histograms keep their own name (vLLM's iteration_tokens_total).
    assert "ferry:num_preemptions_total{" in text
    assert "_total_total" not in text
    assert "# TYPE ferry:iteration_tokens_total histogram" in text
    # Series exist as zeros before any traffic, so rate() works from the first scrape.
    assert value(m, "ferry:generation_tokens_total") == 0.0
    assert value(m, "ferry:request_success_total", finished_reason="stop") == 0.0
    assert not any(n.startswith("vllm:") for n in names(m))


def test_gauges_follow_latest_stats_and_vanished_priorities_go_to_zero() -> None:
    m = GatewayMetrics("m")
    m.on_engine_stats(stats(num_running=3, num_waiting=5, kv_usage=0.625, num_kv_blocks_free=40,
                            num_running_by_priority={0: 2, 5: 1}, num_waiting_by_priority={5: 5}))
    assert value(m, "ferry:num_requests_running") == 3
    assert value(m, "ferry:num_requests_waiting") == 5
    assert value(m, "ferry:kv_cache_usage_perc") == 0.625
    assert value(m, "ferry:num_kv_blocks_free") == 40
    assert value(m, "ferry:num_requests_running_by_priority", priority="5") == 1
    m.on_engine_stats(stats(time=T0 + 1, num_running=2, num_running_by_priority={0: 2}))
    assert value(m, "ferry:num_requests_running_by_priority", priority="5") == 0
    assert value(m, "ferry:num_requests_waiting_by_priority", priority="5") == 0
    assert value(m, "ferry:num_requests_running") == 2


def test_counters_advance_by_deltas_and_survive_a_scheduler_restart() -> None:
    m = GatewayMetrics("m")
    m.on_engine_stats(stats(generation_tokens_total=10, num_preemptions_total=1, worker_restarts_total=0))
    m.on_engine_stats(stats(generation_tokens_total=25, num_preemptions_total=3, worker_restarts_total=1))
    assert value(m, "ferry:generation_tokens_total") == 25
    assert value(m, "ferry:num_preemptions_total") == 3
    # The scheduler restarted: its totals start over; ours keep counting up.
    m.on_engine_stats(stats(generation_tokens_total=5, num_preemptions_total=0, worker_restarts_total=1))
    assert value(m, "ferry:generation_tokens_total") == 30
    assert value(m, "ferry:num_preemptions_total") == 3
    assert value(m, "ferry:worker_restarts_total") == 1


def test_step_histograms_observe_every_sample() -> None:
    m = GatewayMetrics("m")
    m.on_engine_stats(stats(step_num_tokens=[1, 100, 3000], step_num_seqs=[1, 3, 64],
                            step_duration_s=[0.01, 0.2, 0.02]))
    assert value(m, "ferry:iteration_tokens_total_count") == 3
    assert value(m, "ferry:iteration_tokens_total_sum") == 3101
    assert value(m, "ferry:iteration_tokens_total_bucket", le="128.0") == 2
    assert value(m, "ferry:iteration_num_seqs_sum") == 68
    assert value(m, "ferry:iteration_duration_seconds_sum") == pytest.approx(0.23)


def test_process_memory_of_every_process_and_removal_of_gone_ones() -> None:
    m = GatewayMetrics("m")
    m.on_engine_stats(stats(process_rss_bytes={"scheduler": 100, "worker0": 200, "worker1": 300},
                            process_peak_rss_bytes={"scheduler": 150, "worker0": 250, "worker1": 350},
                            device_memory_peak_bytes={"worker0": 1 << 30}))
    assert value(m, "ferry:process_resident_memory_bytes", process="worker1") == 300
    assert value(m, "ferry:process_peak_resident_memory_bytes", process="scheduler") == 150
    assert value(m, "ferry:device_memory_peak_bytes", process="worker0") == 1 << 30
    assert value(m, "ferry:process_resident_memory_bytes", process="gateway") > 1 << 20
    m.on_engine_stats(stats(process_rss_bytes={"scheduler": 100, "worker0": 210}))
    with pytest.raises(KeyError):
        value(m, "ferry:process_resident_memory_bytes", process="worker1")
    assert value(m, "ferry:process_resident_memory_bytes", process="worker0") == 210


def test_request_histograms_from_gateway_and_scheduler_timings() -> None:
    m = GatewayMetrics("m")
    m.on_request_finished(record())
    assert value(m, "ferry:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(m, "ferry:e2e_request_latency_seconds_sum") == pytest.approx(1.1)
    assert value(m, "ferry:inter_token_latency_seconds_count") == 3
    assert value(m, "ferry:inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert value(m, "ferry:request_time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(m, "ferry:request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert value(m, "ferry:request_prefill_time_seconds_sum") == pytest.approx(0.25)
    assert value(m, "ferry:request_decode_time_seconds_sum") == pytest.approx(0.5)
    assert value(m, "ferry:request_inference_time_seconds_sum") == pytest.approx(0.75)
    assert value(m, "ferry:request_delivery_lag_seconds_sum") == pytest.approx(0.1)
    assert value(m, "ferry:request_prompt_tokens_sum") == 12
    assert value(m, "ferry:request_generation_tokens_sum") == 4
    assert value(m, "ferry:request_params_max_tokens_sum") == 16
    assert value(m, "ferry:request_num_preemptions_sum") == 1
    assert value(m, "ferry:prompt_tokens_cached_total") == 8
    assert value(m, "ferry:request_success_total", finished_reason="stop") == 1


def test_request_without_tokens_or_scheduler_timings() -> None:
    m = GatewayMetrics("m")
    m.on_request_finished(record(finish_reason="timeout", first_token_time=None, num_output_tokens=0,
                                 token_times=[], timings=RequestTimings(arrival_time=T0), max_tokens=None))
    assert value(m, "ferry:request_success_total", finished_reason="timeout") == 1
    assert value(m, "ferry:time_to_first_token_seconds_count") == 0
    assert value(m, "ferry:request_queue_time_seconds_count") == 0
    assert value(m, "ferry:e2e_request_latency_seconds_count") == 1


def test_rejections_by_reason_and_status() -> None:
    m = GatewayMetrics("m")
    m.on_rejected("queue_full", 429)
    m.on_rejected("queue_full", 429)
    m.on_rejected("unauthorized", 401)
    assert value(m, "ferry:request_rejected_total", reason="queue_full", status="429") == 2
    assert value(m, "ferry:request_rejected_total", reason="unauthorized", status="401") == 1


def test_health_sets_scheduler_ready() -> None:
    m = GatewayMetrics("m")
    m.on_engine_health(EngineHealth(time=T0, scheduler_ready=True, num_workers=2, workers_ready=[0, 1]))
    assert value(m, "ferry:scheduler_ready") == 1
    assert value(m, "ferry:num_workers_ready") == 2
    m.on_engine_health(EngineHealth(time=T0, scheduler_ready=False, num_workers=2))
    assert value(m, "ferry:scheduler_ready") == 0


def test_vllm_compat_exposes_exact_vllm_names_with_the_same_values() -> None:
    m = GatewayMetrics("m", vllm_compat=True)
    m.on_engine_stats(stats(num_running=7, num_waiting=1, kv_usage=0.5, prompt_tokens_total=40,
                            prefix_cache_queries_total=40, prefix_cache_hits_total=16))
    m.on_request_finished(record())
    got = names(m)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_sum",
                 "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
                 "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
                 "vllm:iteration_tokens_total_bucket", "vllm:request_max_num_generation_tokens_sum"):
        assert name in got, name
    assert value(m, "vllm:num_requests_running") == 7
    assert value(m, "vllm:prefix_cache_hits_total") == 16
    assert value(m, "vllm:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    # ferry-only metrics stay ferry-only.
    assert "vllm:request_rejected_total" not in got and "vllm:worker_restarts_total" not in got


def test_two_instances_do_not_share_a_registry() -> None:
    a, b = GatewayMetrics("m"), GatewayMetrics("m")
    a.on_engine_stats(stats(num_running=4))
    assert value(a, "ferry:num_requests_running") == 4
    assert value(b, "ferry:num_requests_running") == 0


def bucket_edges(metrics: GatewayMetrics, name: str) -> list[float]:
    return sorted(float(dict(labels)["le"]) for n, labels in samples(metrics) if n == name and
                  dict(labels).get("le") not in (None, "+Inf"))


def test_request_phases_have_fine_low_buckets_and_vllm_keeps_its_own() -> None:
    m = GatewayMetrics("m", vllm_compat=True)
    m.on_request_finished(record(timings=RequestTimings(arrival_time=T0, first_scheduled_time=T0 + 0.04,
                                                        first_token_time=T0 + 0.1, finished_time=T0 + 1.0)))
    for phase in ("request_queue_time_seconds", "request_prefill_time_seconds", "e2e_request_latency_seconds",
                  "request_decode_time_seconds", "request_inference_time_seconds"):
        ferry = bucket_edges(m, f"ferry:{phase}_bucket")
        assert ferry[:3] == [0.005, 0.01, 0.025] and 0.3 in ferry and ferry[-1] == 7680.0, phase
        assert bucket_edges(m, f"vllm:{phase}_bucket") == [  # vLLM's request_latency_buckets, exactly
            0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0], phase
    # a 40 ms queue wait is readable under ferry: (le=0.05), lumped into the first bucket under vllm:
    assert value(m, "ferry:request_queue_time_seconds_bucket", le="0.025") == 0
    assert value(m, "ferry:request_queue_time_seconds_bucket", le="0.05") == 1
    assert value(m, "vllm:request_queue_time_seconds_bucket", le="0.3") == 1
    assert bucket_edges(m, "ferry:time_to_first_token_seconds_bucket")[0] == 0.001  # already fine

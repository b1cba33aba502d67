"""LiveWindow: windowed rates and percentiles behind the dashboard."""

from __future__ import annotations

import pytest

from services.gateway.observability.metrics_window import EngineSample, FinishedSample, LiveWindow, percentile


def finished(t: float, ttft: float | None = 0.1, queue: float | None = 0.05) -> FinishedSample:
    return FinishedSample(finished_time=t, ttft_s=ttft, queue_s=queue, e2e_s=1.0, num_output_tokens=5,
                          finish_reason="stop")


def engine(t: float, gen: int, preempt: int = 0, running: int = 1) -> EngineSample:
    return EngineSample(time=t, num_running=running, num_waiting=0, kv_usage=0.1, num_preemptions_total=preempt,
                        generation_tokens_total=gen, prompt_tokens_total=0)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile(values, 100) == 100.0


def test_summary_covers_only_the_window() -> None:
    w = LiveWindow(window_s=10.0)
    for i in range(20):  # one request per second from t=0 to t=19, ttft = i/100
        w.add_finished(finished(float(i), ttft=i / 100))
    s = w.summary(now=19.5)
    assert s["num_finished"] == 10  # t = 10..19
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["ttft_p50_s"] == pytest.approx(0.14)
    assert s["ttft_p95_s"] == pytest.approx(0.19)


def test_rates_from_engine_counters_and_a_reset() -> None:
    w = LiveWindow(window_s=10.0)
    w.add_engine(engine(100.0, gen=0, preempt=0))
    w.add_engine(engine(104.0, gen=400, preempt=2))
    s = w.summary(now=104.0)
    assert s["generation_tokens_per_s"] == pytest.approx(100.0)
    assert s["preemptions_per_s"] == pytest.approx(0.5)
    # Scheduler restart: totals drop; the rate counts the new total from zero.
    w.add_engine(engine(106.0, gen=100, preempt=0))
    assert w.summary(now=106.0)["generation_tokens_per_s"] == pytest.approx(100 / 6)


def test_young_window_divides_by_observed_span() -> None:
    w = LiveWindow(window_s=60.0)
    w.add_rejected(50.0)
    w.add_rejected(51.0)
    w.add_finished(finished(52.0, ttft=None, queue=None))
    s = w.summary(now=54.0)
    assert s["rejections_per_s"] == pytest.approx(2 / 4.0)
    assert s["requests_per_s"] == pytest.approx(1 / 4.0)
    assert s["ttft_p50_s"] is None and s["queue_p95_s"] is None


def test_history_is_bounded() -> None:
    w = LiveWindow(window_s=5.0, history_s=30.0)
    for i in range(100):
        w.add_engine(engine(float(i), gen=i))
    hist = w.history()
    assert hist[0].time == 69.0 and hist[-1].time == 99.0
    assert [s.time for s in w.history(since=97.0)] == [98.0, 99.0]


def stepped(t: float, steps: int, tokens: int, forward: float, sample: float, idle: float,
            schedule: float) -> EngineSample:
    return EngineSample(time=t, num_running=1, num_waiting=0, kv_usage=0.1, num_preemptions_total=0,
                        generation_tokens_total=0, prompt_tokens_total=0, steps_total=steps,
                        step_tokens_total=tokens, step_phase_seconds_total={
                            "forward": forward, "sample": sample, "idle": idle, "schedule": schedule})


def test_step_split_over_the_window() -> None:
    w = LiveWindow(window_s=60.0)
    w.add_engine(stepped(100.0, 10, 500, 1.0, 0.1, 0.1, 0.01))
    w.add_engine(stepped(110.0, 30, 1300, 8.0, 0.5, 0.5, 0.05))  # 20 steps, 7.8 s of cycle
    s = w.summary(110.0)
    assert s["step_mean_s"] == pytest.approx(7.8 / 20)
    assert s["tokens_per_step"] == pytest.approx(800 / 20)
    assert s["step_forward_share"] == pytest.approx(7.0 / 7.8)
    assert s["step_sample_share"] == pytest.approx(0.4 / 7.8)
    assert s["step_idle_share"] == pytest.approx(0.4 / 7.8)
    assert s["step_schedule_share"] == pytest.approx(0.04 / 7.8)


def test_step_split_is_empty_without_steps_or_after_a_reset() -> None:
    w = LiveWindow(window_s=60.0)
    w.add_engine(stepped(100.0, 10, 500, 1.0, 0.1, 0.1, 0.01))
    w.add_engine(stepped(105.0, 10, 500, 1.0, 0.1, 0.1, 0.01))  # idle engine: no steps
    assert w.summary(105.0)["step_mean_s"] is None
    w.add_engine(stepped(110.0, 2, 40, 0.2, 0.0, 0.0, 0.0))  # a restarted scheduler counts from zero
    s = w.summary(110.0)
    assert s["step_mean_s"] is None and s["step_forward_share"] is None

"""The token-bucket arithmetic (in-memory fallback) and the x-ratelimit-* headers."""

from __future__ import annotations

import pytest

from services.gateway.admission.ratelimit import Decision, LocalLimiter, format_duration, token_cost


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_burst_is_the_limit_then_refills_at_limit_per_minute() -> None:
    clock = FakeClock()
    limiter = LocalLimiter(clock=clock)
    accepted = [limiter.admit("k", rpm=6, tpm=0, cost=0).allowed for _ in range(10)]
    assert accepted == [True] * 6 + [False] * 4
    refused = limiter.admit("k", rpm=6, tpm=0, cost=0)
    assert refused.retry_after_s == pytest.approx(10.0)  # one request every 60/6 s
    clock.now += 9.9
    assert not limiter.admit("k", rpm=6, tpm=0, cost=0).allowed
    clock.now += 0.1
    assert limiter.admit("k", rpm=6, tpm=0, cost=0).allowed
    assert not limiter.admit("k", rpm=6, tpm=0, cost=0).allowed


def test_keys_have_separate_buckets() -> None:
    limiter = LocalLimiter(clock=FakeClock())
    assert limiter.admit("a", rpm=1, tpm=0, cost=0).allowed
    assert not limiter.admit("a", rpm=1, tpm=0, cost=0).allowed
    assert limiter.admit("b", rpm=1, tpm=0, cost=0).allowed


def test_token_bucket_refuses_both_dimensions_together() -> None:
    clock = FakeClock()
    limiter = LocalLimiter(clock=clock)
    first = limiter.admit("k", rpm=10, tpm=100, cost=80)
    assert first.allowed and first.remaining_tokens == 20
    second = limiter.admit("k", rpm=10, tpm=100, cost=30)
    assert not second.allowed
    # Refused: neither bucket was debited, so the request bucket still holds 9.
    assert second.remaining_requests == 9
    assert second.retry_after_s == pytest.approx((30 - 20) * 60 / 100)
    clock.now += 6.0
    assert limiter.admit("k", rpm=10, tpm=100, cost=30).allowed


def test_refund_returns_unused_reservation_and_debt_delays() -> None:
    clock = FakeClock()
    limiter = LocalLimiter(clock=clock)
    assert limiter.admit("k", rpm=0, tpm=100, cost=100).allowed
    assert limiter.refund("k", tpm=100, delta=60) == 60  # used 40 of 100 reserved
    assert limiter.admit("k", rpm=0, tpm=100, cost=60).allowed
    # Used 50 more than reserved: the bucket goes into debt.
    assert limiter.refund("k", tpm=100, delta=-50) == -50
    refused = limiter.admit("k", rpm=0, tpm=100, cost=10)
    assert not refused.allowed
    assert refused.retry_after_s == pytest.approx(60 * 60 / 100)
    # A refund never overfills the bucket.
    clock.now += 600
    assert limiter.refund("k", tpm=100, delta=500) == 100


def test_token_cost_is_capped_at_the_bucket() -> None:
    assert token_cost(10, 20, tpm=0) == 30
    assert token_cost(10, 20, tpm=25) == 25
    assert token_cost(-5, 20, tpm=0) == 20


def test_headers_follow_openai_names_and_formats() -> None:
    ok = Decision(allowed=True, rpm=60, tpm=1000, remaining_requests=58.7, remaining_tokens=-3,
                  retry_after_s=0.0, reset_requests_s=1.3, reset_tokens_s=90.2)
    assert ok.headers() == {
        "x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "58",
        "x-ratelimit-reset-requests": "2s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "0", "x-ratelimit-reset-tokens": "1m31s",
    }
    refused = Decision(allowed=False, rpm=60, tpm=0, remaining_requests=0.2, remaining_tokens=0,
                       retry_after_s=0.8, reset_requests_s=59.0, reset_tokens_s=0)
    headers = refused.headers()
    assert headers["retry-after"] == "1"
    assert "x-ratelimit-limit-tokens" not in headers


@pytest.mark.parametrize(("seconds", "text"), [(0.0, "0ms"), (0.12, "120ms"), (6.0, "6s"),
                                               (60.0, "1m0s"), (90.01, "1m31s")])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_memory_is_bounded_by_keys_not_requests() -> None:
    limiter = LocalLimiter(clock=FakeClock())
    for _ in range(10_000):
        limiter.admit("k", rpm=1_000_000, tpm=1_000_000, cost=1)
    assert len(limiter) == 2

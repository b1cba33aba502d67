"""A resumed choice keeps the original request's timings (queue, first token) and takes the
finish from the scheduler that completed it; preemptions: the largest count reported."""

from __future__ import annotations

from services.gateway.api.generation import _merge_timings
from shared.messages import RequestTimings


def test_merge_keeps_the_original_queue_and_first_token() -> None:
    before = RequestTimings(arrival_time=100.0, first_scheduled_time=101.0, first_token_time=102.0,
                            num_preemptions=1)
    after = RequestTimings(arrival_time=100.0, first_scheduled_time=150.0, first_token_time=None,
                           finished_time=160.0, num_preemptions=2)
    merged = _merge_timings(before, after)
    assert merged == RequestTimings(arrival_time=100.0, first_scheduled_time=101.0, first_token_time=102.0,
                                    finished_time=160.0, num_preemptions=2)


def test_a_request_that_never_ran_takes_the_new_schedulers_timings() -> None:
    after = RequestTimings(arrival_time=100.0, first_scheduled_time=150.0, first_token_time=151.0,
                           finished_time=160.0)
    assert _merge_timings(None, after) == after
    before = RequestTimings(arrival_time=100.0)  # admitted, no token before the crash
    assert _merge_timings(before, after).first_scheduled_time == 150.0

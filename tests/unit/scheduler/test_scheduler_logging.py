"""The scheduler's log lines carry the request id, so one grep follows a request."""

from __future__ import annotations

import logging

import pytest

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeWorker, make_request, small_config


def _records(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ferry.scheduler" and r.getMessage() == message]


def test_rejection_preemption_and_finish_are_logged_with_req_id(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ferry.scheduler")
    # 6 blocks of 4 tokens: two requests of 8 + 8 tokens cannot both finish without a preemption.
    sched = Scheduler(small_config(max_waiting_requests=2), num_kv_blocks=6, max_model_len=64)
    driver = Driver(sched, FakeWorker(block_size=4, num_blocks=6))
    assert sched.add_request(make_request("a", 8, max_tokens=8, ignore_eos=True)) is None
    assert sched.add_request(make_request("b", 8, max_tokens=8, ignore_eos=True)) is None
    refused = sched.add_request(make_request("c", 4))
    assert refused is not None and refused.reason == "queue_full"
    driver.run()

    [rejected] = _records(caplog, "request rejected")
    assert rejected.req_id == "c" and rejected.reason == "queue_full"  # type: ignore[attr-defined]
    preempted = _records(caplog, "request preempted")
    assert preempted and {r.req_id for r in preempted} <= {"a", "b"}  # type: ignore[attr-defined]
    finished = {r.req_id: r for r in _records(caplog, "request finished")}  # type: ignore[attr-defined]
    assert set(finished) == {"a", "b"}
    assert finished["a"].finish_reason == "length"  # type: ignore[attr-defined]
    assert finished["a"].num_output_tokens == 8  # type: ignore[attr-defined]
    admitted = {r.req_id for r in _records(caplog, "request admitted")}  # type: ignore[attr-defined]
    assert admitted == {"a", "b"}

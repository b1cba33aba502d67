"""Poison requests (services/scheduler/poison.py): a request that crashes the worker at every
attempt is ended after ``max_request_crashes`` consecutive crashes; the others continue,
because suspects of a crash are re-admitted one at a time."""

from __future__ import annotations

import pytest

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config


def run_with_poison(poison: str, max_request_crashes: int, names: list[str]) -> tuple[Driver, int]:
    """Step until done; any step that schedules ``poison`` "crashes the worker" instead."""
    config = small_config(max_request_crashes=max_request_crashes)
    sched = Scheduler(config, 64, 256, clock=FakeClock())
    drv = Driver(sched, FakeWorker(config.block_size, 64))
    for name in names:
        assert sched.add_request(make_request(name, 12, max_tokens=6)) is None
    crashes = 0
    for _ in range(500):
        if not sched.has_unfinished_requests():
            return drv, crashes
        plan = sched.schedule()
        if poison in plan.num_scheduled_tokens:
            crashes += 1
            drv.worker.step(plan)  # the surviving rank's view; the step's result is lost
            sched.preempt_all()  # what the service does when a rank dies
            drv.collect()
            sched.check_invariants()
            continue
        sched.update_from_result(plan, drv.worker.step(plan))
        drv.collect()
        sched.check_invariants()
    raise AssertionError("requests still unfinished")


def test_the_poison_request_ends_with_an_error_and_the_others_finish() -> None:
    names = ["a", "b", "c", "d"]
    drv, crashes = run_with_poison("c", 2, names)
    assert crashes == 2
    out = drv.outcomes["c"]
    assert out.finish_reason == "error" and out.token_ids == []
    assert "crashed 2 times in a row" in (out.deltas[-1].error or "")
    for name in ("a", "b", "d"):
        assert drv.outcomes[name].finish_reason == "length"
        assert drv.outcomes[name].token_ids == expected_tokens(name, 12, 6)
    assert drv.sched.ledger.num_free_blocks == drv.sched.ledger.num_total_blocks
    assert not drv.sched.suspects


@pytest.mark.parametrize("limit", [2, 3])
def test_the_limit_is_the_number_of_crashes(limit: int) -> None:
    drv, crashes = run_with_poison("b", limit, ["a", "b"])
    assert crashes == limit  # a mutation to > or an off-by-one crashes once more (or less)
    assert drv.outcomes["b"].finish_reason == "error" and drv.outcomes["a"].finish_reason == "length"


def test_a_limit_of_one_ends_everything_present_at_the_crash() -> None:
    """No second crash to tell them apart: every request present is ended (documented)."""
    drv, crashes = run_with_poison("b", 1, ["a", "b"])
    assert crashes == 1
    assert drv.outcomes["a"].finish_reason == "error" and drv.outcomes["b"].finish_reason == "error"


def test_zero_never_ends_a_request_for_crashes() -> None:
    config = small_config(max_request_crashes=0)
    sched = Scheduler(config, 64, 256, clock=FakeClock())
    sched.add_request(make_request("a", 12, max_tokens=6))
    sched.schedule()
    for _ in range(5):
        sched.preempt_all()
    assert "a" in sched.requests and not sched.suspects

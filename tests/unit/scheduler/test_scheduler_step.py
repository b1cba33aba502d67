"""The step as data: ``StepBuilder`` decides over the collaborators it is given and
changes none of the scheduler's state but the ledger; ``Scheduler`` applies the value.
Also the waiting queues' reads in policy order that the builder uses."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.queues import FCFSQueue, PriorityQueue
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.step import StepBuilder
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, make_request, small_config


def _builder(sched: Scheduler) -> StepBuilder:
    return StepBuilder(sched.config, sched.ledger, sched.running, sched.waiting, sched.suspects, sched.clock())


def _state(sched: Scheduler) -> tuple[object, ...]:
    reqs = [(r.req_id, r.status, r.num_computed_tokens, r.num_token_slots, r.num_preemptions, r.known_to_worker)
            for r in [*sched.running, *sched.waiting]]
    return ([r.req_id for r in sched.running], [r.req_id for r in sched.waiting], sched.num_waiting_tokens,
            reqs, sched.counters.num_preemptions, sched.counters.prefix_cache_queries)


def test_the_builder_returns_a_frozen_decision_and_leaves_the_scheduler_alone() -> None:
    clock = FakeClock()
    sched = Scheduler(small_config(block_size=4, max_num_batched_tokens=16, max_num_seqs=2), 64, 64, clock=clock)
    for rid in ("a", "b", "c"):
        assert sched.add_request(make_request(rid, 6)) is None
    before = _state(sched)
    free_before = sched.ledger.num_free_blocks
    decision = _builder(sched).decide()
    assert _state(sched) == before, "deciding must not move requests or count anything"
    assert sched.ledger.num_free_blocks == free_before - 4, "the ledger holds what the decision allocated"
    assert [a.req.req_id for a in decision.admitted] == ["a", "b"]  # max_num_seqs=2
    assert dict(decision.num_scheduled_tokens) == {"a": 6, "b": 6}
    assert decision.preempted == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.admitted = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.admitted[0].num_blocks = 0  # type: ignore[misc]


def test_preemption_is_decided_and_applied_only_by_the_scheduler() -> None:
    """Two requests fill a four-block ledger; when ``a`` needs a third block, the later
    arrival ``b`` is the victim."""
    config = small_config(block_size=2, max_num_batched_tokens=8, max_num_seqs=2)
    sched = Scheduler(config, 4, 64, clock=FakeClock())
    drv = Driver(sched, FakeWorker(config.block_size, 4))
    for rid in ("a", "b"):
        assert sched.add_request(make_request(rid, 4, max_tokens=4)) is None
    drv.step()  # both prompts computed, one token sampled each: every block taken
    before = _state(sched)
    decision = _builder(sched).decide()
    assert _state(sched) == before
    (victim,) = decision.preempted
    assert victim.req_id == "b" and victim.status is RequestStatus.RUNNING
    assert "b" not in sched.ledger.block_tables, "the builder freed the victim's blocks to grow a"
    assert dict(decision.num_scheduled_tokens) == {"a": 1}
    assert [(req.req_id, n) for req, n in decision.grown] == [("a", 1)]
    sched._apply(decision)
    assert victim.status is RequestStatus.WAITING and victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1 and sched.counters.num_preemptions == 1
    assert [r.req_id for r in sched.running] == ["a"] and [r.req_id for r in sched.waiting] == ["b"]
    assert sched.running[0].num_token_slots == 6
    sched.check_invariants()


def _requests(priorities: list[int]) -> list[Request]:
    return [Request(make_request(f"r{i}", 2, priority=p), i, 0.0, float("inf"), 64) for i, p in enumerate(priorities)]


@pytest.mark.parametrize("queue_type", [FCFSQueue, PriorityQueue])
def test_in_order_is_pop_order_without_popping(queue_type: type[FCFSQueue] | type[PriorityQueue]) -> None:
    reqs = _requests([3, 1, 2, 1, 0, 2, 3, 0, 1])
    queue = queue_type()
    for req in reqs:
        queue.push(req)
    for dead in (reqs[0], reqs[4], reqs[5]):  # aborted: removed lazily
        dead.status = RequestStatus.FINISHED
        queue.discard(dead)
    seen = list(queue.in_order())
    assert len(queue) == 6 and [r.req_id for r in queue] == [r.req_id for r in seen]
    assert seen == [queue.pop() for _ in range(len(queue))]


@given(priorities=st.lists(st.integers(0, 4), max_size=60), dead=st.sets(st.integers(0, 59)),
       fcfs=st.booleans())
def test_in_order_is_pop_order_for_any_queue(priorities: list[int], dead: set[int], fcfs: bool) -> None:
    reqs = _requests(priorities)
    queue: FCFSQueue | PriorityQueue = FCFSQueue() if fcfs else PriorityQueue()
    for req in reqs:
        queue.push(req)
    for i in sorted(dead & set(range(len(reqs)))):
        reqs[i].status = RequestStatus.FINISHED
        queue.discard(reqs[i])
    seen = [r.req_id for r in queue.in_order()]
    assert seen == [queue.pop().req_id for _ in range(len(queue))]


def test_a_pushed_back_request_goes_first_in_fcfs_and_by_its_key_under_priority() -> None:
    important, late = _requests([0, 5])
    assert FCFSQueue().pushed_back_before(late, important)
    assert PriorityQueue().pushed_back_before(important, late)
    assert not PriorityQueue().pushed_back_before(late, important)

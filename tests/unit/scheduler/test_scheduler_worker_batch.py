"""The scheduler's plans are accepted by the real worker's batch state (services/worker/batch.py).

The fake worker mirrors the worker's semantics; this test feeds the same plans to
the worker's own ``BatchState`` too (no model, no torch), so a drift between the
two sides of the plan contract fails here rather than in a cluster test.
"""

from __future__ import annotations

import pytest

from services.scheduler.scheduler import Scheduler
from services.worker.batch import BatchState
from shared.messages import StepPlan, StepResult
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config


class MirroredWorker(FakeWorker):
    """The checking fake worker, with the real BatchState following every plan beside it."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        super().__init__(block_size, num_blocks)
        self.batch = BatchState(block_size)

    def step(self, plan: StepPlan) -> StepResult:
        self.batch.apply(plan)  # raises on a plan the worker would reject
        result = super().step(plan)
        sampled = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
        for req_id, n in plan.num_scheduled_tokens.items():
            state = self.batch.requests[req_id]
            fake = self.requests[req_id]
            assert state.block_ids == fake.block_ids
            state.num_computed_tokens += n
            if req_id in sampled:
                state.append_token(sampled[req_id])
            assert state.token_ids == fake.token_ids and state.num_computed_tokens == fake.num_computed_tokens
        assert set(self.batch.requests) == set(self.requests)
        return result

    def restart(self) -> None:
        super().restart()
        self.batch = BatchState(self.block_size)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_plans_fit_the_worker_batch_state_through_preemption_prefix_hits_and_restarts(policy: str) -> None:
    # Poison-request isolation (re-admitting a crash's survivors one at a time) is off here: this test
    # wants the full batch back after the restart, so memory pressure preempts (test_scheduler_poison covers it).
    config = small_config(max_num_batched_tokens=24, max_num_seqs=4, scheduling_policy=policy, max_request_crashes=0)
    sched = Scheduler(config, 20, 256, clock=FakeClock())
    worker = MirroredWorker(config.block_size, 20)
    drv = Driver(sched, worker)
    shared = list(range(900, 912))
    want = {}
    for i in range(8):
        rid = f"r{i}"
        prompt = shared + [i] * (i + 1)
        sched.add_request(make_request(rid, prompt, max_tokens=10 + i, priority=i % 3))
        want[rid] = expected_tokens(rid, len(prompt), 10 + i)
    for step in range(12):
        if step == 6:
            sched.abort_requests(["r3"])
        if step == 8:
            sched.preempt_all()
            worker.restart()
        drv.step()
    drv.run()
    assert sched.stats().num_preemptions_total > 0
    assert sched.stats().prefix_cache_hits_total > 0
    for rid, tokens in want.items():
        out = drv.outcomes[rid]
        if rid == "r3":
            assert out.finish_reason == "abort"
        else:
            assert out.token_ids == tokens
    # the last finishes reach the worker in the next plan, which then leaves it holding nothing
    last = sched.schedule()
    assert last.total_num_scheduled_tokens == 0 and last.finished_req_ids
    worker.batch.apply(last)
    assert len(worker.batch) == 0

"""Async scheduling: plan N+1 is made before result N comes back, with identical outputs.

``AsyncDriver`` runs the scheduler the way the service does with
``--async-scheduling``: schedule and send a plan, schedule and send the next one,
then apply the older result. The checking fake worker (KV contents, block
ownership, plan/worker computed-count agreement) and the real worker's
``BatchState`` follow every plan. Outputs must equal the synchronous run's token
for token, every block must be free at the end, and the ledger invariants hold
after every step, also under preemption, stops, aborts and prefix-cache hits.
"""

from __future__ import annotations

from collections import deque

import pytest

from services.scheduler.scheduler import Scheduler
from shared.messages import StepPlan, StepResult
from tests.scheduler_fakes import Driver, FakeClock, expected_tokens, make_request, small_config
from tests.unit.scheduler.test_scheduler_worker_batch import MirroredWorker


class AsyncDriver(Driver):
    """Keeps up to two plans in flight; the worker runs them in order, one result behind."""

    def __init__(self, sched: Scheduler, worker: MirroredWorker) -> None:
        super().__init__(sched, worker)
        self.in_flight: deque[tuple[StepPlan, StepResult]] = deque()
        self.num_wasted = 0  # tokens computed for requests that had already finished
        self.num_overlapped = 0  # plans sent ahead that continue a request of the plan in flight

    def _send(self) -> bool:
        plan = self.sched.schedule()
        assert plan.total_num_scheduled_tokens <= self.sched.config.max_num_batched_tokens
        if not plan.total_num_scheduled_tokens:
            if plan.finished_req_ids or plan.preempted_req_ids:
                self.worker.step(plan)  # the workers still drop those ids
            self.sched.update_from_result(plan, StepResult(step_id=plan.step_id, rank=0))
            return False
        self.plans.append(plan)
        # The worker runs plans in arrival order: computing now is the same as later.
        self.in_flight.append((plan, self.worker.step(plan)))
        return True

    def step(self) -> StepPlan:
        if not self.in_flight:
            self._send()
        if len(self.in_flight) == 1 and self.sched.has_unfinished_requests():
            before = set(self.in_flight[0][0].num_scheduled_tokens)
            if self._send():  # plan N+1 before result N: the overlap
                self.num_overlapped += bool(before & set(self.in_flight[1][0].num_scheduled_tokens))
        plan, result = self.in_flight.popleft()
        live = {r for r in plan.num_scheduled_tokens if r in self.sched.requests}
        self.num_wasted += len(plan.num_scheduled_tokens) - len(live)
        self.sched.update_from_result(plan, result)
        self.collect()
        self.sched.check_invariants()
        return plan

    def run(self, max_steps: int = 10_000) -> int:
        for i in range(max_steps):
            if not self.sched.has_unfinished_requests() and not self.in_flight:
                return i
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run_both(requests: list, num_blocks: int = 64, aborts: dict[int, list[str]] | None = None,
             **config: object) -> tuple[Driver, AsyncDriver]:
    drivers: list[Driver] = []
    for cls in (Driver, AsyncDriver):
        cfg = small_config(**config)
        sched = Scheduler(cfg, num_blocks, max_model_len=256, clock=FakeClock())
        worker = MirroredWorker(cfg.block_size, num_blocks)
        driver = cls(sched, worker)  # type: ignore[arg-type]
        for req in requests:
            assert sched.add_request(req) is None
        for i in range(10_000):
            if not sched.has_unfinished_requests() and not getattr(driver, "in_flight", None):
                break
            for req_id in (aborts or {}).get(i, []):
                sched.abort_requests([req_id])
            driver.step()
        # Everything finished: every block is back, nothing is left in flight.
        assert sched.ledger.num_free_blocks == num_blocks, "blocks leaked"
        assert not sched.requests and not sched.running
        sched.check_invariants()
        drivers.append(driver)
    return drivers[0], drivers[1]  # type: ignore[return-value]


def tokens(driver: Driver) -> dict[str, tuple[list[int], str | None]]:
    return {k: (o.token_ids, o.finish_reason) for k, o in driver.outcomes.items()}


def test_decodes_overlap_and_match_the_synchronous_run() -> None:
    reqs = [make_request(f"r{i}", 5 + 3 * i, max_tokens=6 + i, ignore_eos=True) for i in range(6)]
    sync, async_ = run_both(reqs)
    assert tokens(async_) == tokens(sync)
    for req in reqs:
        assert sync.outcomes[req.req_id].token_ids == expected_tokens(req.req_id, len(req.prompt_token_ids),
                                                                      req.stop.max_tokens)
    # Length limits are known ahead: no decode is computed past max_tokens.
    assert async_.num_wasted == 0
    # The same steps, each decode planned while the previous one was in flight.
    assert len(async_.plans) == len(sync.plans)
    assert async_.num_overlapped >= len(async_.plans) - 2


def test_a_stop_token_costs_one_discarded_token_and_nothing_else() -> None:
    stop = expected_tokens("s0", 7, 20)[3]  # the fourth output token of s0 is a stop id
    reqs = [make_request("s0", 7, max_tokens=20, stop_ids=[stop]),
            make_request("s1", 9, max_tokens=10, ignore_eos=True)]
    sync, async_ = run_both(reqs)
    assert tokens(async_) == tokens(sync)
    assert sync.outcomes["s0"].finish_reason == "stop" and len(sync.outcomes["s0"].token_ids) == 4
    assert async_.num_wasted == 1  # s0's fifth token was computed, then dropped


def test_chunked_prefill_and_prefix_hits_match() -> None:
    shared = list(range(500, 532))  # 8 full blocks of 4
    reqs = [make_request(f"p{i}", shared + [900 + i] * (3 + i), max_tokens=5, ignore_eos=True) for i in range(4)]
    reqs.append(make_request("long", 70, max_tokens=4, ignore_eos=True))  # longer than the 64-token budget
    sync, async_ = run_both(reqs, long_prefill_token_threshold=16)
    assert tokens(async_) == tokens(sync)


@pytest.mark.parametrize("num_blocks", [12, 16])
def test_preemption_under_block_pressure_matches(num_blocks: int) -> None:
    reqs = [make_request(f"q{i}", 6, max_tokens=14, ignore_eos=True) for i in range(5)]
    sync, async_ = run_both(reqs, num_blocks=num_blocks)
    assert tokens(async_) == tokens(sync)
    for req in reqs:
        assert async_.outcomes[req.req_id].finish_reason == "length"
    assert async_.sched.counters.num_preemptions > 0, "the test meant to preempt"


def test_aborts_while_a_plan_is_in_flight_free_everything() -> None:
    reqs = [make_request(f"a{i}", 5, max_tokens=30, ignore_eos=True) for i in range(4)]
    sync, async_ = run_both(reqs, aborts={3: ["a1"], 6: ["a2", "a3"]})
    for driver in (sync, async_):
        assert driver.outcomes["a1"].finish_reason == "abort"
        assert driver.outcomes["a0"].finish_reason == "length"
    assert tokens(async_)["a0"] == tokens(sync)["a0"]

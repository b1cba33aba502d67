"""Preemption by recompute: victims, counting, priority seats, worker restarts; outputs never change."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config


def make(num_blocks: int, max_model_len: int = 512, **cfg: object) -> tuple[Scheduler, Driver]:
    config = small_config(**cfg)
    sched = Scheduler(config, num_blocks, max_model_len, clock=FakeClock())
    return sched, Driver(sched, FakeWorker(config.block_size, num_blocks))


def run_workload(num_blocks: int, **cfg: object) -> tuple[Driver, Scheduler]:
    sched, drv = make(num_blocks, **cfg)
    for i in range(6):
        assert sched.add_request(make_request(f"r{i}", 6 + i, max_tokens=20 + 3 * i, priority=i % 3)) is None
    drv.run()
    return drv, sched


def test_preemption_under_a_small_kv_budget_keeps_every_output_identical() -> None:
    roomy, roomy_sched = run_workload(num_blocks=200)
    tight, tight_sched = run_workload(num_blocks=14)  # one request needs up to 9 blocks
    assert roomy_sched.stats().num_preemptions_total == 0
    stats = tight_sched.stats()
    assert stats.num_preemptions_total > 0
    assert sum(o.deltas[-1].timings.num_preemptions for o in tight.outcomes.values()) == stats.num_preemptions_total  # type: ignore[union-attr]
    assert any(p.preempted_req_ids for p in tight.plans)
    assert any(p.resumed_requests for p in tight.plans)
    for i in range(6):
        rid = f"r{i}"
        want = expected_tokens(rid, 6 + i, 20 + 3 * i)
        assert roomy.outcomes[rid].token_ids == want
        assert tight.outcomes[rid].token_ids == want, f"{rid} changed under preemption"
        assert tight.outcomes[rid].finish_reason == "length"
    assert tight_sched.ledger.num_free_blocks == 14


def test_fcfs_victim_is_the_latest_arrival_and_resumes_with_its_outputs() -> None:
    sched, drv = make(num_blocks=6, block_size=4)
    sched.add_request(make_request("early", 4, max_tokens=12))
    sched.add_request(make_request("late", 4, max_tokens=12))
    victim_plan = None
    for _ in range(40):
        plan = drv.step()
        if plan.preempted_req_ids:
            victim_plan = plan
            break
    assert victim_plan is not None and victim_plan.preempted_req_ids == ["late"]
    assert victim_plan.num_scheduled_tokens.get("early") == 1
    resumed = None
    while resumed is None:
        plan = drv.step()
        resumed = next((r for r in plan.resumed_requests if r.req_id == "late"), None)
    # the resuming step recomputed everything in one chunk and sampled one more token
    assert resumed.output_token_ids == drv.outcomes["late"].token_ids[:-1]
    assert resumed.output_token_ids
    assert resumed.num_computed_tokens % 4 == 0
    drv.run()
    assert drv.outcomes["late"].token_ids == expected_tokens("late", 4, 12)
    assert drv.outcomes["early"].token_ids == expected_tokens("early", 4, 12)


def test_priority_victim_is_the_least_important_even_if_it_arrived_first() -> None:
    sched, drv = make(num_blocks=6, block_size=4, scheduling_policy="priority")
    sched.add_request(make_request("low", 4, max_tokens=12, priority=5))
    sched.add_request(make_request("high", 4, max_tokens=12, priority=0))
    preempted = [rid for _ in range(40) for rid in drv.step().preempted_req_ids]
    assert preempted and set(preempted) == {"low"}
    drv.run()
    assert drv.outcomes["low"].token_ids == expected_tokens("low", 4, 12)


def test_high_priority_request_takes_a_seat_when_max_num_seqs_is_full() -> None:
    sched, drv = make(num_blocks=64, max_num_seqs=2, scheduling_policy="priority")
    sched.add_request(make_request("bg1", 4, max_tokens=30, priority=5))
    sched.add_request(make_request("bg2", 4, max_tokens=30, priority=5))
    drv.step()
    drv.step()
    sched.add_request(make_request("vip", 4, max_tokens=3, priority=0))
    plan = drv.step()
    assert plan.preempted_req_ids == ["bg2"]  # same priority: the later arrival goes
    assert [r.req_id for r in plan.new_requests] == ["vip"]
    assert sorted(plan.num_scheduled_tokens) == ["bg1", "vip"]
    assert sched.num_running == 2
    drv.run()
    assert drv.outcomes["vip"].token_ids == expected_tokens("vip", 4, 3)
    assert drv.outcomes["bg2"].token_ids == expected_tokens("bg2", 4, 30)
    assert drv.outcomes["bg2"].deltas[-1].timings.num_preemptions == 1  # type: ignore[union-attr]


def test_equal_priority_never_preempts_for_a_seat() -> None:
    sched, drv = make(num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    sched.add_request(make_request("a", 4, max_tokens=5, priority=1))
    drv.step()
    sched.add_request(make_request("b", 4, max_tokens=5, priority=1))
    plan = drv.step()
    assert not plan.preempted_req_ids and plan.num_scheduled_tokens == {"a": 1}


def test_fcfs_never_preempts_for_a_waiting_request() -> None:
    sched, drv = make(num_blocks=64, max_num_seqs=1)
    sched.add_request(make_request("a", 4, max_tokens=5, priority=9))
    drv.step()
    sched.add_request(make_request("b", 4, max_tokens=5, priority=0))
    plan = drv.step()
    # "a" keeps its seat and decodes; "b" (a better priority number, ignored by fcfs) waits.
    assert not plan.preempted_req_ids and plan.num_scheduled_tokens == {"a": 1}
    assert sched.num_waiting == 1


def test_high_priority_request_preempts_for_blocks() -> None:
    sched, drv = make(num_blocks=8, block_size=4, scheduling_policy="priority")
    sched.add_request(make_request("bg", 28, max_tokens=4, priority=5))  # 7 of 8 blocks
    drv.step()
    sched.add_request(make_request("vip", 8, max_tokens=2, priority=0))  # needs 2 blocks
    plan = drv.step()
    assert plan.preempted_req_ids == ["bg"]
    assert plan.num_scheduled_tokens == {"vip": 8}
    drv.run()
    assert drv.outcomes["bg"].token_ids == expected_tokens("bg", 28, 4)


def test_preempt_all_recomputes_everything_after_a_worker_restart() -> None:
    sched, drv = make(num_blocks=64)
    shared = list(range(500, 516))
    sched.add_request(make_request("a", shared + [1, 2], max_tokens=10))
    sched.add_request(make_request("b", 30, max_tokens=10))
    for _ in range(4):
        drv.step()
    sched.abort_requests(["b"])  # its id is pending for the old worker
    sched.preempt_all()
    drv.worker.restart()
    sched.check_invariants()
    assert sched.num_running == 0 and sched.num_waiting == 1
    assert sched.ledger.num_cached_blocks == 0  # the new worker holds no KV to hit
    plan = drv.step()
    # ranks that did not restart must drop them; a restarted one ignores unknown ids
    assert plan.finished_req_ids == ["b"] and plan.preempted_req_ids == ["a"]
    assert [r.req_id for r in plan.resumed_requests] == ["a"]
    assert plan.resumed_requests[0].num_computed_tokens == 0
    assert plan.resumed_requests[0].output_token_ids == drv.outcomes["a"].token_ids[:-1]
    drv.run()
    assert drv.outcomes["a"].token_ids == expected_tokens("a", 18, 10)
    assert drv.outcomes["b"].finish_reason == "abort"


def test_result_of_a_step_abandoned_by_preempt_all_is_ignored() -> None:
    sched, drv = make(num_blocks=64)
    sched.add_request(make_request("a", 5, max_tokens=4))
    plan = sched.schedule()
    result = drv.worker.step(plan)
    sched.preempt_all()
    drv.worker.restart()
    sched.update_from_result(plan, result)  # late answer from the dead worker
    sched.check_invariants()
    assert sched.take_deltas() == {}
    drv.run()
    assert drv.outcomes["a"].token_ids == expected_tokens("a", 5, 4)

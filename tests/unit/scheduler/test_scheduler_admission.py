"""Admission, refusals, queue timeouts, aborts, deltas per gateway, and stats."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, make_request, small_config


def make(num_blocks: int = 64, max_model_len: int = 128, **cfg: object) -> tuple[Scheduler, Driver, FakeClock]:
    config = small_config(**cfg)
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, max_model_len, clock=clock)
    return sched, Driver(sched, FakeWorker(config.block_size, num_blocks)), clock


def test_too_long_names_the_limit_and_the_request() -> None:
    sched, _, _ = make(max_model_len=100)
    rej = sched.add_request(make_request("a", 90, max_tokens=20))
    assert rej is not None and rej.reason == "too_long"
    assert "100" in rej.message and "110" in rej.message and "90" in rej.message
    assert sched.add_request(make_request("b", 90, max_tokens=10)) is None


def test_too_long_for_the_whole_kv_cache() -> None:
    sched, _, _ = make(num_blocks=4, max_model_len=1000)  # 16 tokens of KV
    rej = sched.add_request(make_request("a", 10, max_tokens=7))
    assert rej is not None and rej.reason == "too_long" and "16" in rej.message
    assert sched.add_request(make_request("b", 10, max_tokens=6)) is None


def test_invalid_requests() -> None:
    sched, _, _ = make()
    assert sched.add_request(make_request("a", 4)) is None
    dup = sched.add_request(make_request("a", 4))
    assert dup is not None and dup.reason == "invalid" and "'a'" in dup.message
    empty = sched.add_request(make_request("e", []))
    assert empty is not None and empty.reason == "invalid"
    zero = sched.add_request(make_request("z", 4, max_tokens=0))
    assert zero is not None and zero.reason == "invalid"
    assert sched.num_waiting == 1
    assert sched.stats().rejected_total == {"invalid": 3}


def test_queue_full_refuses_with_retry_after_from_the_drain_rate() -> None:
    sched, drv, clock = make(max_waiting_requests=2, max_num_seqs=1)
    assert sched.add_request(make_request("a", 4, max_tokens=1)) is None
    assert sched.add_request(make_request("b", 4, max_tokens=1)) is None
    rej = sched.add_request(make_request("c", 4))
    assert rej is not None and rej.reason == "queue_full" and "2" in rej.message
    assert rej.retry_after_s is not None and rej.retry_after_s > 0
    for _ in range(2):  # two requests leave the queue, 2 s apart
        clock.advance(2.0)
        drv.step()
    assert sched.num_waiting == 0
    for rid in ("d", "e"):
        assert sched.add_request(make_request(rid, 4)) is None
    rej = sched.add_request(make_request("f", 4))
    assert rej is not None and rej.reason == "queue_full"
    rate = sched.stats().drain_rate_rps
    assert 0 < rate <= 1.0
    assert rej.retry_after_s == round(max(1.0, 2 / rate), 1)


def test_waiting_tokens_bound() -> None:
    sched, _, _ = make(max_waiting_tokens=10, max_model_len=512, num_blocks=128)
    assert sched.add_request(make_request("a", 20)) is None  # an empty queue takes any prompt
    rej = sched.add_request(make_request("b", 1))
    assert rej is not None and rej.reason == "queue_tokens_full"
    assert sched.stats().rejected_total == {"queue_tokens_full": 1}


def test_queue_timeout_expires_only_requests_that_never_started() -> None:
    sched, drv, clock = make(max_num_seqs=1, queue_timeout_s=5.0)
    sched.add_request(make_request("runs", 4, max_tokens=50))
    sched.add_request(make_request("waits", 4, max_tokens=5))
    sched.add_request(make_request("short", 4, max_tokens=5, queue_timeout_s=0.1))  # floored at 1 s
    drv.step()
    clock.advance(0.5)
    drv.step()
    assert "short" not in drv.outcomes
    clock.advance(0.6)
    drv.step()
    assert drv.outcomes["short"].finish_reason == "timeout"
    clock.advance(4.0)
    drv.step()
    out = drv.outcomes["waits"]
    assert out.finish_reason == "timeout" and out.token_ids == []
    assert out.deltas[0].error and "queue" in out.deltas[0].error
    assert "runs" not in drv.outcomes or drv.outcomes["runs"].finish_reason is None
    assert sched.num_waiting == 0 and sched.stats().finished_total == {"timeout": 2}


def test_abort_frees_blocks_now_and_tells_worker_and_gateway() -> None:
    sched, drv, _ = make()
    sched.add_request(make_request("r", 10, max_tokens=20))
    sched.add_request(make_request("w", 10, max_tokens=20, gateway_id="g1"))
    sched.add_request(make_request("keep", 3, max_tokens=3))
    drv.step()
    sched.add_request(make_request("late", 10, max_tokens=20))
    assert sched.ledger.num_used_blocks > 0
    sched.abort_requests(["r", "late", "nope"])
    assert sched.ledger.block_tables.keys() == {"w", "keep"}
    sched.check_invariants()
    deltas = sched.take_deltas()
    assert [(d.req_id, d.finish_reason) for d in deltas["g0"]] == [("r", "abort"), ("late", "abort")]
    plan = drv.step()
    assert plan.finished_req_ids == ["r"]  # "late" never reached the worker
    assert "r" not in drv.worker.requests
    assert sched.abort_gateway("g1") == 1
    assert [(d.req_id, d.finish_reason) for d in sched.take_deltas()["g1"]] == [("w", "abort")]
    assert sched.abort_gateway("g1") == 0
    drv.run()
    assert sched.stats().finished_total == {"abort": 3, "length": 1}


def test_abort_while_the_step_runs_is_tolerated() -> None:
    sched, drv, _ = make()
    sched.add_request(make_request("a", 5, max_tokens=5))
    sched.add_request(make_request("b", 5, max_tokens=5))
    plan = sched.schedule()
    result = drv.worker.step(plan)
    sched.abort_requests(["a"])
    sched.update_from_result(plan, result)
    sched.check_invariants()
    deltas = sched.take_deltas()["g0"]
    assert [(d.req_id, d.finish_reason, d.new_token_ids) for d in deltas][0] == ("a", "abort", [])
    assert deltas[1].req_id == "b" and len(deltas[1].new_token_ids) == 1
    assert sched.schedule().finished_req_ids == ["a"]


def test_missing_token_in_a_result_ends_that_request_with_an_error() -> None:
    sched, drv, _ = make()
    sched.add_request(make_request("a", 5, max_tokens=5))
    sched.add_request(make_request("b", 5, max_tokens=5))
    plan = sched.schedule()
    result = drv.worker.step(plan)
    from msgspec.structs import replace

    result = replace(result, req_ids=result.req_ids[1:], sampled_token_ids=result.sampled_token_ids[1:])
    sched.update_from_result(plan, result)
    deltas = {d.req_id: d for d in sched.take_deltas()["g0"]}
    assert deltas["a"].finish_reason == "error" and deltas["a"].error
    assert deltas["b"].finish_reason is None
    sched.check_invariants()


def test_stats_fill_queues_kv_and_tokens() -> None:
    sched, drv, clock = make(max_num_seqs=2, scheduling_policy="priority")
    sched.add_request(make_request("a", 8, max_tokens=3, priority=0))
    sched.add_request(make_request("b", 8, max_tokens=3, priority=1))
    sched.add_request(make_request("c", 8, max_tokens=3, priority=2))
    clock.advance(1.0)
    drv.step()
    s = sched.stats()
    assert (s.num_running, s.num_waiting) == (2, 1)
    assert s.num_running_by_priority == {0: 1, 1: 1} and s.num_waiting_by_priority == {2: 1}
    assert s.num_kv_blocks_total == 64 and s.num_kv_blocks_free == 64 - 4
    assert abs(s.kv_usage - 4 / 64) < 1e-9
    assert s.step_num_tokens == [16] and s.step_num_seqs == [2] and len(s.step_duration_s) == 1
    assert [r.req_id for r in s.running] == ["a", "b"] and s.waiting[0].req_id == "c"
    assert s.waiting[0].age_s == 1.0
    assert s.prompt_tokens_total == 16 and s.generation_tokens_total == 2
    assert s.config["max_num_seqs"] == "2" and s.config["num_kv_blocks"] == "64"
    assert sched.stats().step_num_tokens == []  # samples are taken once
    drv.run()
    s = sched.stats()
    assert s.finished_total == {"length": 3} and s.generation_tokens_total == 9
    assert s.steps_total == len([p for p in drv.plans if p.total_num_scheduled_tokens])
    assert s.num_kv_blocks_free == 64 and s.num_running == 0


def test_timings_of_a_request() -> None:
    sched, drv, clock = make()
    sched.add_request(make_request("a", 4, max_tokens=2, arrival_time=999.0))
    clock.advance(1.0)
    drv.step()
    clock.advance(1.0)
    drv.step()
    first, last = drv.outcomes["a"].deltas
    assert first.timings is not None and last.timings is not None
    assert first.timings.arrival_time == 999.0
    assert first.timings.first_scheduled_time == 1001.0 and first.timings.first_token_time == 1001.0
    assert last.timings.finished_time == 1002.0 and last.finish_reason == "length"


def test_aborted_and_started_requests_do_not_pile_up_in_the_queues() -> None:
    from services.scheduler.queues import COMPACT_SLACK

    for policy in ("fcfs", "priority"):
        sched, drv, _ = make(max_num_seqs=1, queue_timeout_s=60.0, scheduling_policy=policy, max_waiting_requests=5000)
        sched.add_request(make_request("head", 4, max_tokens=100))
        drv.step()
        sched.add_request(make_request("blocked", 4, max_tokens=1))
        for i in range(3 * COMPACT_SLACK):
            sched.add_request(make_request(f"x{i}", 4, max_tokens=1))
            sched.abort_requests([f"x{i}"])
        assert sched.num_waiting == 1
        assert len(list(sched.waiting)) == 1
        # dead entries are bounded: the structures were rebuilt without them
        assert len(sched.deadlines) <= 2 + COMPACT_SLACK + 1
        assert len(getattr(sched.waiting, "_q", getattr(sched.waiting, "_heap", []))) <= 2 * 1 + COMPACT_SLACK + 1
        sched.check_invariants()

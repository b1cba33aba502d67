"""Basic scheduler behaviour: requests run to completion with the right tokens and deltas."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config


def make(num_blocks: int = 64, max_model_len: int = 256, **cfg: object) -> tuple[Scheduler, Driver, FakeClock]:
    config = small_config(**cfg)
    clock = FakeClock()
    sched = Scheduler(config, num_blocks, max_model_len, clock=clock)
    worker = FakeWorker(config.block_size, num_blocks)
    return sched, Driver(sched, worker), clock


def test_single_request_produces_expected_tokens_and_frees_blocks() -> None:
    sched, drv, _ = make()
    assert sched.add_request(make_request("a", 10, max_tokens=5)) is None
    steps = drv.run()
    assert steps == 5  # one prefill step samples the first token, then four decodes
    out = drv.outcomes["a"]
    assert out.token_ids == expected_tokens("a", 10, 5)
    assert out.finish_reason == "length"
    first = out.deltas[0]
    assert first.num_prompt_tokens == 10 and first.timings is not None
    assert first.timings.first_token_time is not None
    assert out.deltas[-1].timings is not None and out.deltas[-1].timings.finished_time is not None
    assert sched.ledger.num_free_blocks == sched.ledger.num_total_blocks
    assert not sched.has_unfinished_requests()


def test_first_plan_carries_new_request_then_differences() -> None:
    sched, drv, _ = make()
    sched.add_request(make_request("a", 6, max_tokens=4))
    p1 = drv.step()
    assert [r.req_id for r in p1.new_requests] == ["a"]
    assert p1.new_requests[0].block_ids == [0, 1]  # 6 tokens, block_size 4
    assert p1.num_scheduled_tokens == {"a": 6}
    p2 = drv.step()
    assert not p2.new_requests
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens) for c in p2.cached_requests] == [("a", [], 6)]
    assert p2.num_scheduled_tokens == {"a": 1}
    p3 = drv.step()  # token 8 needs no new block; 7 computed
    assert p3.cached_requests[0].num_computed_tokens == 7
    p4 = drv.step()  # the 9th token needs a third block
    assert p4.cached_requests[0].new_block_ids == [2]
    drv.run()
    last = sched.schedule()
    assert last.finished_req_ids == ["a"]


def test_eos_stops_unless_ignored_and_respects_min_tokens() -> None:
    sched, drv, _ = make()
    toks = expected_tokens("e", 5, 10)
    eos = toks[2]
    sched.add_request(make_request("e", 5, max_tokens=10, eos=[eos]))
    sched.add_request(make_request("f", 5, max_tokens=10, eos=[expected_tokens("f", 5, 10)[2]], ignore_eos=True))
    sched.add_request(make_request("g", 5, max_tokens=10, stop_ids=[expected_tokens("g", 5, 10)[1]], min_tokens=3))
    drv.run()
    assert drv.outcomes["e"].token_ids == toks[:3]
    assert drv.outcomes["e"].finish_reason == "stop"
    assert drv.outcomes["e"].deltas[-1].stop_token_id == eos
    assert len(drv.outcomes["f"].token_ids) == 10 and drv.outcomes["f"].finish_reason == "length"
    # the stop id at position 2 comes before min_tokens=3, so it does not stop there
    g = drv.outcomes["g"].token_ids
    assert len(g) > 2 and g[:2] == expected_tokens("g", 5, 10)[:2]

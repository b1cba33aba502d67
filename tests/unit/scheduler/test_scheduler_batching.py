"""Continuous batching and chunked prefill: who runs in which step, and the budget."""

from __future__ import annotations

from services.scheduler.scheduler import Scheduler
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config


def make(num_blocks: int = 64, max_model_len: int = 512, **cfg: object) -> tuple[Scheduler, Driver]:
    config = small_config(**cfg)
    sched = Scheduler(config, num_blocks, max_model_len, clock=FakeClock())
    return sched, Driver(sched, FakeWorker(config.block_size, num_blocks))


def test_seeds_example_d_joins_the_step_after_a_finishes() -> None:
    """A, B, C run; A finishes; D starts in the very next step while B and C keep decoding."""
    sched, drv = make(max_num_seqs=3)
    sched.add_request(make_request("A", 4, max_tokens=3))
    sched.add_request(make_request("B", 4, max_tokens=10))
    sched.add_request(make_request("C", 4, max_tokens=10))
    sched.add_request(make_request("D", 4, max_tokens=5))
    first = drv.step()
    assert sorted(first.num_scheduled_tokens) == ["A", "B", "C"]  # D waits: max_num_seqs is 3
    assert sched.num_waiting == 1
    while drv.outcomes.get("A") is None or drv.outcomes["A"].finish_reason is None:
        plan = drv.step()
        assert "D" not in plan.num_scheduled_tokens
    assert drv.outcomes["A"].token_ids == expected_tokens("A", 4, 3)
    b_before = len(drv.outcomes["B"].token_ids)
    c_before = len(drv.outcomes["C"].token_ids)
    nxt = drv.step()
    assert [r.req_id for r in nxt.new_requests] == ["D"]
    assert nxt.finished_req_ids == ["A"]
    assert nxt.num_scheduled_tokens == {"B": 1, "C": 1, "D": 4}
    assert len(drv.outcomes["B"].token_ids) == b_before + 1
    assert len(drv.outcomes["C"].token_ids) == c_before + 1
    drv.run()
    for rid, mt in (("B", 10), ("C", 10), ("D", 5)):
        assert drv.outcomes[rid].token_ids == expected_tokens(rid, 4, mt)


def test_long_prompt_is_chunked_while_decodes_advance_every_step() -> None:
    sched, drv = make(max_num_batched_tokens=16, num_blocks=128)
    for rid in ("d1", "d2", "d3"):
        sched.add_request(make_request(rid, 3, max_tokens=30))
    drv.step()  # the three short prompts (9 tokens) fit one step
    sched.add_request(make_request("long", 100, max_tokens=2))
    chunks: list[int] = []
    while "long" not in drv.outcomes:
        before = {rid: len(drv.outcomes[rid].token_ids) for rid in ("d1", "d2", "d3")}
        plan = drv.step()
        assert plan.total_num_scheduled_tokens <= 16
        # every running decode advanced by exactly one token in this step
        for rid in ("d1", "d2", "d3"):
            assert plan.num_scheduled_tokens[rid] == 1
            assert len(drv.outcomes[rid].token_ids) == before[rid] + 1
        chunks.append(plan.num_scheduled_tokens["long"])
    assert sum(chunks) == 100
    assert len(chunks) == 8 and chunks[:-1] == [13] * 7 and chunks[-1] == 9
    assert drv.outcomes["long"].deltas[0].num_prompt_tokens == 100
    drv.run()
    assert all(p.total_num_scheduled_tokens <= 16 for p in drv.plans)
    assert drv.outcomes["long"].token_ids == expected_tokens("long", 100, 2)


def test_long_prefill_threshold_caps_one_requests_chunk() -> None:
    sched, drv = make(max_num_batched_tokens=64, long_prefill_token_threshold=10, num_blocks=128)
    sched.add_request(make_request("p", 35, max_tokens=1))
    sched.add_request(make_request("q", 5, max_tokens=1))
    plan = drv.step()
    assert plan.num_scheduled_tokens == {"p": 10, "q": 5}
    assert [drv.step().num_scheduled_tokens["p"] for _ in range(3)] == [10, 10, 5]
    assert drv.outcomes["p"].finish_reason == "length"


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    sched, drv = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 10, max_tokens=3))
    sched.add_request(make_request("b", 10, max_tokens=3))
    p1 = drv.step()
    assert p1.num_scheduled_tokens == {"a": 10}  # b's 10 tokens do not fit the 6 left
    p2 = drv.step()
    assert p2.num_scheduled_tokens == {"a": 1, "b": 10}
    rej = sched.add_request(make_request("c", 17, max_tokens=1))
    assert rej is not None and rej.reason == "too_long"


def test_fcfs_admits_in_arrival_order_without_skipping() -> None:
    sched, drv = make(num_blocks=6, block_size=4)
    sched.add_request(make_request("hog", 15, max_tokens=1))  # 4 blocks
    sched.add_request(make_request("big", 12, max_tokens=1))  # 3 blocks: only 2 left
    sched.add_request(make_request("small", 2, max_tokens=1))  # 1 block would fit
    plan = drv.step()
    assert plan.num_scheduled_tokens == {"hog": 15}  # small does not jump the queue
    plan = drv.step()
    assert plan.num_scheduled_tokens == {"big": 12, "small": 2}
    assert [r.req_id for r in plan.new_requests] == ["big", "small"]


def test_max_num_seqs_bounds_the_running_set() -> None:
    sched, drv = make(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=4))
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        plan = drv.step()
        assert len(plan.num_scheduled_tokens) <= 2
        assert sched.num_running <= 2
    assert all(drv.outcomes[f"r{i}"].token_ids == expected_tokens(f"r{i}", 3, 4) for i in range(5))


def test_max_model_len_ends_with_length() -> None:
    sched, drv = make(max_model_len=12)
    assert sched.add_request(make_request("a", 8, max_tokens=4)) is None
    drv.run()
    assert drv.outcomes["a"].finish_reason == "length"
    assert len(drv.outcomes["a"].token_ids) == 4

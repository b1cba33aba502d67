"""The hybrid KV cache's ledger (scheduler/ledger.py: WindowLedger, HybridLedger), its split of the
budget (shared.capacity.hybrid_kv_blocks) and the plans it makes, followed by the worker's batch."""

from __future__ import annotations

import pytest

from services.scheduler.ledger import RELEASED, HybridLedger, WindowLedger
from services.scheduler.scheduler import Scheduler
from services.worker.batch import BatchState
from shared.capacity import hybrid_kv_blocks, window_blocks_per_sequence, window_layers
from shared.messages import StepPlan, StepResult
from tests.scheduler_fakes import Driver, FakeClock, FakeWorker, expected_tokens, make_request, small_config


def test_a_block_is_released_once_its_last_position_is_behind_the_first_needed() -> None:
    w = WindowLedger(10, block_size=4)
    assert w.allocate("a", 10) == [0, 1, 2]
    assert w.release_behind("a", 3) == 0  # block 0 holds position 3: still reached
    assert w.release_behind("a", 4) == 1  # block 0 ends at 4 <= 4: released
    assert w.tables["a"] == [RELEASED, 1, 2] and w.num_free_blocks == 8
    assert w.release_behind("a", 7) == 0 and w.release_behind("a", 8) == 1
    assert w.release_behind("a", 100) == 1  # never past the table's end
    assert w.tables["a"] == [RELEASED] * 3
    w.check_invariants()
    assert w.allocate("a", 13) is not None and len(w.tables["a"]) == 4  # growing past released entries
    w.free("a")
    assert w.num_free_blocks == 10 and "a" not in w.tables
    w.check_invariants()


def test_the_window_reaches_back_window_minus_one_positions() -> None:
    h = HybridLedger(20, block_size=4, window=5, num_window_blocks=10)
    h.allocate("a", 12)
    # the next query at 7 sees 3..7: block 0 (0-3) still reached; at 8 it sees 4..8: block 0 is behind
    assert h.release_behind("a", 7) == 0
    assert h.release_behind("a", 8) == 1
    assert h.window_table("a")[0] == RELEASED and h.block_tables["a"][0] != RELEASED
    h.check_invariants()


def test_allocation_takes_from_both_pools_or_neither() -> None:
    h = HybridLedger(20, block_size=4, window=8, num_window_blocks=3)
    assert h.allocate("a", 12) is not None  # 3 blocks in each
    assert h.take_new_window_ids("a") == [0, 1, 2] and h.take_new_window_ids("a") == []
    free_full = h.num_free_blocks
    assert not h.can_allocate("b", 1)  # the window pool is empty, the global one is not
    assert h.allocate("b", 1) is None
    assert h.num_free_blocks == free_full and "b" not in h.block_tables  # nothing changed
    assert h.pressure() == (3, 0)  # the fuller pool is the one reported
    h.release_behind("a", 12)  # reaches back to 5: block 0 released
    assert h.allocate("b", 4) is not None
    h.check_invariants()
    assert h.free("b") == 1
    h.free("a")
    assert h.windows.num_free_blocks == 3 and h.num_free_blocks == 20
    assert not h.enable_prefix_caching and h.lookup([1], [(None, (1,))], 1) == []


def test_window_layers_from_the_config() -> None:
    base = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, vocab_size=100,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    types = ["sliding_attention"] * 5 + ["full_attention"]
    assert window_layers(dict(base, sliding_window=512, layer_types=types)) == (512, (0, 1, 2, 3, 4))
    assert window_layers(dict(base, sliding_window=512)) == (512, tuple(range(6)))  # Mistral: every layer
    assert window_layers(dict(base, sliding_window=512, use_sliding_window=False)) == (0, ())
    assert window_layers(dict(base, sliding_window=None)) == (0, ())
    assert window_blocks_per_sequence(512, 16) == 33 and window_blocks_per_sequence(513, 16) == 34


def test_the_budget_split() -> None:
    config = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, vocab_size=100,
                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  sliding_window=512, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    layer_block = 2 * 16 * 2 * 16 * 4  # keys and values of 16 tokens, float32, one layer
    budget = 64 << 20
    h = hybrid_kv_blocks(budget, config, "float32", 16, 256, 1024, 8192)
    assert h is not None and h.window == 512 and h.window_layers == (0, 1, 2, 3, 4)
    used = (h.num_full_blocks + 5 * h.num_window_blocks) * layer_block
    assert budget - layer_block < used <= budget  # all of it, never more
    # at max_model_len both pools hold the same number of sequences (within one step's blocks)
    seqs_full = h.num_full_blocks // 512
    seqs_window = (h.num_window_blocks - 64) // 33
    assert abs(seqs_full - seqs_window) <= 1
    # a window as wide as max_model_len changes nothing; one token narrower does
    assert hybrid_kv_blocks(budget, config, "float32", 16, 256, 1024, 512) is None
    assert hybrid_kv_blocks(budget, config, "float32", 16, 256, 1024, 513) is not None
    every = hybrid_kv_blocks(budget, dict(config, layer_types=None), "float32", 16, 256, 1024, 8192)
    assert every is not None and every.num_window_blocks == budget // (6 * layer_block)
    assert every.num_full_blocks == 256 * 512  # a count of lengths, no memory


class WindowMirror(FakeWorker):
    """A fake worker with the real BatchState beside it: the worker's window table must name the
    scheduler's live window blocks at every position, and new tokens must land in live blocks."""

    def __init__(self, block_size: int, num_blocks: int, ledger: HybridLedger) -> None:
        super().__init__(block_size, num_blocks)
        self.batch = BatchState(block_size)
        self.ledger = ledger

    def step(self, plan: StepPlan) -> StepResult:
        self.batch.apply(plan)
        for req_id, n in plan.num_scheduled_tokens.items():
            state = self.batch.requests[req_id]
            live = self.ledger.window_table(req_id)
            assert len(state.window_block_ids) == len(live) == len(state.block_ids)
            for i, b in enumerate(live):
                if b != RELEASED:
                    assert state.window_block_ids[i] == b, (req_id, i)
            first, end = state.num_computed_tokens, state.num_computed_tokens + n
            for pos in range(max(0, first - self.ledger.window + 1), end):  # what this step's queries read
                assert live[pos // self.block_size] != RELEASED, (req_id, pos)
        result = super().step(plan)
        sampled = dict(zip(result.req_ids, result.sampled_token_ids, strict=True))
        for req_id, n in plan.num_scheduled_tokens.items():
            state = self.batch.requests[req_id]
            state.num_computed_tokens += n
            if req_id in sampled:
                state.append_token(sampled[req_id])
        return result

    def restart(self) -> None:
        super().restart()
        self.batch = BatchState(self.block_size)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_plans_carry_the_window_tables_through_preemption_and_restarts(policy: str) -> None:
    config = small_config(max_num_batched_tokens=24, max_num_seqs=4, scheduling_policy=policy, max_request_crashes=0)
    sched = Scheduler(config, 40, 256, clock=FakeClock(), window=6, num_window_blocks=9)
    assert isinstance(sched.ledger, HybridLedger)
    worker = WindowMirror(config.block_size, 40, sched.ledger)
    drv = Driver(sched, worker)
    want = {}
    for i in range(8):
        rid = f"r{i}"
        prompt = list(range(100 * i, 100 * i + 10 + 3 * i))
        sched.add_request(make_request(rid, prompt, max_tokens=12 + i, priority=i % 3))
        want[rid] = expected_tokens(rid, len(prompt), 12 + i)
    for step in range(10):
        if step == 7:
            sched.preempt_all()
            worker.restart()
        drv.step()
    drv.run()
    if policy == "fcfs":  # the window pool (9 blocks) runs out: preemption frees both pools
        assert sched.stats().num_preemptions_total > 0
    for rid, tokens in want.items():
        assert drv.outcomes[rid].token_ids == tokens
    sched.ledger.check_invariants()
    assert sched.ledger.windows.num_free_blocks == 9

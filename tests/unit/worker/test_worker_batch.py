"""The worker's persistent batch state folding step-plan differences, and KV sizing."""

from __future__ import annotations

import pytest
import torch

from services.worker.batch import BatchState
from services.worker.kv_cache import KVCache, num_blocks_for_budget
from shared.capacity import num_kv_blocks
from shared.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan

GREEDY = SamplingParams(temperature=0.0)


def new(req_id: str, prompt: list[int], blocks: list[int], computed: int = 0, outputs: list[int] | None = None) -> NewRequestData:
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, sampling=GREEDY, block_ids=blocks,
                          num_computed_tokens=computed, output_token_ids=outputs or [])


def test_new_cached_finished_and_preempted_requests() -> None:
    batch = BatchState(block_size=4)
    batch.apply(StepPlan(step_id=1, new_requests=[new("a", [1, 2, 3, 4, 5], [0, 1]), new("b", [9], [2])],
                         num_scheduled_tokens={"a": 5, "b": 1}))
    assert batch.requests["a"].token_ids == [1, 2, 3, 4, 5]
    batch.requests["a"].num_computed_tokens = 5
    batch.requests["a"].append_token(6)
    batch.apply(StepPlan(step_id=2, cached_requests=[CachedRequestData("a", [7], 5)], finished_req_ids=["b"],
                         num_scheduled_tokens={"a": 1}))
    assert batch.requests["a"].block_ids == [0, 1, 7]
    assert batch.requests["a"].num_output_tokens == 1
    assert "b" not in batch.requests
    batch.apply(StepPlan(step_id=3, preempted_req_ids=["a"]))
    assert len(batch) == 0


def test_resumed_request_is_rebuilt_from_prompt_and_outputs() -> None:
    batch = BatchState(block_size=4)
    batch.apply(StepPlan(step_id=1, new_requests=[new("a", [1, 2], [0])]))
    batch.apply(StepPlan(step_id=2, preempted_req_ids=["a"]))
    batch.apply(StepPlan(step_id=3, resumed_requests=[new("a", [1, 2], [5, 6], 0, [7, 7, 8])],
                         num_scheduled_tokens={"a": 5}))
    state = batch.requests["a"]
    assert state.token_ids == [1, 2, 7, 7, 8]
    assert state.num_prompt_tokens == 2 and state.num_output_tokens == 3
    assert state.output_counts == {7: 2, 8: 1}  # penalties survive preemption
    assert state.block_ids == [5, 6]


def test_inconsistent_plans_are_refused_with_a_message() -> None:
    batch = BatchState(block_size=4)
    with pytest.raises(KeyError, match="unknown"):
        batch.apply(StepPlan(step_id=1, cached_requests=[CachedRequestData("x", [], 0)]))
    with pytest.raises(ValueError, match="holds 2"):
        batch.apply(StepPlan(step_id=2, new_requests=[new("a", [1, 2], [0])], num_scheduled_tokens={"a": 3}))
    with pytest.raises(ValueError, match="KV slots"):
        batch.apply(StepPlan(step_id=3, new_requests=[new("b", list(range(9)), [0, 1])],
                             num_scheduled_tokens={"b": 9}))


def test_kv_sizing_is_the_shared_formula_and_allocates_exactly_that() -> None:
    config = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "vocab_size": 100}
    budget = 1_000_003
    blocks = num_blocks_for_budget(budget, config, torch.float32, 16)
    assert blocks == num_kv_blocks(budget, config, "float32", 16) == budget // (2 * 3 * 2 * 16 * 4 * 16)
    kv = KVCache.allocate(config, blocks, 16, torch.float32, "cpu")
    assert kv.nbytes == KVCache.bytes_for(config, blocks, 16, torch.float32) <= budget
    assert kv.caches[0][0].shape == (blocks, 16, 2, 16)
    assert num_blocks_for_budget(budget, config, torch.bfloat16, 16) == budget // (2 * 3 * 2 * 16 * 2 * 16)

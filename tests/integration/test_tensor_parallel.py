"""Tensor parallelism through the offline engine: TP=2 greedy equals TP=1 token for token.

Tiny random models in float32: Llama with grouped-query attention (4 query heads,
2 KV heads), Llama with plain multi-head attention (4:4), and Qwen2 with q/k/v
biases (4:2). Rank 1 runs in a spawned child process; the ranks meet over gloo
at a rendezvous file. Chunked prefill, preemption and prefix hits all happen,
so the sharded KV cache is exercised the way serving does. Also: each rank holds
half the KV heads, so the same byte budget gives twice the blocks, and the
split itself is checked against the whole layer on one process (no group).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from services.worker.model.tensor_parallel import check_divisible, rank_config
from shared.capacity import kv_block_bytes
from tests.conftest import cached_tiny_model
from tests.integration.test_offline_tiny import PROMPTS
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4
NUM_BLOCKS_TP1 = 24  # as test_offline_tiny: preemption is certain
MAX_TOKENS = 12


def model(kind: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if kind == "llama-gqa":
        return cached_tiny_model("llama")
    if kind == "llama-mha":
        return build_tiny_model(tmp_path_factory.mktemp("mha"), "llama", num_key_value_heads=4)
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2", num_key_value_heads=2)


def llm(folder: Path, tp: int) -> LLM:
    config = json.loads((folder / "config.json").read_text())
    budget = kv_block_bytes(config, "float32", BLOCK_SIZE) * NUM_BLOCKS_TP1 + 17
    return LLM(model=str(folder), dtype="float32", kv_cache_memory=budget, block_size=BLOCK_SIZE, num_threads=1,
               tensor_parallel_size=tp, max_num_batched_tokens=16, max_num_seqs=8, long_prefill_token_threshold=8)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha", "qwen2-gqa-bias"])
def test_tp2_greedy_equals_tp1_token_for_token(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    torch.set_num_threads(1)
    folder = model(kind, tmp_path_factory)
    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with llm(folder, 1) as one:
        expected = [o.token_ids for o in one.generate(PROMPTS, params)]
        blocks_tp1 = one.num_kv_blocks
    with llm(folder, 2) as two:
        # the same bytes per rank hold half the heads: twice the blocks
        assert blocks_tp1 == NUM_BLOCKS_TP1
        assert two.num_kv_blocks == 2 * NUM_BLOCKS_TP1
        outs = two.generate(PROMPTS + PROMPTS[:3], params)  # more requests: still preempts with 48 blocks
        stats = two.scheduler.stats()
    assert [o.token_ids for o in outs[: len(PROMPTS)]] == expected
    assert [o.token_ids for o in outs[len(PROMPTS):]] == expected[:3]
    assert stats.prefix_cache_hits_total > 0


def test_the_split_divides_heads_and_refuses_what_does_not_divide() -> None:
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "vocab_size": 100}
    per_rank = rank_config(config, 2)
    assert (per_rank["num_attention_heads"], per_rank["num_key_value_heads"], per_rank["head_dim"]) == (2, 1, 16)
    with pytest.raises(ValueError, match="KV heads"):
        check_divisible({**config, "num_key_value_heads": 1}, 2)
    with pytest.raises(ValueError, match="attention heads"):
        check_divisible(config, 3)


def test_tp2_deterministic_gives_seeded_requests_their_bits_alone() -> None:
    """--deterministic with two ranks: the row-parallel partials summed in rank order, so a
    seeded request's tokens and logprobs in a chunked, preempting mix are those it gets alone."""
    torch.set_num_threads(1)
    folder = cached_tiny_model("llama")
    config = json.loads((folder / "config.json").read_text())
    budget = kv_block_bytes(config, "float32", BLOCK_SIZE) * NUM_BLOCKS_TP1 + 17
    seeded = [GenerationParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=40 + i, logprobs=2,
                               ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(model=str(folder), dtype="float32", kv_cache_memory=budget * 8, block_size=BLOCK_SIZE, num_threads=1,
             tensor_parallel_size=2, deterministic=True, enable_prefix_caching=False) as alone_llm:
        alone = [alone_llm.generate([p], g)[0] for p, g in zip(PROMPTS, seeded, strict=True)]
    # each rank holds half the KV heads: half the bytes keep the 24 blocks that preempt
    with LLM(model=str(folder), dtype="float32", kv_cache_memory=budget // 2, block_size=BLOCK_SIZE, num_threads=1,
             tensor_parallel_size=2, deterministic=True, max_num_batched_tokens=16, max_num_seqs=8,
             long_prefill_token_threshold=8) as mixed:
        outs = mixed.generate(PROMPTS, seeded)
        assert mixed.scheduler.stats().num_preemptions_total > 0
    for a, b in zip(alone, outs, strict=True):
        assert (a.token_ids, repr(a.logprobs)) == (b.token_ids, repr(b.logprobs))

"""``--kv-cache-dtype fp8``: a float8 (e4m3) KV cache in the offline engine on a tiny random
Llama: a byte per element (four times the blocks of a float32 cache in the same bytes),
generation through chunked prefill, preemption and prefix hits with every block back at the
end, and clear refusals where it is not supported."""

from __future__ import annotations

import json

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from services.worker.backends import available_backends
from shared.capacity import kv_block_bytes
from tests.conftest import cached_tiny_model

BLOCK_SIZE = 4
PROMPTS = [list(range(300, 320)) + [5, 6, 7], list(range(300, 320)) + [8], list(range(1000, 1030)), [7, 8, 9]]

needs_kernels = pytest.mark.skipif("cpu_paged" not in available_backends("cpu"),
                                   reason="a float8 KV cache needs the cpu_paged kernels (a C++ compiler)")


def _llm(kv_cache_dtype: str, num_f32_blocks: int, **knobs: object) -> LLM:
    folder = cached_tiny_model("llama")
    config = json.loads((folder / "config.json").read_text())
    budget = kv_block_bytes(config, "float32", BLOCK_SIZE) * num_f32_blocks
    return LLM(model=str(folder), dtype="float32", kv_cache_memory=budget, block_size=BLOCK_SIZE, num_threads=1,
               max_num_batched_tokens=16, max_num_seqs=8, long_prefill_token_threshold=8,
               kv_cache_dtype=kv_cache_dtype, **knobs)  # type: ignore[arg-type]


@needs_kernels
def test_float8_cache_holds_four_times_the_blocks_and_frees_them_all() -> None:
    torch.set_num_threads(1)
    reference = _llm("auto", 24)
    want = reference.generate(PROMPTS, GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    reference.close()
    llm = _llm("fp8", 6)  # the bytes of 6 float32 blocks: 24 float8 blocks, still tight enough to preempt
    assert llm.runner.num_kv_blocks == 24
    assert llm.runner.kv.caches[0][0].dtype == torch.float8_e4m3fn
    assert llm.runner.attn_backend.name == "cpu_paged"
    outs = llm.generate(PROMPTS, GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stats = llm.scheduler.stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits_total > 0
    assert stats.num_running == 0 and stats.kv_usage == 0.0  # no block left in use
    assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
    # float8 rounds every cached key and value; a tiny random model's near-ties may flip, but
    # most greedy tokens still agree with the float32 cache's
    same = sum(a == b for o, w in zip(outs, want, strict=True) for a, b in zip(o.token_ids, w.token_ids, strict=True))
    assert same >= 0.5 * 12 * len(PROMPTS), same
    llm.close()


def test_float8_cache_is_refused_where_unsupported() -> None:
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="cpu_paged"):
        _llm("fp8", 24, attention_backend="reference")
    with pytest.raises(ValueError, match="expected 'auto' or 'fp8'"):
        _llm("int4", 24)

"""The offline engine on tiny random models against transformers' own ``generate``.

Real scheduler + real model runner in one process, float32, with chunked prefill,
a KV budget small enough to force preemption, and prefix caching on (prompts share
prefixes). Greedy tokens must equal ``generate``'s for each prompt run alone.
About 10 s in all on 2 shared cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from shared.capacity import kv_block_bytes
from tests.conftest import cached_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # 96 token slots for 5 requests of up to 42 tokens: preemption is certain
MAX_TOKENS = 12
SHARED = list(range(300, 320))
PROMPTS = [SHARED + [5, 6, 7], SHARED + [8], list(range(1000, 1030)), [7, 8, 9], SHARED[:12] + [1, 2, 3, 4]]


def tiny_llm(folder: Path, num_blocks: int = NUM_BLOCKS, **knobs: object) -> LLM:
    import json

    config = json.loads((folder / "config.json").read_text())
    budget = kv_block_bytes(config, "float32", BLOCK_SIZE) * num_blocks + 17  # a partial block is dropped
    defaults: dict[str, object] = dict(max_num_batched_tokens=16, max_num_seqs=8, long_prefill_token_threshold=8)
    defaults.update(knobs)
    return LLM(model=str(folder), dtype="float32", kv_cache_memory=budget, block_size=BLOCK_SIZE,
               num_threads=1, **defaults)  # type: ignore[arg-type]


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return [
        model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                       pad_token_id=0)[0, len(p):].tolist()
        for p in prompts
    ]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # GQA 4:2, and MQA 4:1 with q/k/v biases
def test_greedy_matches_transformers_under_chunking_preemption_and_prefix_hits(kind: str) -> None:
    torch.set_num_threads(1)
    folder = cached_tiny_model(kind)
    llm = tiny_llm(folder)
    assert llm.runner.num_kv_blocks == NUM_BLOCKS
    outs = llm.generate(PROMPTS, GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    stats = llm.scheduler.stats()
    assert stats.num_preemptions_total > 0, "the KV budget was meant to force preemption"
    assert stats.prefix_cache_hits_total > 0, "shared prefixes were meant to hit the prefix cache"
    expected = hf_greedy(folder, PROMPTS, MAX_TOKENS)
    for prompt, out, ref in zip(PROMPTS, outs, expected, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"
        assert out.token_ids == ref
        assert out.timings is not None and out.timings.finished_time is not None


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    torch.set_num_threads(1)
    llm = tiny_llm(cached_tiny_model("llama"))
    seeded = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=4242, ignore_eos=True)
    prompt = SHARED + [5, 6, 7]
    alone = llm.generate([prompt], seeded)[0].token_ids
    assert llm.generate([prompt], seeded)[0].token_ids == alone
    others = [GenerationParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True),
              GenerationParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=1, ignore_eos=True),
              GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)]
    batch = llm.generate([PROMPTS[2], prompt, PROMPTS[3], PROMPTS[4]], [others[0], seeded, others[1], others[2]])
    assert llm.scheduler.stats().num_preemptions_total > 0  # the stream also survived recomputation
    assert batch[1].token_ids == alone
    other_seed = llm.generate([prompt], GenerationParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95,
                                                         seed=4243, ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_stop_conditions_logprobs_and_rejections_reach_the_outputs() -> None:
    torch.set_num_threads(1)
    folder = cached_tiny_model("llama")
    llm = tiny_llm(folder, num_blocks=64)
    greedy = hf_greedy(folder, [PROMPTS[0]], 6)[0]
    stop_at = greedy[3]
    outs = llm.generate(
        [PROMPTS[0], PROMPTS[0], list(range(5, 400))],
        [GenerationParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_at,), logprobs=2),
         GenerationParams(max_tokens=3, temperature=0.0, logprobs=0),
         GenerationParams(max_tokens=4)],
    )
    first = greedy.index(stop_at) + 1
    assert outs[0].token_ids == greedy[:first] and outs[0].finish_reason == "stop"
    assert outs[0].logprobs is not None and len(outs[0].logprobs) == first
    assert [lp.sampled.token_id for lp in outs[0].logprobs] == greedy[:first]
    assert all(lp.sampled.logprob <= 0.0 and len(lp.top) == 2 for lp in outs[0].logprobs)
    assert outs[0].logprobs[0].top[0].token_id == greedy[0]  # greedy: the top-1 alternative is the pick
    assert outs[1].token_ids == greedy[:3] and outs[1].finish_reason == "length"
    assert outs[2].finish_reason == "too_long" and outs[2].token_ids == [] and outs[2].error
    assert isinstance(outs[0].text, str)
    again = llm.generate([PROMPTS[0]], GenerationParams(max_tokens=2, temperature=0.0))[0]
    assert again.num_cached_tokens >= BLOCK_SIZE  # the finished prompt's full blocks stayed cached
    assert again.token_ids == greedy[:2]


def test_runner_samples_only_when_a_chunk_reaches_the_end() -> None:
    from services.worker.runner import ModelRunner
    from shared.config import WorkerConfig
    from shared.messages import CachedRequestData, NewRequestData, SamplingParams, StepPlan

    torch.set_num_threads(1)
    runner = ModelRunner(WorkerConfig(model=str(cached_tiny_model("llama")), dtype="float32",
                                      kv_cache_memory=1 << 20, block_size=4, num_threads=1))
    prompt = list(range(40, 50))
    new = NewRequestData(req_id="r", prompt_token_ids=prompt, sampling=SamplingParams(temperature=0.0),
                         block_ids=[3, 1, 2], num_computed_tokens=0)
    first = runner.execute(StepPlan(step_id=1, new_requests=[new], num_scheduled_tokens={"r": 6}))
    assert first.req_ids == [] and first.sampled_token_ids == []
    second = runner.execute(StepPlan(step_id=2, cached_requests=[CachedRequestData("r", [], 6)],
                                     num_scheduled_tokens={"r": 4}))
    assert second.req_ids == ["r"]
    assert second.sampled_token_ids == hf_greedy(cached_tiny_model("llama"), [prompt], 1)[0]
    assert runner.batch.requests["r"].token_ids == prompt + second.sampled_token_ids


def test_stop_strings_cut_the_text_and_end_the_request() -> None:
    torch.set_num_threads(1)
    llm = tiny_llm(cached_tiny_model("llama"), num_blocks=64)
    free = llm.generate([PROMPTS[2]], GenerationParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    text = free.text
    assert len(text) > 6
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate([PROMPTS[2]], GenerationParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                       stop=(stop, "never-appears")))[0]
    assert out.finish_reason == "stop" and out.stop_string == stop
    assert out.text == text[: text.find(stop)]
    assert len(out.token_ids) < 10 and out.token_ids == free.token_ids[: len(out.token_ids)]
    assert not llm.scheduler.has_unfinished_requests()

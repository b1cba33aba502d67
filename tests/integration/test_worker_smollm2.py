"""The real SmolLM2-135M-Instruct through the offline engine, against transformers.

float32: greedy chat completions equal transformers' ``generate`` token for token.
bfloat16: the logprobs of the tokens it picks stay close to float32's for the same
tokens, and on the tiled bfloat16 kernel they are the same bits alone as in a batch.
About 40 s on 2 shared cores (four model loads, short outputs).
"""

from __future__ import annotations

import pytest
import torch

from services.engine.offline import LLM, GenerationParams

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about a ferry crossing a river at dawn."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def fp32() -> LLM:
    torch.set_num_threads(2)
    # Small chunks so the longer prompts are prefilled in pieces next to decodes.
    return LLM(dtype="float32", kv_cache_memory=64 << 20, num_threads=2, max_num_batched_tokens=32)


def test_greedy_chat_matches_transformers_in_float32(fp32: LLM) -> None:
    from transformers import AutoModelForCausalLM

    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [fp32.chat_token_ids(c) for c in CHATS]
    outs = fp32.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(fp32.runner.model_dir, dtype=torch.float32)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        # An explicit mask: <|im_end|> is also the pad id, and generate would mask it out of the prompt.
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=2)[0, len(prompt):].tolist()
        assert out.token_ids == ref, (fp32.tokenizer.decode(out.token_ids), fp32.tokenizer.decode(ref))
    assert "Paris" in outs[0].text


def test_bfloat16_logprobs_are_close_to_float32(fp32: LLM) -> None:
    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    ref = fp32.chat(CHATS, params)
    bf16 = LLM(dtype="bfloat16", kv_cache_memory=64 << 20, num_threads=2, max_num_batched_tokens=32)
    outs = bf16.chat(CHATS, params)
    diffs: list[float] = []
    for a, b in zip(ref, outs, strict=True):
        assert a.logprobs is not None and b.logprobs is not None
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            if lp_a.sampled.token_id != lp_b.sampled.token_id:
                break  # the paths diverged; later positions compare different contexts
            diffs.append(abs(lp_a.sampled.logprob - lp_b.sampled.logprob))
    assert len(diffs) >= len(CHATS) * 4, "bfloat16 diverged from float32 almost at once"
    assert max(diffs) < 0.5
    assert sum(diffs) / len(diffs) < 0.1


def test_bfloat16_outputs_do_not_depend_on_the_batch_on_ferrys_products() -> None:
    """With every bfloat16 product on the tiled kernel, or with AMX on the AMX tile products
    (either sums a row in the same order at any row count), and attention's work items whole
    requests, a request's logprobs are the same bits alone as inside a batch. On oneDNN they
    were not (docs/benchmarks.md, "Kernels: linear products": 4 of 38 greedy
    outputs changed), nor with AMX while the tiled kernel kept 1-6 rows (FERRY_CPU_TILED_LINEAR=small)."""
    from services.worker.model.packed_linear import ALL_ROWS, _tiled_kernels, amx_rows, tiled_rows

    kernels, rows = _tiled_kernels(), tiled_rows(torch.bfloat16)
    # every product on the tiled kernel, or (AMX) every product on the AMX tile products
    if kernels is None or rows is None or (rows < ALL_ROWS and not (rows == 0 and amx_rows(kernels))):
        pytest.skip("neither the tiled kernel nor the AMX products take every bfloat16 product on this CPU or build")
    chats = CHATS + [[{"role": "user", "content": q}] for q in (
        "List the planets of the solar system.", "What does a ferry do?", "Count from one to ten in French.",
        "Give me a short tip for writing clear emails.")]
    params = GenerationParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    llm = LLM(dtype="bfloat16", kv_cache_memory=64 << 20, num_threads=2)
    prompts = [llm.chat_token_ids(c) for c in chats]
    together = llm.generate(prompts, params, decode=False)
    for prompt, out in zip(prompts, together, strict=True):
        alone = llm.generate([prompt], params, decode=False)[0]
        assert alone.token_ids == out.token_ids
        assert alone.logprobs == out.logprobs  # every logprob, bit for bit

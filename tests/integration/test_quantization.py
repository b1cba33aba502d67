"""``--quantization int8`` on the tiny model: it loads, its linear layers are int8, it
generates, and greedy mostly agrees with float32 (a random tiny model is a harsh case:
no trained structure for the int8 rounding to hide in, so the test asks for agreement
on the first tokens, not on every token). Bad knob values are refused at load."""

from __future__ import annotations

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from services.worker.quantize import packed_weight_bytes
from tests.conftest import cached_tiny_model

PROMPTS = [list(range(300, 320)), [7, 8, 9], list(range(1000, 1030))]


def test_int8_generates_and_agrees_with_float32_on_the_first_tokens() -> None:
    torch.set_num_threads(1)
    folder = str(cached_tiny_model("llama"))
    params = GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLM(model=folder, dtype="float32", kv_cache_memory=1 << 22, num_threads=1)
    q8 = LLM(model=folder, dtype="auto", kv_cache_memory=1 << 22, num_threads=1, quantization="int8")
    kinds = {type(m).__module__ for m in q8.runner.model.modules() if type(m).__name__ == "Linear"}
    assert kinds == {"torch.ao.nn.quantized.dynamic.modules.linear"}, kinds
    assert q8.runner.dtype == torch.float32  # int8 computes in float32 between its linear layers
    # One byte per weight in every linear layer (the tiny Llama has no biases).
    linears = [m for m in ref.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert packed_weight_bytes(q8.runner.model) == sum(m.in_features * m.out_features for m in linears)
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    got = [o.token_ids for o in q8.generate(PROMPTS, params)]
    assert all(len(g) == 6 for g in got)
    assert sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) >= 2


def test_bad_quantization_values_are_refused() -> None:
    folder = str(cached_tiny_model("llama"))
    with pytest.raises(ValueError, match="not supported"):
        LLM(model=folder, kv_cache_memory=1 << 22, num_threads=1, quantization="int4")
    with pytest.raises(ValueError, match="float32"):
        LLM(model=folder, dtype="bfloat16", kv_cache_memory=1 << 22, num_threads=1, quantization="int8")

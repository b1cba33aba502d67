"""``--quantization int8`` on the tiny model, computing in float32 and in bfloat16: it
loads, its decoder's linear layers are int8, it generates, and greedy mostly agrees with
float32 (a random tiny model is a harsh case: no trained structure for the int8 rounding
to hide in, so the test asks for agreement on the first tokens, not on every token). Bad
knob values are refused at load."""

from __future__ import annotations

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from services.worker.model.packed_linear import PackedLinear
from services.worker.model.quantize import Int8Linear, packed_weight_bytes
from tests.conftest import cached_tiny_model

PROMPTS = [list(range(300, 320)), [7, 8, 9], list(range(1000, 1030))]


def test_int8_generates_and_agrees_with_float32_on_the_first_tokens() -> None:
    torch.set_num_threads(1)
    folder = str(cached_tiny_model("llama"))
    params = GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = LLM(model=folder, dtype="float32", kv_cache_memory=1 << 22, num_threads=1)
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    for dtype in ("float32", "bfloat16"):
        q8 = LLM(model=folder, dtype=dtype, kv_cache_memory=1 << 22, num_threads=1, quantization="int8")
        body = q8.runner.body
        assert not any(type(m) is torch.nn.Linear for m in body.modules())  # every decoder linear is int8
        int8 = [m for m in body.modules() if isinstance(m, Int8Linear)]
        assert len(int8) == 4 * q8.runner.hf_config.num_hidden_layers  # q/k/v and gate/up fused
        assert q8.runner.dtype == getattr(torch, dtype)  # the rest of the model computes in the dtype asked for
        # One byte per weight in every decoder linear (the tiny Llama has no biases), float32 scales beside.
        # (the float32 reference holds its linears packed for oneDNN, q/k/v and gate/up joined)
        linears = [m for m in ref.runner.body.modules() if isinstance(m, torch.nn.Linear | PackedLinear)]
        assert len(linears) == 4 * q8.runner.hf_config.num_hidden_layers
        assert sum(m.qweight.numel() for m in int8) == sum(m.in_features * m.out_features for m in linears)
        assert packed_weight_bytes(q8.runner.model) > sum(m.qweight.numel() for m in int8)
        got = [o.token_ids for o in q8.generate(PROMPTS, params)]
        assert all(len(g) == 6 for g in got)
        assert sum(g[0] == w[0] for g, w in zip(got, want, strict=True)) >= 2, (dtype, got, want)


def test_bad_quantization_values_are_refused() -> None:
    folder = str(cached_tiny_model("llama"))
    with pytest.raises(ValueError, match="not supported"):
        LLM(model=folder, kv_cache_memory=1 << 22, num_threads=1, quantization="int4")

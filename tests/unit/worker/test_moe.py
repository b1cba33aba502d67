"""Packed mixture-of-experts layers (model/moe.py) against transformers' own experts modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.worker.model.moe import PackedExperts, pack_experts
from services.worker.model.packed_linear import packing_enabled

CPU = torch.device("cpu")


def _block(kind: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(num_local_experts=6) if kind == "mixtral" else dict(num_experts=6, moe_intermediate_size=32)
    config = AutoConfig.for_model(kind, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
                                  num_experts_per_tok=2, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "olmoe"])
def test_packed_experts_compute_what_the_module_did(kind: str, dtype: torch.dtype) -> None:
    if not packing_enabled(dtype, CPU):
        pytest.skip("no oneDNN packing for this dtype here")
    body = _block(kind, dtype)
    experts = body.layers[0].mlp.experts
    original = type(experts)  # the module transformers built
    reference = {n: p.detach().clone() for n, p in experts.named_parameters()}
    assert pack_experts(body, dtype, CPU) == 1
    packed = body.layers[0].mlp.experts
    assert isinstance(packed, PackedExperts) and packed.num_experts == 6
    twin = original(body.config)
    twin.load_state_dict(reference)
    twin.to(dtype)
    gen = torch.Generator().manual_seed(1)
    # routings with edges: every token on one expert; experts chosen by no token; one token alone
    cases = [torch.tensor([[3, 5]] * 5),
             torch.tensor([[0, 1], [1, 0], [0, 1]]), torch.tensor([[5, 2]])]
    cases.append(torch.randint(0, 6, (40, 2), generator=gen))
    tol = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    with torch.inference_mode():
        for index in cases:
            x = torch.randn(index.shape[0], 64, generator=gen).to(dtype)
            w = torch.rand(index.shape, generator=gen).to(dtype)
            want, got = twin(x, index, w).float(), packed(x, index, w).float()
            assert got.shape == want.shape
            assert torch.all((got - want).abs() <= tol * (want.abs() + want.abs().max())), (got - want).abs().max()


def test_experts_with_biases_or_another_layout_are_left_as_they_are() -> None:
    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 8, 4))
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(2, 8))
            self.down_proj = nn.Parameter(torch.zeros(2, 4, 4))
            self.act_fn = torch.nn.functional.silu

    class Shapeless(nn.Module):  # gate/up not twice the down projection's input
        def __init__(self) -> None:
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.zeros(2, 6, 4))
            self.down_proj = nn.Parameter(torch.zeros(2, 4, 4))
            self.act_fn = torch.nn.functional.silu

    body = nn.Module()
    body.a, body.b = Biased(), Shapeless()
    assert pack_experts(body, torch.float32, CPU) == 0
    assert isinstance(body.a, Biased) and isinstance(body.b, Shapeless)


def test_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_CPU_PACKED_EXPERTS", "0")
    body = _block("mixtral", torch.float32)
    assert pack_experts(body, torch.float32, CPU) == 0

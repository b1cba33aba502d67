"""Fused bfloat16 CPU ops (services/worker/fused_ops.py, backends/csrc/fused_ops.cpp).

Each kernel against the transformers code it replaces, on random inputs: the rotary
embedding bit for bit (also on the strided q/k views the fused q/k/v product yields),
RMSNorm and SiLU-and-mul within one bfloat16 step and almost always equal; then a
whole random Llama and Qwen2 with every swap made, against the untouched model.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from services.worker import fused_ops
from services.worker.fused_ops import FusedRMSNorm, FusedSiluMLP, fuse_elementwise, fused_ops_enabled
from services.worker.packed_linear import fuse_projections, pack_linears

CPU = torch.device("cpu")
BF16 = torch.bfloat16


def _kernels():  # noqa: ANN202
    k = fused_ops.kernels()
    if k is None:
        pytest.skip("no C++ compiler or no AVX-512: the fused ops are absent and the model stays as it is")
    return k


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _one_step_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.float() - want.float()).abs()
    assert torch.all(diff <= want.float().abs() * 2.0**-7 + 1e-6), float(diff.max())
    assert (got == want).float().mean() > 0.995


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
@pytest.mark.parametrize("width", [64, 576])
def test_rms_norm_matches_llama_rms_norm(rows: int, width: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    k = _kernels()
    norm = LlamaRMSNorm(width, eps=1e-5).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=_gen(1)) + 0.5)
    x = (torch.randn(rows, width, generator=_gen(rows)) * 4).to(BF16)
    with torch.inference_mode():
        got, want = k.rms_norm(x, norm.weight, 1e-5), norm(x)
    assert got.shape == want.shape and got.dtype == BF16
    _one_step_apart(got, want)


@pytest.mark.parametrize("rows", [1, 5, 200])
@pytest.mark.parametrize("inter", [32, 1536])
def test_silu_and_mul_matches_act_times_up(rows: int, inter: int) -> None:
    k = _kernels()
    x = (torch.randn(rows, 2 * inter, generator=_gen(inter)) * 5).to(BF16)
    x[0, :4] = torch.tensor([-200.0, -90.0, 0.0, 120.0])  # saturated and zero gates
    got = k.silu_and_mul(x)
    want = F.silu(x[:, :inter]) * x[:, inter:]
    assert got.shape == (rows, inter)
    _one_step_apart(got[:, 4:], want[:, 4:])
    # saturated: ~0 (e^-90 and e^-200 underflow differently, both far below one step of 1e-6), 0, the gate itself
    assert torch.all(got[0, :3].float().abs() <= 1e-6 * x[0, inter : inter + 3].float().abs())
    assert got[0, 3] == want[0, 3]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_equals_apply_rotary_pos_emb_on_strided_views(head_dim: int, tokens: int) -> None:
    from transformers.models.llama import modeling_llama

    k = _kernels()
    original = getattr(modeling_llama.apply_rotary_pos_emb, "ferry_original", modeling_llama.apply_rotary_pos_emb)
    heads, kv_heads = 6, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=_gen(tokens)).to(BF16)
    q = qkv[:, : heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
    kk = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    angles = torch.rand(1, tokens, head_dim // 2, generator=_gen(5)) * 500
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(BF16), angles.sin().to(BF16)
    want_q, want_k = original(q, kk, cos, sin)
    got_q, got_k = k.rotary(q[0].transpose(0, 1), kk[0].transpose(0, 1), cos[0], sin[0])
    assert got_q.is_contiguous() and got_q.shape == (tokens, heads, head_dim)
    assert torch.equal(got_q.transpose(0, 1).unsqueeze(0), want_q)
    assert torch.equal(got_k.transpose(0, 1).unsqueeze(0), want_k)
    # the patched function: same result through ferry's fast path, and the original for anything else
    patched = fused_ops._rotary(original, k)
    fast_q, fast_k = patched(q, kk, cos, sin)
    assert torch.equal(fast_q, want_q) and torch.equal(fast_k, want_k)
    qf, kf, cf, sf = q.float(), kk.float(), cos.float(), sin.float()
    slow = patched(qf, kf, cf, sf)
    assert slow[0].dtype == torch.float32 and torch.equal(slow[0], original(qf, kf, cf, sf)[0])


def test_fused_ops_only_for_bfloat16_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert fused_ops_enabled(BF16, CPU)
    assert not fused_ops_enabled(torch.float32, CPU)  # float32 stays token-exact with transformers
    assert not fused_ops_enabled(BF16, torch.device("cuda"))
    monkeypatch.setenv("FERRY_CPU_FUSED_OPS", "0")
    assert not fused_ops_enabled(BF16, CPU)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert fuse_elementwise(model, BF16, CPU) == {"rms_norm": 0, "silu_mlp": 0, "rotary": 0}


def _random_model(kind: str):  # noqa: ANN202
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2 if kind == "llama" else 1, max_position_embeddings=256, vocab_size=512,
               tie_word_embeddings=True)
    config = AutoConfig.for_model(kind, **cfg)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=BF16).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_model_matches_the_untouched_one(kind: str) -> None:
    _kernels()
    if not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN: gate/up are not fused, so the MLP is not either")
    model = _random_model(kind)
    fast = copy.deepcopy(model)
    body = fast.get_decoder()
    layers = len(body.layers)
    fuse_projections(body, BF16, CPU)
    pack_linears(body, BF16, CPU)
    counts = fuse_elementwise(body, BF16, CPU)
    assert counts == {"rms_norm": 2 * layers + 1, "silu_mlp": layers, "rotary": 1}
    assert isinstance(body.norm, FusedRMSNorm) and isinstance(body.layers[0].mlp, FusedSiluMLP)
    module = __import__(type(body.layers[0].self_attn).__module__, fromlist=["apply_rotary_pos_emb"])
    assert getattr(module.apply_rotary_pos_emb, "ferry_fused", False)
    ids = torch.randint(0, 512, (1, 23), generator=_gen(3))
    with torch.inference_mode():
        want = model(ids).logits.float()
        got = fast(ids).logits.float()
    # bfloat16 through two layers: the rare one-step differences stay small and keep the argmax
    assert torch.allclose(got, want, atol=0.05, rtol=0.05), float((got - want).abs().max())
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_rms_norm_is_the_add_then_the_norm(rows: int) -> None:
    k = _kernels()
    x = (torch.randn(1, rows, 576, generator=_gen(rows)) * 3).to(BF16)
    delta = torch.randn(1, rows, 576, generator=_gen(rows + 1)).to(BF16)
    weight = (torch.rand(576, generator=_gen(2)) + 0.5).to(BF16)
    total, normed = k.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)  # the same bfloat16 sum PyTorch stores
    assert torch.equal(normed, k.rms_norm(x + delta, weight, 1e-5))
    assert torch.equal(x, (torch.randn(1, rows, 576, generator=_gen(rows)) * 3).to(BF16))  # inputs untouched

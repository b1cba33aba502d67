"""Quantized checkpoints in the compressed-tensors format (model/checkpoint_quant.py), written by
the compressed-tensors library from a tiny random Llama (tests/quantized_models.py), served by
the offline engine:

- W8A8 int8: every quantized layer runs on ferry's int8 path with the checkpoint's own integers
  and scales (fused q/k/v and gate/up included): its output is the scheme's arithmetic on them
  (per-token int8 activations x the stored int8 weights, scaled back) to float32 rounding;
  served, the logprobs of the tokens it picks are within 0.5 nats of transformers' model with
  the checkpoint's weights decompressed (activations unquantized there: a random model's
  logits are large, so per-token activation rounding moves them this much);
- weight-only schemes (W8A16, W4A16 group-wise) and FP8 with dynamic activations: the weights
  decompressed, token-exact with transformers' decompressed model, logprobs within 1e-3;
- refused by name: FP8 with static activation scales, a GPTQ config, ``--quantization int8`` on
  an already quantized checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine.offline import LLM, GenerationParams
from services.worker.model.attention import ModelRefused
from services.worker.model.checkpoint_quant import load_kwargs, read_scheme
from services.worker.model.packed_linear import FusedHead
from services.worker.model.quantize import Int8Linear, quant_rows_torch
from tests.quantized_models import build_compressed
from tests.tiny_models import build_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [list(range(300 + 7 * i, 330 + 7 * i)) for i in range(4)] + [[5, 6, 7]]
NEW = 8


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("plain") / "llama", "llama-hd64")


def _llm(folder: Path, **kwargs: object) -> LLM:
    return LLM(model=str(folder), dtype="float32", kv_cache_memory=16 << 20, num_threads=1,
               max_num_batched_tokens=16, long_prefill_token_threshold=8, **kwargs)  # type: ignore[arg-type]


def _decompressed(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **load_kwargs(read_scheme("test", qc)))


def _stored(folder: Path, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return f.get_tensor(f"{name}.weight"), f.get_tensor(f"{name}.weight_scale").float().reshape(-1)


def _scheme_output(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 on the stored integers: per-token symmetric int8 activations, int32 products, scaled back."""
    xq, xs = quant_rows_torch(x)
    return (xq.long() @ q.long().t()).double() * xs.double()[:, None] * scale.double()


def test_w8a8_int8_layers_compute_with_the_checkpoints_integers(plain: Path, tmp_path: Path) -> None:
    folder = build_compressed(plain, tmp_path / "w8a8", "W8A8")
    llm = _llm(folder)
    layer = llm.runner.model.model.layers[1]
    x = torch.randn(5, layer.mlp.down_proj.in_features, generator=torch.Generator().manual_seed(3))
    down = layer.mlp.down_proj
    assert isinstance(down, Int8Linear)
    q, s = _stored(folder, "model.layers.1.mlp.down_proj")
    torch.testing.assert_close(down(x).double(), _scheme_output(x, q, s), rtol=1e-5, atol=1e-5)
    qkv = layer.self_attn.q_proj
    assert isinstance(qkv, FusedHead) and isinstance(qkv.fused, Int8Linear)
    parts = [_stored(folder, f"model.layers.1.self_attn.{n}_proj") for n in "qkv"]
    x = torch.randn(4, qkv.fused.in_features, generator=torch.Generator().manual_seed(4))
    want = _scheme_output(x, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    torch.testing.assert_close(qkv.fused(x).double(), want, rtol=1e-5, atol=1e-5)
    # served: the tokens it picks score within 0.5 nats of the decompressed weights' logprobs
    outs = llm.generate(PROMPTS, GenerationParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    ref = _decompressed(folder)
    worst = 0.0
    with torch.no_grad():
        for p, o in zip(PROMPTS, outs, strict=True):
            assert len(o.token_ids) == NEW and o.logprobs is not None
            logp = torch.log_softmax(ref(torch.tensor([p + o.token_ids])).logits[0].float(), -1)
            for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
                worst = max(worst, abs(lp.sampled.logprob - float(logp[len(p) - 1 + j, tok])))
    assert worst <= 0.5, worst


@pytest.mark.parametrize("scheme", ["W8A16", "W4A16", "FP8_DYNAMIC"])
def test_weight_only_and_fp8_schemes_are_exact_on_their_weights(plain: Path, tmp_path: Path, scheme: str) -> None:
    folder = build_compressed(plain, tmp_path / scheme, scheme)
    llm = _llm(folder)
    assert not any(isinstance(m, Int8Linear) for m in llm.runner.model.modules())
    outs = llm.generate(PROMPTS, GenerationParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    ref = _decompressed(folder)
    with torch.no_grad():
        for p, o in zip(PROMPTS, outs, strict=True):
            want = ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
            assert o.token_ids == want
            logp = torch.log_softmax(ref(torch.tensor([p + o.token_ids])).logits[0].float(), -1)
            assert o.logprobs is not None
            for j, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs, strict=True)):
                assert abs(lp.sampled.logprob - float(logp[len(p) - 1 + j, tok])) <= 1e-3


def test_the_weights_are_the_checkpoints_not_the_unquantized_models(plain: Path, tmp_path: Path) -> None:
    """W4A16 moves the weights by a visible amount: ferry serves the quantized ones."""
    from transformers import AutoModelForCausalLM

    folder = build_compressed(plain, tmp_path / "w4", "W4A16")
    ref = _decompressed(folder)
    original = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    w_q = ref.model.layers[0].mlp.down_proj.weight
    w_0 = original.model.layers[0].mlp.down_proj.weight
    assert float((w_q - w_0).abs().max()) > 1e-3
    llm = _llm(folder)
    x = torch.randn(2, w_q.shape[1], generator=torch.Generator().manual_seed(1))
    got = llm.runner.model.model.layers[0].mlp.down_proj(x)
    torch.testing.assert_close(got, x @ w_q.t(), rtol=1e-5, atol=1e-5)


def test_schemes_ferry_cannot_run_are_refused_by_name(plain: Path, tmp_path: Path) -> None:
    folder = build_compressed(plain, tmp_path / "fp8-static", "FP8")
    with pytest.raises(ModelRefused, match=r"LlamaForCausalLM: .*static \(calibrated\) input activation scales"):
        _llm(folder)
    gptq = tmp_path / "gptq"
    build_tiny_model(gptq, "llama")
    config = json.loads((gptq / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (gptq / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelRefused, match="quant_method 'gptq' is not supported"):
        _llm(gptq)
    w8a8 = build_compressed(plain, tmp_path / "w8a8", "W8A8")
    with pytest.raises(ValueError, match="already quantized"):
        _llm(w8a8, quantization="int8")

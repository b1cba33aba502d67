"""A lean decoder forward for Llama-style models on the CPU, once every layer is fused.

transformers' model code is general: each step goes through the model's and each
layer's ``forward`` with their decorators (output capture, kwarg deprecation, config
defaults), a causal-mask builder, keyword dispatch to the attention interface and
module hooks. On a 30-layer model that Python costs ~10 ms per step on this CPU
(torch.profiler, one decode: 30 ms per step of which the ops account for ~20), a third
of a small-batch decode step (docs/benchmarks.md, "Lean forward").

Once ``packed_linear`` and ``fused_ops`` have swapped every layer's pieces (q/k/v in one
packed product, fused RMSNorms, the fused SiLU MLP, the fused rotary embedding), the
step is a short, fixed sequence of calls, and this module runs exactly that sequence:
the same modules and kernels, in the same order, on the same tensors, so its output is
bit-identical to the model's own forward with those swaps (tests/unit/test_lean_forward.py).

Only for the architectures whose decoder layer is the plain pre-norm residual block
(Llama, Mistral, Qwen2), only when every layer was fused, and never with tensor
parallelism; anything else keeps transformers' forward. ``FERRY_CPU_LEAN_FORWARD=0``
turns it off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .attention import StepAttention
from .fused_ops import FusedRMSNorm, FusedSiluMLP
from .packed_linear import FusedHead

log = logging.getLogger("ferry.worker.lean_forward")

MODELS = {"LlamaModel", "MistralModel", "Qwen2Model"}
LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}


def lean_forward_enabled() -> bool:
    return os.environ.get("FERRY_CPU_LEAN_FORWARD", "1").strip().lower() not in ("0", "false", "no", "off")


class LeanDecoder:
    """``body(input_ids, position_ids, ferry_meta=...)``'s last hidden state, without the framework."""

    def __init__(self, body: Any, kernels: Any) -> None:
        self.embed: Any = body.embed_tokens
        self.rotary_emb: Any = body.rotary_emb
        self.norm: Any = body.norm
        self.kernels = kernels
        self.layers: list[tuple[Any, ...]] = []
        for i, layer in enumerate(body.layers):
            attn = layer.self_attn
            head: FusedHead = attn.q_proj
            self.layers.append((i, layer.input_layernorm, head.fused, head.sizes, attn.head_dim, float(attn.scaling),
                                attn.o_proj, layer.post_attention_layernorm, layer.mlp))

    @classmethod
    def build(cls, body: Any, kernels: Any | None) -> LeanDecoder | None:
        """The lean forward for ``body``, or None where it does not apply (see the module doc)."""
        if kernels is None or not lean_forward_enabled() or type(body).__name__ not in MODELS:
            return None
        for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
            if not hasattr(body, name):
                return None
        if not isinstance(body.norm, FusedRMSNorm):
            return None
        for layer in body.layers:
            attn = getattr(layer, "self_attn", None)
            if type(layer).__name__ not in LAYERS or attn is None:
                return None
            head = getattr(attn, "q_proj", None)
            if not (isinstance(head, FusedHead) and len(head.sizes) == 3 and isinstance(attn.head_dim, int)
                    and attn.head_dim % 32 == 0 and isinstance(layer.input_layernorm, FusedRMSNorm)
                    and isinstance(layer.post_attention_layernorm, FusedRMSNorm)
                    and isinstance(layer.mlp, FusedSiluMLP)):
                return None
            if getattr(attn, "sliding_window", None) or getattr(attn, "is_causal", True) is not True:
                return None
        return cls(body, kernels)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention) -> torch.Tensor:
        """[1, T] token ids and positions -> [1, T, hidden], as ``body(...).last_hidden_state``."""
        x = self.embed(input_ids)  # [1, T, hidden]
        cos, sin = self.rotary_emb(x, position_ids=positions)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        tokens = x.shape[1]
        rotary, add_norm = self.kernels.rotary, self.kernels.add_rms_norm
        # Each residual add is fused with the norm that follows it (x + delta, then its
        # RMSNorm, in one pass): the same bfloat16 sum and the same norm kernel as separately.
        h = self.layers[0][1](x)
        delta = None
        for i, norm1, qkv_proj, sizes, head_dim, scale, o_proj, norm2, mlp in self.layers:
            if delta is not None:
                x, h = add_norm(x, delta, norm1.weight, norm1.variance_epsilon)
            q, k, v = torch.split(qkv_proj(h), sizes, dim=-1)
            q, k = rotary(q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim), cos, sin)
            k_cache, v_cache = step.kv_caches[i]
            o = step.backend.forward(i, q, k, v.view(tokens, -1, head_dim), k_cache, v_cache, step.metadata, scale)
            x, h = add_norm(x, o_proj(o.reshape(1, tokens, -1)), norm2.weight, norm2.variance_epsilon)
            delta = mlp(h)
        return add_norm(x, delta, self.norm.weight, self.norm.variance_epsilon)[1]

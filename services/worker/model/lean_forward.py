"""A lean decoder forward for Llama-style models on the CPU.

transformers' model code is general: each step goes through the model's and each
layer's ``forward`` with their decorators (output capture, kwarg deprecation, config
defaults), a causal-mask builder, keyword dispatch to the attention interface and
module hooks. On a 30-layer model that Python costs ~7-10 ms per step on this CPU
(torch.profiler, one decode in bfloat16: 30 ms per step of which the ops account for
~20), a third of a small-batch decode step (docs/benchmarks.md, "A decode step against
memory bandwidth").

This module runs the same step without it, in one of two ways:

- ``plain``: the model's own modules, called as transformers' layer and attention
  code calls them (q/k/v projections, the model code's ``apply_rotary_pos_emb``, the
  attention backend, ``o_proj``, the residual adds, the norms, the MLP), in the same
  order on the same tensors. Any dtype; float32 stays token-exact with transformers.
- ``fused``: when ``packed_linear`` and ``fused_ops`` swapped every layer's pieces
  (bfloat16 on an AVX-512 CPU), one q/k/v product split three ways, the rotary kernel
  called directly, and each residual add fused with the norm after it.

- a step of decodes only, in the fused mode with every projection on the tiled bfloat16
  kernel, runs every layer in one C++ call (``decode_layers``, csrc/decode_layers.cpp):
  the same kernels in the same order, without ~12 Python-to-C++ calls and their glue per
  layer (14-16 % of a decode step's body at 1-8 requests, 5 % at 64; docs/benchmarks.md,
  "A decode step against memory bandwidth"). ``FERRY_CPU_DECODE_LAYERS=0`` keeps the loop.

Either way the hidden states and the keys and values written are bit-identical to the
model's own forward in that state (tests/unit/worker/test_lean_forward.py). Only for the
architectures whose decoder layer is the plain pre-norm residual block (Llama,
Mistral, Qwen2, and Qwen3 with its per-head q/k norms before RoPE: there the q/k/v product
does not apply RoPE in its epilogue and decode steps keep the Python loop), no sliding window, never with tensor
parallelism; anything else keeps transformers' forward. ``FERRY_CPU_LEAN_FORWARD=0``
turns it off.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from services.kernels import ops
from shared import envs

from ..backends.cpu_paged import CpuPagedBackend, CpuPagedMetadata
from .attention import StepAttention
from .fused_ops import FusedRMSNorm, FusedSiluMLP
from .packed_linear import FusedHead, PackedLinear

log = logging.getLogger("ferry.worker.lean_forward")

MODELS = {"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"}
LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}


def lean_forward_enabled() -> bool:
    return envs.CPU_LEAN_FORWARD.get()


def decode_layers_enabled() -> bool:
    """``FERRY_CPU_DECODE_LAYERS=0``: decode steps through the Python layer loop too (A/B runs)."""
    return envs.CPU_DECODE_LAYERS.get()


# The parts of a ``decode_layers`` call its ``times`` counts, in its order (bench_profile's names).
# RoPE types whose cos/sin depend on the position alone (LeanDecoder.cos_sin's table); the
# dynamic ones (dynamic NTK, longrope) change their frequencies with the longest context seen.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
ROPE_TABLE_MIN = 4096

DECODE_LAYER_PARTS = ("rmsnorm", "linear", "rope", "attention")


@dataclass
class DecodeLayerArgs:
    """What ``decode_layers`` takes that is fixed for the model: every layer's tensors in its
    order (input norm, post-attention norm, q/k/v tiles and bias, o_proj's, gate/up's,
    down's), the norms' epsilons (the final norm's last), the attention scales, the head
    shapes, and the most rows every projection's tiled kernel takes (0 with AMX: the AMX
    products from one row); where oneDNN keeps its packed copies beside the tiles
    (``FERRY_CPU_TILED_LINEAR=small`` without AMX, ``FERRY_CPU_AMX_LINEAR=0``), those and
    their biases per layer (q/k/v, o_proj, gate/up, down; then the four biases), which a
    step of more rows takes as ``PackedLinear`` would; else empty."""

    weights: list[torch.Tensor]
    eps: list[float]
    scales: list[float]
    heads: int
    kv_heads: int
    head_dim: int
    rows: int
    packed: list[torch.Tensor] = field(default_factory=list)
    # with AMX, the most rows every projection's AMX products take in the call (its
    # amx_linear_rows bound): a step of up to this many takes them without oneDNN's copies,
    # which the projections on the AMX products for prompt rows too have dropped
    amx_rows: int = 0


class LeanDecoder:
    """``body(input_ids, position_ids, ferry_meta=...)``'s last hidden state, without the framework."""

    def __init__(self, body: Any, kernels: ops.CpuKernels | None, batch_invariant: bool = False) -> None:
        self.embed: Any = body.embed_tokens
        self.rotary_emb: Any = body.rotary_emb
        # cos/sin of every position up to a bound, computed once by rotary_emb itself and read
        # back by row (RoPE types whose frequencies never change with the positions seen).
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rope_static = getattr(self.rotary_emb, "rope_type", None) in STATIC_ROPE_TYPES
        self.norm: Any = body.norm
        self.kernels = kernels
        self.mode = "fused" if kernels is not None else "plain"
        self.layers: list[tuple[Any, ...]] = []
        for i, layer in enumerate(body.layers):
            attn = layer.self_attn
            if kernels is not None:
                projections: Any = (attn.q_proj.fused, attn.q_proj.sizes)
            else:
                projections = (attn.q_proj, attn.k_proj, attn.v_proj)
            # Qwen3: RMSNorms over each head's query and key, after the projection, before RoPE
            qk_norms = (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else None
            self.layers.append((i, layer.input_layernorm, projections, attn.head_dim, float(attn.scaling),
                                attn.o_proj, layer.post_attention_layernorm, layer.mlp,
                                sys.modules[type(attn).__module__], qk_norms))
        # A decode step's layers in one C++ call (csrc/decode_layers.cpp) where every
        # projection is on the tiled bfloat16 kernel.
        self.decode_args: DecodeLayerArgs | None = None
        # The profilers' view into that call: float64 [2, 4] seconds (wall, then process CPU)
        # in its norms, products, rotary embedding and attention, added to; None: not timed.
        self.part_times: torch.Tensor | None = None
        if kernels is not None and decode_layers_enabled() and hasattr(kernels, "decode_layers"):
            self.decode_args = _decode_layer_args(body, kernels)
            if self.decode_args is not None and batch_invariant:
                # --deterministic: a step past the tiled and AMX kernels' rows takes the Python loop,
                # whose products stay on them (PackedLinear.make_batch_invariant), never oneDNN's
                self.decode_args.packed = []

    @classmethod
    def build(cls, body: Any, kernels: ops.CpuKernels | None, batch_invariant: bool = False) -> LeanDecoder | None:
        """The lean forward for ``body`` (fused when every layer is and ``kernels`` are given,
        else plain), or None where it does not apply (see the module doc)."""
        if not lean_forward_enabled() or type(body).__name__ not in MODELS:
            return None
        for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
            if not hasattr(body, name):
                return None
        for layer in body.layers:
            attn = getattr(layer, "self_attn", None)
            if type(layer).__name__ not in LAYERS or attn is None or not isinstance(attn.head_dim, int):
                return None
            if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
                return None
            # Qwen2 keeps its window per layer; Mistral reads its config's at every call
            window = getattr(attn, "sliding_window", getattr(getattr(attn, "config", None), "sliding_window", None))
            if window or getattr(attn, "is_causal", True) is not True:
                return None
            if not hasattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb"):
                return None
        fused = kernels is not None and _all_fused(body)
        return cls(body, kernels if fused else None, batch_invariant)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention) -> torch.Tensor:
        """[1, T] token ids and positions -> [1, T, hidden], as ``body(...).last_hidden_state``."""
        x = self.embed(input_ids)  # [1, T, hidden]
        cos, sin = self.cos_sin(x, positions)
        if self.kernels is None:
            return self._plain(x, cos, sin, step)
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        tokens = x.shape[1]
        one = self.decode_args
        meta, backend = step.metadata, step.backend
        if (one is not None and (tokens <= max(one.rows, one.amx_rows) or one.packed) and isinstance(backend, CpuPagedBackend)
                and isinstance(meta, CpuPagedMetadata) and meta.num_decodes == tokens and meta.fresh_spans is None
                and meta.prefix_spans is None and not meta.chunks.prefills):  # decodes only, no prompt chunk
            out = self.kernels.decode_layers(
                x[0], cos, sin, one.weights, [c for pair in step.kv_caches for c in pair], one.eps, one.scales,
                self.norm.weight, meta.chunks.slot_mapping, meta.block_table, meta.seq_lens, one.heads, one.kv_heads,
                one.head_dim, backend.decode_dot(step.kv_caches[0][0].dtype), one.packed, one.rows, self.part_times)
            return out.unsqueeze(0)
        rotary, add_norm = self.kernels.rotary, self.kernels.add_rms_norm
        # On AMX the q/k/v product applies the rotary embedding in its epilogue (the same bits)
        rope_in_product = (cos.dtype == torch.bfloat16 and hasattr(self.kernels, "amx_rope")
                           and bool(self.kernels.amx_rope(-1)))
        # Each residual add is fused with the norm that follows it (x + delta, then its
        # RMSNorm, in one pass): the same bfloat16 sum and the same norm kernel as separately.
        h = self.layers[0][1](x)
        delta = None
        for i, norm1, (qkv_proj, sizes), head_dim, scale, o_proj, norm2, mlp, _, qk_norms in self.layers:
            if delta is not None:
                x, h = add_norm(x, delta, norm1.weight, norm1.variance_epsilon)
            qkv = (qkv_proj.rope_forward(h, cos, sin, sizes[0] + sizes[1], head_dim)
                   if rope_in_product and qk_norms is None and isinstance(qkv_proj, PackedLinear) else None)
            if qkv is not None:
                q, k, v = torch.split(qkv, sizes, dim=-1)
                q, k = q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim)
            else:
                q, k, v = torch.split(qkv_proj(h), sizes, dim=-1)
                q, k = q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim)
                if qk_norms is not None:  # as the model: the norm over [1, T, heads, head_dim], then RoPE
                    q, k = qk_norms[0](q.unsqueeze(0))[0], qk_norms[1](k.unsqueeze(0))[0]
                q, k = rotary(q, k, cos, sin)
            k_cache, v_cache = step.kv_caches[i]
            o = step.backend.forward(i, q, k, v.view(tokens, -1, head_dim), k_cache, v_cache, step.metadata, scale)
            x, h = add_norm(x, o_proj(o.reshape(1, tokens, -1)), norm2.weight, norm2.variance_epsilon)
            delta = mlp(h)
        assert delta is not None, "a model with no decoder layers"
        return add_norm(x, delta, self.norm.weight, self.norm.variance_epsilon)[1]

    def cos_sin(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rotary_emb(x, position_ids=positions)``: [1, T, head_dim] each, the same bits.

        Computed per step, that is a float32 outer product, a concatenation, cos and sin over
        T x head_dim and two casts: each an OpenMP region of torch's, whose threads then spin
        (GOMP_SPINCOUNT) on the core ferry's own kernel threads want (csrc/pool.h). Where the
        RoPE type is static the rows come from a table of every position up to a bound that
        grows by doubling, filled by rotary_emb itself, so each row is what it returns."""
        if not self.rope_static or positions.dim() != 2 or positions.shape[0] != 1:
            return self.rotary_emb(x, position_ids=positions)
        need = int(positions.max()) + 1 if positions.numel() else 1
        table = self.rope_table
        if table is None or table[0].shape[0] < need or table[0].dtype != x.dtype or table[0].device != x.device:
            size = max(ROPE_TABLE_MIN, 1 << (need - 1).bit_length())
            every = torch.arange(size, device=x.device)[None]
            cos, sin = self.rotary_emb(x[:, :1], position_ids=every)
            table = self.rope_table = (cos[0].contiguous(), sin[0].contiguous())
        flat = positions[0]
        return table[0].index_select(0, flat)[None], table[1].index_select(0, flat)[None]

    def _plain(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepAttention) -> torch.Tensor:
        """The model's modules, called as its layer and attention code call them."""
        tokens = x.shape[1]
        for i, norm1, (q_proj, k_proj, v_proj), head_dim, scale, o_proj, norm2, mlp, code, qk_norms in self.layers:
            h = norm1(x)
            shape = (1, tokens, -1, head_dim)
            q, k = q_proj(h).view(shape), k_proj(h).view(shape)
            if qk_norms is not None:  # Qwen3
                q, k = qk_norms[0](q), qk_norms[1](k)
            q = q.transpose(1, 2)  # [1, heads, T, head_dim], as transformers has them
            k = k.transpose(1, 2)
            v = v_proj(h).view(shape).transpose(1, 2)
            q, k = code.apply_rotary_pos_emb(q, k, cos, sin)  # looked up per call: fused_ops may patch it
            k_cache, v_cache = step.kv_caches[i]
            o = step.backend.forward(i, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                     k_cache, v_cache, step.metadata, scale)
            x = x + o_proj(o.reshape(1, tokens, -1))
            x = x + mlp(norm2(x))
        return self.norm(x)


def _all_fused(body: Any) -> bool:
    if not isinstance(body.norm, FusedRMSNorm):
        return False
    for layer in body.layers:
        attn = layer.self_attn
        head = attn.q_proj
        if not (isinstance(head, FusedHead) and len(head.sizes) == 3 and attn.head_dim % 32 == 0
                and isinstance(layer.input_layernorm, FusedRMSNorm)
                and isinstance(layer.post_attention_layernorm, FusedRMSNorm) and isinstance(layer.mlp, FusedSiluMLP)):
            return False
    return True


def _decode_layer_args(body: Any, kernels: ops.CpuKernels | None = None) -> DecodeLayerArgs | None:
    """``decode_layers``' fixed arguments; None unless every projection and norm is on ferry's
    kernels in bfloat16."""
    from .packed_linear import PackedLinear

    def tiled(m: Any) -> bool:
        return isinstance(m, PackedLinear) and m.tiles is not None and m._tiled is not None

    if not isinstance(body.norm, FusedRMSNorm) or body.norm.weight.dtype != torch.bfloat16:
        return None
    weights: list[torch.Tensor] = []
    eps: list[float] = []
    scales: list[float] = []
    rows = amx = 1 << 62
    packed: list[torch.Tensor] | None = []
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms: tuple[Any, Any] = (layer.input_layernorm, layer.post_attention_layernorm)
        if hasattr(attn, "q_norm"):  # Qwen3's per-head norms: not in the C++ layer loop
            return None
        if not (isinstance(attn.q_proj, FusedHead) and isinstance(mlp, FusedSiluMLP) and mlp._gated is not None
                and all(isinstance(n, FusedRMSNorm) and n.weight.dtype == torch.bfloat16 for n in norms)):
            return None
        products: list[Any] = [attn.q_proj.fused, attn.o_proj, mlp.gate_up, mlp.down_proj]  # as the loop calls them
        if not all(tiled(m) for m in products):
            return None
        rows = min([rows] + [m.tiled_rows for m in products])
        amx = min([amx] + [m.amx_rows if m._amx is not None else 0 for m in products])
        weights += [norms[0].weight, norms[1].weight] + [t for m in products for t in (m.tiles, m._bias32)]
        if packed is not None and all(m.packed is not None for m in products):
            packed += [m.packed for m in products]
            packed += [torch.empty(0) if m.bias is None else m.bias.detach() for m in products]
        else:
            packed = None
        eps += [norms[0].variance_epsilon, norms[1].variance_epsilon]
        scales.append(float(attn.scaling))
    eps.append(body.norm.variance_epsilon)
    attn = body.layers[0].self_attn
    sizes, head_dim = attn.q_proj.sizes, int(attn.head_dim)
    bound = int(kernels.amx_linear_rows()) if amx and kernels is not None and hasattr(kernels, "amx_linear_rows") else 0
    return DecodeLayerArgs(weights, eps, scales, sizes[0] // head_dim, sizes[1] // head_dim, head_dim, rows,
                           packed or [], min(amx, bound))


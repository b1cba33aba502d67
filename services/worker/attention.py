"""ferry's paged attention, plugged into transformers' own model code.

transformers' attention modules compute q/k/v and RoPE, then call the function
registered for ``config._attn_implementation`` with every keyword argument the
model's ``forward`` received. We register ``ferry_paged`` and pass our metadata
explicitly as ``forward(..., ferry_meta=meta)``: no global context.

One forward covers all scheduled tokens of all requests, packed on one
sequence axis (batch dimension 1):

    tokens:  | req A prefill chunk (q=5) | B decode | C decode | D prefill (q=3) |
    slots:   where each token's K/V goes: block_table[pos // bs] * bs + pos % bs

Per layer this function (1) scatters the new keys/values into their slots of
the layer's cache, (2) runs the single-token requests ("decodes") as a few
padded SDPA calls over their gathered blocks (grouped by context length so a
long document does not pad every short chat to its length), grouped-query
style without repeating K/V, and (3) runs each multi-token request ("prefill" chunk) as its own SDPA
call: with no cached prefix it attends to its own fresh K/V with a causal mask;
with a cached prefix (chunked prefill, prefix cache hit) it gathers its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "ferry_paged"


@dataclass
class PrefillSpan:
    """A multi-token chunk of one request: tokens [start, end) of the packed batch."""

    start: int
    end: int
    num_computed: int  # tokens already in the cache before this chunk
    block_ids: torch.Tensor | None  # [num_blocks] covering the context, when num_computed > 0
    mask: torch.Tensor | None  # [q, ctx] bool, True = attend, when num_computed > 0


@dataclass
class DecodeGroup:
    """Single-token requests of similar context length, attended in one padded SDPA call."""

    token_idx: torch.Tensor  # [num_decodes] index in the packed batch
    block_table: torch.Tensor  # [num_decodes, max_blocks] (padded with 0)
    mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * bs] bool, True = attend


@dataclass
class AttentionMetadata:
    """Everything the attention function needs for one step, built once per step."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, bs, kv_heads, head_dim] x2
    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each new token
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    max_model_len: int = 0  # no sequence is longer; a sliding window at least this wide changes nothing


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` ([..., nb]) of ``cache`` as [..., nb * bs, kv_heads, head_dim]."""
    blocks = cache.index_select(0, block_ids.reshape(-1))
    return blocks.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, num_tokens, head_dim]
    key: torch.Tensor,  # [1, kv_heads, num_tokens, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata | None = kwargs.get("ferry_meta")
    if meta is None:
        raise RuntimeError("ferry_paged attention needs ferry_meta=AttentionMetadata in the forward kwargs")
    window = kwargs.get("sliding_window")
    if window is not None and not 0 < meta.max_model_len <= window:
        # The runner caps max_model_len at the window, so every key is always inside it.
        raise NotImplementedError(
            f"a sliding window of {window} tokens narrower than max_model_len {meta.max_model_len} "
            "is not supported by ferry_paged"
        )
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    k_cache, v_cache = meta.kv_caches[layer_idx]
    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    q = query[0].transpose(0, 1)  # [num_tokens, heads, head_dim]
    k_new = key[0].transpose(0, 1)  # [num_tokens, kv_heads, head_dim]
    v_new = value[0].transpose(0, 1)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k_new.to(k_cache.dtype))
    v_flat.index_copy_(0, meta.slot_mapping, v_new.to(v_cache.dtype))

    out = query.new_empty(num_tokens, num_heads, head_dim)
    for dec in meta.decodes:
        num_decodes = dec.token_idx.shape[0]
        # One query token per request; its heads grouped by the KV head they share:
        # [num_decodes, kv_heads, group, head_dim] attends to [num_decodes, kv_heads, ctx, head_dim].
        qd = q.index_select(0, dec.token_idx).view(num_decodes, num_kv_heads, group, head_dim)
        kd = _gather(k_cache, dec.block_table).transpose(1, 2)
        vd = _gather(v_cache, dec.block_table).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd.to(qd.dtype), vd.to(qd.dtype), attn_mask=dec.mask, scale=scaling)
        out.index_copy_(0, dec.token_idx, od.reshape(num_decodes, num_heads, head_dim))
    for span in meta.prefills:
        qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q, head_dim]
        if span.num_computed == 0:
            kp = k_new[span.start : span.end]
            vp = v_new[span.start : span.end]
            mask, causal = None, True
        else:
            assert span.block_ids is not None and span.mask is not None
            ctx = span.num_computed + span.end - span.start
            kp = _gather(k_cache, span.block_ids)[:ctx].to(qp.dtype)
            vp = _gather(v_cache, span.block_ids)[:ctx].to(qp.dtype)
            mask, causal = span.mask, False
        op = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=group > 1,
        )
        out[span.start : span.end] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None  # [1, num_tokens, heads, head_dim], like eager after its transpose


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The packed causal structure lives in AttentionMetadata, not in a dense mask."""
    return None


def register_paged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)

"""ferry's paged attention, plugged into transformers' own model code.

transformers' attention modules compute q/k/v and RoPE, then call the function
registered for ``config._attn_implementation`` with every keyword argument the
model's ``forward`` received. We register ``ferry_paged`` and pass the step's
attention explicitly as ``forward(..., ferry_meta=StepAttention(...))``: no global
context. This function is only the adapter: it reshapes transformers' tensors and
hands them to the step's ``AttentionBackend`` (see backends/), which writes the new
keys/values into the paged cache and attends.

One forward covers all scheduled tokens of all requests, packed on one
sequence axis (batch dimension 1), decodes first:

    tokens:  | B decode | C decode | req A prefill chunk (q=5) | D prefill (q=3) |
    slots:   where each token's K/V goes: block_table[pos // bs] * bs + pos % bs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..backends import AttentionBackend, PagedBatch
from ..backends.variant import AttentionVariant

ATTN_IMPLEMENTATION = "ferry_paged"

# Keywords transformers' attention modules pass that change what attention computes and that
# ferry's backends do not implement: a model that passes one with a value is refused at load
# (model/probe.py runs one forward there), never served without it.
UNSUPPORTED_KEYWORDS = {
    "alibi": "ALiBi position biases",
    "position_bias": "relative position biases",
    "head_mask": "a head mask",
}
# Keywords that make an attention variant, which every backend honours (backends/variant.py).
VARIANT_KEYWORDS = frozenset({"softcap", "s_aux", "sinks", "sliding_window"})
# Keywords that carry nothing for ferry's paged attention (or that it honours: ferry_meta and
# the variants); any other keyword with a value is refused the same way.
IGNORED_KEYWORDS = frozenset({
    "ferry_meta", "position_ids", "cache_position", "use_cache", "past_key_values",
    "past_key_value", "output_attentions", "is_causal", "position_embeddings", "layer_idx",
}) | VARIANT_KEYWORDS


class UnsupportedAttention(NotImplementedError):
    """A model's attention needs a feature ferry's backends do not compute (named in the message)."""


class ModelRefused(ValueError):
    """The model cannot be served exactly; the message names the architecture and why."""


def check_keywords(kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        if value is None or value is False or name in IGNORED_KEYWORDS:
            continue
        if name in UNSUPPORTED_KEYWORDS:
            shown = value if isinstance(value, int | float) else type(value).__name__
            raise UnsupportedAttention(f"its attention uses {UNSUPPORTED_KEYWORDS[name]} ({name}={shown})")
        raise UnsupportedAttention(f"its attention takes the keyword {name}={type(value).__name__}, which ferry "
                                   "does not know")


def attention_variant(kwargs: dict[str, Any], num_heads: int) -> AttentionVariant | None:
    """The variant transformers' keywords ask for (None: plain causal attention)."""
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    window = kwargs.get("sliding_window")
    if softcap is None and sinks is None and window is None:
        return None
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != num_heads):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise UnsupportedAttention(f"its attention sinks ({shape}) are not one per query head ({num_heads})")
    return AttentionVariant(softcap=float(softcap) if softcap is not None else None, sinks=sinks,
                            window=int(window) if window is not None else None)


@dataclass(frozen=True)
class WindowStep:
    """A hybrid KV cache's windowed layers: their own block tables and slots for the step."""

    layers: frozenset[int]
    metadata: Any  # backend.prepare(batch)
    batch: PagedBatch


@dataclass(frozen=True)
class StepAttention:
    """What every layer's attention needs for one step, built once per step."""

    backend: AttentionBackend
    metadata: Any  # backend.prepare(paged_batch)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, bs, kv_heads, head_dim] x2
    max_model_len: int  # no sequence is longer; a sliding window at least this wide changes nothing
    batch: PagedBatch  # the step, for the layers with an attention variant (backends/variant.py)
    window: WindowStep | None = None  # a hybrid KV cache: the windowed layers' tables


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
    step: StepAttention | None = kwargs.get("ferry_meta")
    if step is None:
        raise UnsupportedAttention("its decoder layers do not pass their keyword arguments on to the attention "
                                   "(ferry_meta never reaches it)")
    if dropout:
        raise UnsupportedAttention(f"its attention uses dropout in inference ({dropout})")
    check_keywords(kwargs)
    layer_idx: int = module.layer_idx  # type: ignore[assignment]
    k_cache, v_cache = step.kv_caches[layer_idx]
    batch, metadata = step.batch, step.metadata
    if step.window is not None and layer_idx in step.window.layers:
        batch, metadata = step.window.batch, step.window.metadata
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    variant = attention_variant(kwargs, query.shape[1])
    if variant is not None:
        if variant.window is not None:
            step.backend.layer_windows[layer_idx] = variant.window
        if not variant.plain_for(step.max_model_len):
            step.backend.variant_layers.add(layer_idx)  # decode graphs stay off (cuda/graphs.py)
            if query.is_cuda and torch.cuda.is_current_stream_capturing():
                # a graph would replay this step's plain kernels at any length: never capture it
                raise UnsupportedAttention(f"layer {layer_idx}'s attention variant cannot be captured in a graph")
        if not variant.plain_for(batch.max_seq_len):
            out = step.backend.forward_variant(layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                                               value[0].transpose(0, 1), k_cache, v_cache, batch, scale,
                                               variant)
            return out.unsqueeze(0), None
    out = step.backend.forward(
        layer_idx,
        query[0].transpose(0, 1),  # [num_tokens, heads, head_dim]
        key[0].transpose(0, 1),  # [num_tokens, kv_heads, head_dim]
        value[0].transpose(0, 1),
        k_cache,
        v_cache,
        metadata,
        scale,
    )
    return out.unsqueeze(0), None  # [1, num_tokens, heads, head_dim], like eager after its transpose


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The packed causal structure lives in the step's PagedBatch, not in a dense mask."""
    return None


def register_paged_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)

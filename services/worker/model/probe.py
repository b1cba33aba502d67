"""Exact or refused: one short prompt at load, through ferry's step and through transformers'.

ferry runs a model's own module code with its paged attention plugged in (attention.py), its
own LM-head call (output_head.py) and, on the CPU, its rewritten layers (prepare.py). A model
whose attention needs something the backends do not compute (a soft-cap, sinks, ALiBi), whose
layers do not hand the attention its keyword arguments, whose attention bypasses transformers'
attention interface, or whose logits are post-processed in a way ferry does not repeat, would
otherwise be served with wrong numbers and no warning. So before the worker reports ready it
runs ``PROBE_TOKENS`` tokens through both paths and refuses the model, naming the architecture
and what was found, when:

- the paged attention refuses a keyword (``UnsupportedAttention``: the feature by name), or
  the forward fails outright;
- a layer's attention was never called (or called twice) through the backend;
- the last token's logits differ from transformers' own forward with eager attention by more
  than ``TOLERANCE`` of the logits' range for the dtype (float32: rounding only; half
  precisions: a gross error such as a missing logit scale).

Not run with tensor parallelism (each rank holds a shard; the unsharded model is never built).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from ..backends import AttentionBackend, PagedBatch
from ..backends.build import build_paged_batch
from ..kv_cache import KVCache
from .attention import ATTN_IMPLEMENTATION, ModelRefused, StepAttention, UnsupportedAttention

log = logging.getLogger("ferry.worker.probe")

PROBE_TOKENS = 12
# max |ferry - transformers| over the last token's logits, as a fraction of their range
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1, torch.float16: 0.1}
QUANTIZED_TOLERANCE = 0.25  # --quantization int8 or a float8 KV cache: their own error comes on top


class _Counting(AttentionBackend):
    """A backend that counts its forward calls per layer (the probe's only)."""

    name = "probe"

    def __init__(self, inner: AttentionBackend) -> None:
        self.inner = inner
        self.calls: Counter[int] = Counter()

    def prepare(self, batch: PagedBatch) -> Any:
        return self.inner.prepare(batch)

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,  # type: ignore[override]
                k_cache: torch.Tensor, v_cache: torch.Tensor, metadata: Any, scale: float) -> torch.Tensor:
        self.calls[layer_idx] += 1
        return self.inner.forward(layer_idx, query, key, value, k_cache, v_cache, metadata, scale)

    def forward_variant(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch, scale: float,
                        variant: Any) -> torch.Tensor:
        self.calls[layer_idx] += 1
        return self.inner.forward_variant(layer_idx, query, key, value, k_cache, v_cache, batch, scale, variant)

    @property
    def variant_layers(self) -> set[int]:
        return self.inner.variant_layers

    @property
    def layer_windows(self) -> dict[int, int]:
        return self.inner.layer_windows


def scratch_prompt(backend: AttentionBackend, n: int, kv_config: dict[str, Any], kv_dtype: torch.dtype,
                   block_size: int, max_model_len: int, device: torch.device,
                   ) -> tuple[StepAttention, torch.Tensor, KVCache]:
    """One fresh prompt of ``n`` tokens as a step over a cache of its own (the step, its
    positions [1, n], the cache): the probe's, and the GPU's activation profile (runner.py)."""
    blocks = -(-n // block_size)
    scratch = KVCache.allocate(kv_config, blocks, block_size, kv_dtype, str(device))
    batch, positions = build_paged_batch([n], [n], [list(range(blocks))], block_size, max_model_len, device)
    step = StepAttention(backend, backend.prepare(batch), scratch.caches, max_model_len, batch)
    return step, torch.from_numpy(positions).to(device).unsqueeze(0), scratch


def probe_ids(vocab_size: int, n: int = PROBE_TOKENS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    low = min(10, vocab_size - 1)
    return torch.randint(low, vocab_size, (1, n), generator=gen)


def check_model(model: nn.Module, forward: Any, lm_head: nn.Module, backend: AttentionBackend,
                kv_config: dict[str, Any], kv_dtype: torch.dtype, block_size: int, max_model_len: int,
                device: torch.device, dtype: torch.dtype, quantized: bool) -> float:
    """Run the probe (see the module doc); returns the measured difference, raises ModelRefused.

    ``forward(input_ids, positions, step)`` is the runner's step forward (the lean forward or the
    model body), returning the last hidden states [1, T, hidden]."""
    arch = ",".join(getattr(model.config, "architectures", None) or [type(model).__name__])
    vocab = int(getattr(model.config, "vocab_size", 0) or getattr(lm_head, "out_features", 0) or 2)
    n = min(PROBE_TOKENS, max_model_len)
    ids = probe_ids(vocab, n).to(device)
    counting = _Counting(backend)
    step, pos, scratch = scratch_prompt(counting, n, kv_config, kv_dtype, block_size, max_model_len, device)
    try:
        with torch.inference_mode():
            hidden = forward(ids, pos, step)
            ours = lm_head(hidden[0, -1:]).float()[0]
    except UnsupportedAttention as exc:
        raise ModelRefused(f"{arch}: ferry cannot serve this model exactly: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any failure here would fail every request
        raise ModelRefused(f"{arch}: ferry's forward fails on this model ({type(exc).__name__}: {exc})") from exc
    layers = len(scratch.caches)
    wrong = sorted(i for i in range(layers) if counting.calls[i] != 1)
    if wrong:
        raise ModelRefused(f"{arch}: ferry cannot serve this model exactly: the attention of layers {wrong[:8]} "
                           "does not go through transformers' attention interface once per step "
                           f"(calls per layer: {dict(sorted(counting.calls.items()))})")
    theirs = _transformers_logits(model, ids)
    spread = float(theirs.max() - theirs.min()) or 1.0
    diff = float((ours - theirs).abs().max()) / spread
    limit = QUANTIZED_TOLERANCE if quantized else TOLERANCE.get(dtype, 0.1)
    if not diff <= limit:  # NaN refuses too
        raise ModelRefused(f"{arch}: ferry's logits differ from transformers' own forward on this model by "
                           f"{diff:.3g} of their range (limit {limit}): it computes something ferry does not "
                           "repeat (a logit transform, an attention variant)")
    log.info("probe: %s matches transformers' own forward (%d tokens, max |diff| %.2g of the logits' range)",
             arch, n, diff)
    return diff


def _transformers_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The last token's logits from the model's own forward with eager attention."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise ModelRefused(f"{type(model).__name__}: cannot switch its attention to transformers' eager one "
                           "for the load-time check")
    setter("eager")
    try:
        with torch.inference_mode():
            return model(input_ids=ids, use_cache=False).logits[0, -1].float()
    finally:
        setter(ATTN_IMPLEMENTATION)

"""Attention variants: what some families compute beyond plain causal softmax attention.

transformers' attention modules pass them to the attention function as keywords
(model/attention.py turns them into an ``AttentionVariant``):

- ``softcap`` (Gemma 2): each score ``s`` becomes ``softcap * tanh(s / softcap)``, before the mask;
- ``s_aux`` / ``sinks`` (gpt-oss): one learned logit per head joins the softmax's denominator and
  carries no value, so a head can attend to "nothing";
- ``sliding_window`` (Mistral, Gemma 2/3, Qwen2 with windows, Cohere 2, gpt-oss): the query at
  position p sees the keys at positions j with ``p - window < j <= p`` (transformers'
  ``sliding_window_overlay``), so ``window`` keys counting its own.

Every backend computes a layer with a variant through ``variant_attention`` here (the backends'
``forward_variant``): its own kernel writes the step's keys and values into the cache, then
this reads them back through each request's block table, from the first block its window can
reach, and applies the variant (products in the model's dtype, the softmax in float32, as
eager attention; a window alone through PyTorch's fused attention with a mask). Plain layers keep their backend's kernels;
a window at least as wide as the step's longest context is plain. Under ``--deterministic``
the reference's ``invariant_attention`` takes the variant instead (one cache block at a time,
the same for a token in any batch).

Keys outside a window are never read: a block that every windowed layer has left behind may
hold anything (the hybrid KV cache hands it to another request: scheduler/ledger.py's
HybridLedger), and a masked score does not mask a NaN in its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .paged import PagedBatch, raw_bytes

# Elements of the float32 score tensor one piece of work may build ([rows, heads, queries, keys]):
# 16 Mi (64 MiB) keeps a long context's scores from taking gigabytes.
SCORE_BUDGET = 1 << 24


@dataclass(frozen=True)
class AttentionVariant:
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap), before the mask
    sinks: torch.Tensor | None = None  # [num_heads]: one logit per head in the softmax's denominator
    window: int | None = None  # the query at p sees keys j with p - window < j <= p

    def __post_init__(self) -> None:
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"an attention soft-cap must be positive, got {self.softcap}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"a sliding window must hold at least one token, got {self.window}")

    def plain_for(self, max_seq_len: int) -> bool:
        """Whether a step whose longest context is ``max_seq_len`` computes plain attention: no
        soft-cap, no sinks, and every key of every query inside the window (the farthest key of
        a context of n tokens is n - 1 positions back, inside a window of n)."""
        return self.softcap is None and self.sinks is None and (self.window is None or self.window >= max_seq_len)


def window_start(position: int, window: int | None) -> int:
    """The first key position the query at ``position`` sees."""
    return 0 if window is None else max(0, position - window + 1)


def variant_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                      scale: float, variant: AttentionVariant) -> torch.Tensor:
    """Every token of the step ([num_tokens, heads, head_dim], packed as ``batch`` says) over its
    request's context in the cache (the step's own keys already written), with ``variant``."""
    num_heads = query.shape[1]
    if variant.sinks is not None and variant.sinks.numel() != num_heads:
        raise ValueError(f"{variant.sinks.numel()} attention sinks for {num_heads} heads")
    out = query.new_empty(query.shape)
    qsl, seq_lens, bs = batch.query_start_loc_cpu, batch.seq_lens_cpu, batch.block_size
    # decodes: padded together, in pieces of similar context length
    order = sorted(range(batch.num_decodes), key=lambda i: seq_lens[i])
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order):
            span = _key_span(seq_lens[order[end]], 1, variant.window, bs)
            if (end - start + 1) * num_heads * span > SCORE_BUDGET:
                break
            end += 1
        rows = order[start:end]
        out[rows] = _attend_rows(query, k_cache, v_cache, batch, rows, scale, variant)
        start = end
    # multi-token chunks: one request at a time, its queries in pieces within the budget
    for i in range(batch.num_decodes, batch.num_reqs):
        first, last = qsl[i], qsl[i + 1]
        ctx = seq_lens[i]
        q_len = last - first
        span = _key_span(ctx, q_len, variant.window, bs)
        piece = max(1, SCORE_BUDGET // max(1, num_heads * span))
        for a in range(0, q_len, piece):
            b = min(q_len, a + piece)
            out[first + a: first + b] = _attend_chunk(query[first + a: first + b], k_cache, v_cache,
                                                      batch.block_table[i], ctx - q_len + a, scale, variant)
    return out


def _key_span(ctx: int, q_len: int, window: int | None, block_size: int) -> int:
    """Keys (whole blocks) a chunk of ``q_len`` queries ending the context of ``ctx`` reads."""
    first = window_start(ctx - q_len, window) // block_size
    return (math.ceil(ctx / block_size) - first) * block_size


def _attend_rows(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedBatch,
                 rows: list[int], scale: float, variant: AttentionVariant) -> torch.Tensor:
    """Decodes ``rows`` (token i is request i), padded to the widest key span among them."""
    bs = batch.block_size
    device = query.device
    ctx = torch.tensor([batch.seq_lens_cpu[i] for i in rows], dtype=torch.int64)
    first_block = torch.tensor([window_start(batch.seq_lens_cpu[i] - 1, variant.window) // bs for i in rows],
                               dtype=torch.int64)
    num_blocks = (ctx + bs - 1) // bs - first_block
    width = int(num_blocks.max())
    cols = first_block.unsqueeze(1) + torch.arange(width).unsqueeze(0)  # [n, width] block indices
    cols = torch.minimum(cols, (first_block + num_blocks - 1).unsqueeze(1))  # padding re-reads a real block
    idx = torch.tensor(rows, dtype=torch.int64)
    ids = batch.block_table.index_select(0, idx.to(device)).long().gather(1, cols.to(device))
    k_pos = (first_block.unsqueeze(1) * bs + torch.arange(width * bs).unsqueeze(0))  # [n, L]
    q_pos = (ctx - 1).unsqueeze(1)
    allowed = k_pos <= q_pos
    if variant.window is not None:
        allowed &= k_pos > q_pos - variant.window
    q = query.index_select(0, idx.to(device))  # [n, H, D]
    keys = _gather_blocks(k_cache, ids)  # [n, L, KV, D]
    vals = _gather_blocks(v_cache, ids)
    return _attend(q.unsqueeze(2), keys, vals, allowed.to(device).unsqueeze(1), scale, variant)[:, :, 0]


def _attend_chunk(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table_row: torch.Tensor,
                  first_pos: int, scale: float, variant: AttentionVariant) -> torch.Tensor:
    """Queries at positions first_pos.. of one request ([q, H, D]) over its cached keys."""
    bs = k_cache.shape[1]
    device = query.device
    q_len = query.shape[0]
    last_pos = first_pos + q_len - 1
    b0 = window_start(first_pos, variant.window) // bs
    b1 = last_pos // bs + 1
    ids = table_row[b0:b1].long().unsqueeze(0)
    k_pos = torch.arange(b0 * bs, b1 * bs, device=device).unsqueeze(0)  # [1, L]
    q_pos = torch.arange(first_pos, last_pos + 1, device=device).unsqueeze(1)  # [q, 1]
    allowed = k_pos <= q_pos
    if variant.window is not None:
        allowed &= k_pos > q_pos - variant.window
    keys = _gather_blocks(k_cache, ids)  # [1, L, KV, D]
    vals = _gather_blocks(v_cache, ids)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
    return _attend(q, keys, vals, allowed.unsqueeze(0), scale, variant)[0].transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``ids`` ([n, nb]) as [n, nb * bs, kv_heads, head_dim] (float8 read as bytes, then widened)."""
    raw = cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache
    blocks = raw.index_select(0, ids.reshape(-1)).view(cache.dtype)
    return blocks.view(ids.shape[0], -1, cache.shape[2], cache.shape[3])


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, allowed: torch.Tensor, scale: float,
            variant: AttentionVariant) -> torch.Tensor:
    """q [n, H, Q, D] over keys/vals [n, L, KV, D]; ``allowed`` [n, Q, L] (True: attend).

    As transformers' eager attention: scores, soft-cap, mask, softmax over the scores and the
    sink (in float32), the weighted values; the products in the query's dtype. Only the request's
    own blocks are gathered (from its window's first block on); the slots of its last block past
    the context hold finite leftovers (blocks are zeroed when the cache is made), which weigh 0."""
    n, num_heads, q_len, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    dtype = q.dtype  # the products in the model's dtype, the softmax in float32, as eager attention
    if variant.softcap is None and variant.sinks is None:
        # a window alone: PyTorch's fused attention with the mask (0.66x the time of the steps below for
        # 64 decodes, 0.30x for ten 200-token prompts; docs/worker.md, "Attention variants")
        return F.scaled_dot_product_attention(q, keys.to(dtype).transpose(1, 2), vals.to(dtype).transpose(1, 2),
                                              attn_mask=allowed.unsqueeze(1), scale=scale, enable_gqa=group > 1)
    # a KV head's query heads and queries as the rows of one product (no broadcast over the group:
    # a broadcast batched matmul of one-row products ran 4x slower)
    qf = q.reshape(n, num_kv_heads, group * q_len, head_dim)
    kf = keys.to(dtype).permute(0, 2, 3, 1)  # [n, KV, D, L]
    vf = vals.to(dtype).permute(0, 2, 1, 3)  # [n, KV, L, D]
    scores = torch.matmul(qf, kf).float().mul_(scale).view(n, num_kv_heads, group, q_len, -1)
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if variant.sinks is not None:
        sink = variant.sinks.float().view(1, num_kv_heads, group, 1, 1).expand(n, -1, -1, q_len, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.to(dtype).reshape(n, num_kv_heads, group * q_len, -1), vf)  # [n, KV, G*Q, D]
    return out.view(n, num_heads, q_len, head_dim)


def invariant_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                        variant: AttentionVariant | None = None) -> torch.Tensor:
    """Each query token ([n, heads, head_dim]) over its own context (``seq_lens`` keys through its
    ``block_table`` row), by an online softmax in float32 one cache block at a time, in order.

    Every reduction has a fixed length (the head size for the scores, the block for the max,
    the sum and the weighted values), and a block past a token's context adds exact zeros
    (its scores are -inf, so its weights are 0 and the running max and sum stay as they are),
    so a token's output is the same bits however many other tokens, of whatever contexts, are
    computed with it. With a ``variant``: scores soft-capped, a token's blocks walked from the
    first one its window reaches (which holds a key it sees, so its running max is finite from
    the first block on), and the sinks added to the denominator at the end."""
    n, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    device = query.device
    window = variant.window if variant is not None else None
    softcap = variant.softcap if variant is not None else None
    q = query.float().view(n, num_kv_heads, group, 1, head_dim)
    m = torch.full((n, num_kv_heads, group), float("-inf"), device=device)
    denom = torch.zeros((n, num_kv_heads, group), device=device)
    acc = torch.zeros((n, num_kv_heads, group, head_dim), device=device)
    offsets = torch.arange(block_size, device=device)
    seq_lens = seq_lens.long()
    start = (seq_lens - window).clamp(min=0) if window is not None else torch.zeros_like(seq_lens)
    first_block = start // block_size
    last_col = block_table.shape[1] - 1
    for j in range(block_table.shape[1]):
        cols = first_block + j
        k_pos = (cols * block_size).unsqueeze(1) + offsets.unsqueeze(0)  # [n, bs]
        valid = (k_pos < seq_lens.unsqueeze(1)) & (k_pos >= start.unsqueeze(1))
        if not bool(valid.any()):
            break
        ids = block_table.gather(1, cols.clamp(max=last_col).unsqueeze(1)).squeeze(1)
        keys = raw_bytes(k_cache).index_select(0, ids).view(k_cache.dtype).float()  # [n, bs, kv, d]
        vals = raw_bytes(v_cache).index_select(0, ids).view(v_cache.dtype).float()
        keys = keys.permute(0, 2, 1, 3).unsqueeze(2)  # [n, kv, 1, bs, d]
        vals = torch.where(valid[:, :, None, None], vals, 0.0).permute(0, 2, 1, 3).unsqueeze(2)
        scores = (q * keys).sum(-1) * scale  # [n, kv, g, bs]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        alpha = torch.exp(m - m_new)  # 0 on a token's first block, 1 past its context
        p = torch.exp(scores - m_new.unsqueeze(-1))
        denom = denom * alpha + p.sum(-1)
        acc = acc * alpha.unsqueeze(-1) + (p.unsqueeze(-1) * vals).sum(-2)
        m = m_new
    if variant is not None and variant.sinks is not None:
        denom = denom + torch.exp(variant.sinks.float().view(1, num_kv_heads, group) - m)
    return (acc / denom.unsqueeze(-1)).view(n, num_heads, head_dim).to(query.dtype)

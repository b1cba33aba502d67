"""Triton kernels for paged attention: the KV write, split-K decode, and varlen prefill.

All three read and write the paged cache in place, in ferry's layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, and never gather
blocks into a contiguous copy. They run on CUDA, and on CPU tensors under
``TRITON_INTERPRET=1`` (how the unit tests check them against the reference).

Decode (one query token per request), grid ``(num_decodes, num_kv_heads, num_splits)``:
one program owns one KV head and *all* the query heads that share it (GQA/MQA
without repeating K/V: the group is the M dimension of the dot, padded to 16),
and one contiguous slice of the request's blocks. With few requests and long
contexts the context is split so that every SM has work; each split leaves an
unnormalised partial output plus its running max and sum, and a small reduce
kernel combines them (log-sum-exp). With one split the kernel writes the output
directly.

    request r, seq_len 200, TILE_N 64 (4 pages of 16) -> tiles 0..3, num_splits 2:
    split 0: tiles 0,1 (tokens 0..127)    split 1: tiles 2,3 (tokens 128..199)

Prefill (multi-token chunks, with or without a cached prefix), grid
``(num_chunks, num_heads, cdiv(max_query_len, BLOCK_M))``: a tile of BLOCK_M
query rows of one request and one head walks the request's key tiles up to the
tile's last position, causally masked; the cached prefix and the chunk's own
keys are read the same way, from the cache (the KV write runs first).

Softmax runs in base 2 (``exp2``, the scale pre-multiplied by log2 e) with a
finite "minus infinity" so that rows which have seen no key yet never make NaN;
every real row sees key 0 in its first tile, so the sentinel never leaks.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# A finite -inf: exp2(NEG - m) is 0 for any real m, and NEG - NEG is 0, not NaN. A constexpr,
# because compiled kernels may read no other global (the interpreter does not check this).
NEG = tl.constexpr(-1.0e30)
MIN_DOT = 16  # tl.dot wants every dimension >= 16
# Keys per inner-loop step: several pages at once (each key looks up its own page), so a
# step moves enough bytes to keep loads in flight and the dots are not 16 wide.
TILE_N = 64


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 models are the exactness reference: no TF32 rounding inside attention.
    return "ieee" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------- KV write
@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    h = tl.arange(0, KV_PAD)
    d = tl.arange(0, HEAD_PAD)
    # slot < 0 is padding (a CUDA-graph bucket's unused rows): nothing is written.
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    k = tl.load(key_ptr + tok * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    kc = k_cache_ptr + blk * stride_kc_block + off * stride_kc_tok + h[:, None] * stride_kc_head + d[None, :]
    vc = v_cache_ptr + blk * stride_vc_block + off * stride_vc_tok + h[:, None] * stride_vc_head + d[None, :]
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    """One launch per layer writes every new token's K and V into its slot."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, KV_PAD=_pow2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )


# --------------------------------------------------------------------------- decode
@triton.jit
def _decode_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr,
    scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_bt,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)  # decodes come first: request i is token i
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    b_start = split * per_split
    b_end = tl.minimum(b_start + per_split, num_tiles)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    t = tl.arange(0, TILE_N)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + req * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    m = tl.full([GROUP_PAD], NEG, tl.float32)
    l_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    for b in range(b_start, b_end):
        # A tile of TILE_N keys spans TILE_N // BLOCK_SIZE pages: each key finds its page.
        pos = b * TILE_N + t
        valid = pos < seq_len
        blk = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + (blk * stride_kc_block + off * stride_kc_tok)[:, None] + kvh * stride_kc_head
                    + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, TILE_N]
        s = tl.where(valid[None, :], s, NEG)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + (blk * stride_vc_block + off * stride_vc_tok)[:, None] + kvh * stride_vc_head
                    + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if NUM_SPLITS == 1:
        o = acc / l_sum[:, None]
        tl.store(out_ptr + req * stride_o_tok + heads[:, None] * stride_o_head + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # partials: acc [num_decodes, NUM_HEADS, NUM_SPLITS, HEAD_PAD], (m, l) [..., NUM_SPLITS, 2]
        row = (req * NUM_HEADS + heads) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(part_acc_ptr + row[:, None] * HEAD_PAD + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_sum, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr, stride_o_tok, stride_o_head,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    s_mask = s < NUM_SPLITS
    row = (req * NUM_HEADS + head) * NUM_SPLITS + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=NEG)
    l_sum = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_PAD + d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # empty splits have l = 0 and acc = 0: they weigh nothing
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_sum * w, 0)
    tl.store(out_ptr + req * stride_o_tok + head * stride_o_head + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def decode_partials(num_decodes: int, num_heads: int, num_splits: int, head_dim: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for split-K decode: allocated once per step and shared by every layer."""
    n = max(num_decodes, 1) * num_heads * max(num_splits, 1)
    return (torch.empty(n * _pow2(head_dim), dtype=torch.float32, device=device),
            torch.empty(n * 2, dtype=torch.float32, device=device))


def decode_attention(
    out: torch.Tensor,  # [>= num_decodes, num_heads, head_dim], rows 0..num_decodes-1 written
    query: torch.Tensor,  # [>= num_decodes, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= num_decodes, max_blocks] int32
    seq_lens: torch.Tensor,  # [>= num_decodes] int32, context length including this token
    num_decodes: int,
    scale: float,
    num_splits: int,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    tile_n: int = TILE_N,
) -> None:
    if num_decodes == 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    if num_splits > 1 and partials is None:
        partials = decode_partials(num_decodes, num_heads, num_splits, head_dim, query.device)
    part_acc, part_ml = partials if num_splits > 1 and partials is not None else (out, out)
    _decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        out, part_acc, part_ml, query, k_cache, v_cache, block_table, seq_lens,
        scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, GROUP=group, GROUP_PAD=_pow2(group, MIN_DOT),
        HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim, MIN_DOT), BLOCK_SIZE=block_size,
        TILE_N=max(block_size, tile_n), PRECISION=_dot_precision(k_cache.dtype),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_decodes, num_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits),
            HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim, MIN_DOT),
        )


def choose_num_splits(num_decodes: int, num_kv_heads: int, max_seq_len: int, tile: int,
                      num_sms: int, min_tokens_per_split: int = 256, max_splits: int = 16) -> int:
    """Split the context only when requests x KV heads leave SMs idle, and only as far as
    each split keeps at least ``min_tokens_per_split`` keys (the reduce is not free)."""
    programs = max(1, num_decodes * num_kv_heads)
    want = math.ceil(2 * num_sms / programs)
    tiles = math.ceil(max(1, max_seq_len) / tile)
    by_len = math.ceil(max(1, max_seq_len) / min_tokens_per_split)
    return max(1, min(want, by_len, tiles, max_splits))


# --------------------------------------------------------------------------- prefill
@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    first_req, scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
):
    req = tl.program_id(0) + first_req
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kvh = head // GROUP
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_start = seq_len - q_len  # tokens cached before this chunk

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = ctx_start + rows
    d = tl.arange(0, HEAD_PAD)
    t = tl.arange(0, TILE_N)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    q = q.to(k_cache_ptr.dtype.element_ty)

    # Keys this tile can see: positions < min(its last row's position + 1, seq_len); a tile
    # past the chunk's end sees none and stores nothing.
    key_end = tl.minimum(ctx_start + (tile + 1) * BLOCK_M, seq_len)
    key_end = tl.where(tile * BLOCK_M < q_len, key_end, 0)
    m = tl.full([BLOCK_M], NEG, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for b in range(0, tl.cdiv(key_end, TILE_N)):
        k_pos = b * TILE_N + t
        valid = k_pos < seq_len
        blk = tl.load(block_table_ptr + req * stride_bt + k_pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        off = k_pos % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + (blk * stride_kc_block + off * stride_kc_tok)[:, None] + kvh * stride_kc_head
                    + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, TILE_N]
        s = tl.where(valid[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, NEG)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + (blk * stride_vc_block + off * stride_vc_tok)[:, None] + kvh * stride_vc_head
                    + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    o = acc / tl.maximum(l_sum, 1e-30)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_o_tok + head * stride_o_head + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    first_req: int,  # requests first_req.. are the multi-token chunks
    num_reqs: int,
    max_query_len: int,
    scale: float,
    block_m: int = 64,
    tile_n: int = TILE_N,
) -> None:
    num_chunks = num_reqs - first_req
    if num_chunks <= 0:
        return
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // k_cache.shape[2]
    block_m = max(MIN_DOT, min(block_m, _pow2(max_query_len)))
    grid = (num_chunks, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        first_req, scale * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=_pow2(head_dim, MIN_DOT),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, TILE_N=max(k_cache.shape[1], tile_n),
        PRECISION=_dot_precision(k_cache.dtype),
    )

"""The reference backend: ferry's original paged attention, kept as the yardstick.

Every other backend is tested against this one. Per layer it (1) scatters the new
keys/values into their slots of the layer's cache, (2) runs the decodes as a few
padded SDPA calls over their gathered blocks (grouped by context length so a long
document does not pad every short chat to its length), grouped-query style without
repeating K/V, and (3) runs each multi-token chunk as its own SDPA call: with no
cached prefix it attends to its own fresh K/V with a causal mask; with a cached
prefix (chunked prefill, prefix cache hit) it gathers its blocks.

Runs on any device SDPA runs on (cpu, cuda).

Under ``--deterministic`` (``make_batch_invariant``) every token is a decode
(``as_decodes``) and the decodes skip SDPA, whose kernels choose their blocking by the
shapes of the whole call: ``invariant_attention`` walks each token's blocks in order with
an online softmax in float32, one cache block (``block_size`` keys) at a time, every
reduction over a fixed length (the head size, the block), so a token's numbers depend on
its own query and context alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import AttentionBackend, PagedBatch, as_decodes, raw_bytes, register_backend, write_kv
from .variant import invariant_attention


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
class InvariantDecodes:
    """Every token of a batch-invariant step, each a decode (``as_decodes``)."""

    block_table: torch.Tensor  # [num_tokens, max_blocks] int64
    seq_lens: torch.Tensor  # [num_tokens] int64


@dataclass
class ReferenceMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    invariant: InvariantDecodes | None = None


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` ([..., nb]) of ``cache`` as [..., nb * bs, kv_heads, head_dim]."""
    blocks = raw_bytes(cache).index_select(0, block_ids.reshape(-1)).view(cache.dtype)
    return blocks.view(*block_ids.shape[:-1], -1, cache.shape[2], cache.shape[3])


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, batch: PagedBatch) -> ReferenceMetadata:
        meta = ReferenceMetadata(slot_mapping=batch.slot_mapping)
        if self.batch_invariant:
            batch = as_decodes(batch)
            width = -(-max(batch.seq_lens_cpu, default=1) // batch.block_size)
            meta.invariant = InvariantDecodes(batch.block_table[:, :width].long(), batch.seq_lens.long())
            return meta
        if batch.num_decodes:
            self._decode_groups(meta, batch)
        self._prefill_spans(meta, batch)
        return meta

    def _prefill_spans(self, meta: ReferenceMetadata, batch: PagedBatch) -> None:
        qsl, seq_lens, bs = batch.query_start_loc_cpu, batch.seq_lens_cpu, batch.block_size
        for i in range(batch.num_decodes, batch.num_reqs):
            start, end = qsl[i], qsl[i + 1]
            ctx = seq_lens[i]
            num_computed = ctx - (end - start)
            if num_computed == 0:
                meta.prefills.append(PrefillSpan(start, end, 0, None, None))
                continue
            block_ids = batch.block_table[i, : -(-ctx // bs)].long()
            # Query j sits at position num_computed + j and sees keys 0..num_computed + j.
            q_pos = torch.arange(num_computed, ctx, device=self.device).unsqueeze(1)
            mask = torch.arange(ctx, device=self.device).unsqueeze(0) <= q_pos
            meta.prefills.append(PrefillSpan(start, end, num_computed, block_ids, mask))

    def _decode_groups(self, meta: ReferenceMetadata, batch: PagedBatch) -> None:
        """Group decodes by context length (sorted, a new group when padding would exceed ~25%)."""
        ctx_lens = batch.seq_lens_cpu[: batch.num_decodes]
        order = sorted(range(batch.num_decodes), key=lambda i: ctx_lens[i])
        group: list[int] = []
        for i in order:
            # Sorted ascending: padding this group to ctx_lens[i] wastes at most (1 - lo/hi).
            if group and ctx_lens[group[0]] < 0.75 * ctx_lens[i] and ctx_lens[i] > 4 * batch.block_size:
                meta.decodes.append(self._decode_group(batch, group))
                group = []
            group.append(i)
        if group:
            meta.decodes.append(self._decode_group(batch, group))

    def _decode_group(self, batch: PagedBatch, rows: list[int]) -> DecodeGroup:
        bs = batch.block_size
        ctx = torch.tensor([batch.seq_lens_cpu[i] for i in rows], device=self.device)
        max_blocks = -(-int(ctx.max()) // bs)
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)  # decode i is token i
        valid = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0) < ctx.unsqueeze(1)
        return DecodeGroup(
            token_idx=idx,
            block_table=batch.block_table.index_select(0, idx)[:, :max_blocks].long(),
            mask=valid.view(len(rows), 1, 1, -1),
        )

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: ReferenceMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = key.shape[1]
        group = num_heads // num_kv_heads
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping)
        if metadata.invariant is not None:
            inv = metadata.invariant
            return invariant_attention(query, k_cache, v_cache, inv.block_table, inv.seq_lens, scale)
        out = query.new_empty(num_tokens, num_heads, head_dim)
        for dec in metadata.decodes:
            num_decodes = dec.token_idx.shape[0]
            # One query token per request; its heads grouped by the KV head they share:
            # [num_decodes, kv_heads, group, head_dim] attends to [num_decodes, kv_heads, ctx, head_dim].
            qd = query.index_select(0, dec.token_idx).view(num_decodes, num_kv_heads, group, head_dim)
            kd = _gather(k_cache, dec.block_table).transpose(1, 2)
            vd = _gather(v_cache, dec.block_table).transpose(1, 2)
            od = F.scaled_dot_product_attention(qd, kd.to(qd.dtype), vd.to(qd.dtype), attn_mask=dec.mask, scale=scale)
            out.index_copy_(0, dec.token_idx, od.reshape(num_decodes, num_heads, head_dim))
        self._prefills_forward(query, key, value, k_cache, v_cache, metadata.prefills, scale, out)
        return out

    @staticmethod
    def _prefills_forward(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        prefills: list[PrefillSpan], scale: float, out: torch.Tensor,
    ) -> None:
        """Multi-token chunks, one SDPA call each, written into ``out``."""
        group = query.shape[1] // key.shape[1]
        for span in prefills:
            qp = query[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q, head_dim]
            if span.num_computed == 0:
                kp = key[span.start : span.end]
                vp = value[span.start : span.end]
                mask, causal = None, True
            else:
                assert span.block_ids is not None and span.mask is not None
                ctx = span.num_computed + span.end - span.start
                kp = _gather(k_cache, span.block_ids)[:ctx].to(qp.dtype)
                vp = _gather(v_cache, span.block_ids)[:ctx].to(qp.dtype)
                mask, causal = span.mask, False
            op = F.scaled_dot_product_attention(
                qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1,
            )
            out[span.start : span.end] = op[0].transpose(0, 1)


register_backend("reference", ReferenceBackend, ("cpu", "cuda"), auto_rank=100)

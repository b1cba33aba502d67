"""The ``triton`` attention backend: paged attention on CUDA without gathering blocks.

Per step, ``prepare`` picks the decode split count from host-side numbers only
(no device sync) and allocates the split-K scratch once for all layers. Per
layer, ``forward`` launches at most four kernels: the KV write, the decode
kernel (+ its reduce when the context is split), and the prefill kernel for the
multi-token chunks; every kernel writes into one preallocated output.

Registered for ``cuda`` with the best auto rank, so ``--attention-backend auto``
picks it on a GPU. The same kernels run on CPU tensors under ``TRITON_INTERPRET=1``
(tests/unit/worker/test_triton_attention.py), which is how they are checked against
the reference backend without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import AttentionBackend, PagedBatch, as_decodes, register_backend
from .triton_kernels import (
    TILE_N,
    choose_num_splits,
    decode_attention,
    decode_partials,
    prefill_attention,
    write_kv,
)

# Programs the decode kernel aims for per SM when it decides to split the context.
INTERPRETER_NUM_SMS = 4  # small, so CPU tests exercise split-K at tiny shapes


@dataclass
class TritonMetadata:
    num_reqs: int
    num_decodes: int
    max_query_len: int
    num_splits: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64 (-1: padding, not written)
    partials: tuple[torch.Tensor, torch.Tensor] | None  # split-K scratch, shared by all layers
    # The attention output, allocated by the first layer and rewritten by every later one:
    # layer i's output is read by its o_proj before layer i+1's kernels run (one stream).
    out: torch.Tensor | None = None


class TritonBackend(AttentionBackend):
    name = "triton"
    # prepare() reads host-side sizes only and the kernels read lengths, tables and slots
    # from device buffers, so a forward through this backend can be captured in a CUDA graph.
    supports_cuda_graphs = True

    def __init__(self, device: torch.device, num_splits: int | None = None, prefill_block_m: int = 64) -> None:
        self.device = device
        self.fixed_num_splits = num_splits  # tests and graph capture pin it; None: chosen per step
        self.prefill_block_m = prefill_block_m
        self._num_sms = 0  # read on first use, so building the backend never touches the device
        self._head_shape: tuple[int, int, int] | None = None  # (num_heads, num_kv_heads, head_dim)

    @property
    def num_sms(self) -> int:
        if not self._num_sms:
            cuda = self.device.type == "cuda"
            self._num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count if cuda
                             else INTERPRETER_NUM_SMS)
        return self._num_sms

    def set_head_shape(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        """Optional: lets ``prepare`` allocate the split-K scratch before the first layer."""
        self._head_shape = (num_heads, num_kv_heads, head_dim)

    def make_batch_invariant(self) -> None:
        """Every token through the decode kernel (``as_decodes``), its context never split: one
        program walks a token's key tiles in order whatever the batch (the split count would
        follow the number of requests and the longest context)."""
        super().make_batch_invariant()
        self.fixed_num_splits = 1

    def write_new_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        write_kv(key, value, k_cache, v_cache, slot_mapping)

    def prepare(self, batch: PagedBatch) -> TritonMetadata:
        if self.batch_invariant:
            batch = as_decodes(batch)
        if batch.block_size < 16 or batch.block_size & (batch.block_size - 1):
            raise ValueError(f"the triton backend needs a power-of-two block_size >= 16, got {batch.block_size}")
        num_splits = 1
        partials = None
        if batch.num_decodes:
            if self.fixed_num_splits is not None:
                num_splits = self.fixed_num_splits
            elif self._head_shape is not None:
                num_splits = choose_num_splits(batch.num_decodes, self._head_shape[1], batch.max_seq_len,
                                               max(batch.block_size, TILE_N), self.num_sms)
            if num_splits > 1 and self._head_shape is not None:
                num_heads, _, head_dim = self._head_shape
                partials = decode_partials(batch.num_decodes, num_heads, num_splits, head_dim, self.device)
        return TritonMetadata(
            num_reqs=batch.num_reqs,
            num_decodes=batch.num_decodes,
            max_query_len=batch.max_query_len,
            num_splits=num_splits,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=batch.slot_mapping,
            partials=partials,
        )

    def forward(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: Any,
        scale: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta: TritonMetadata = metadata
        if self._head_shape is None:
            self._head_shape = (query.shape[1], key.shape[1], query.shape[2])
        write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        if out is None:
            if meta.out is None or meta.out.shape != query.shape or meta.out.dtype != query.dtype:
                # contiguous, whatever the query's strides: the model reshapes it to [tokens, hidden]
                meta.out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
            out = meta.out
        if meta.num_decodes:
            if meta.num_splits > 1 and meta.partials is None:
                meta.partials = decode_partials(meta.num_decodes, query.shape[1], meta.num_splits,
                                                query.shape[2], query.device)
            decode_attention(out, query, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.num_decodes,
                             scale, meta.num_splits, meta.partials)
        if meta.num_reqs > meta.num_decodes:
            prefill_attention(out, query, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.query_start_loc,
                              meta.num_decodes, meta.num_reqs, meta.max_query_len, scale, self.prefill_block_m)
        return out


def _make(device: torch.device) -> AttentionBackend:
    return TritonBackend(device)


register_backend("triton", _make, ("cuda",), auto_rank=0)

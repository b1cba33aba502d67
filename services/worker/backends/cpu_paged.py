"""``cpu_paged``: decodes read their keys and values in place, by a small C++ loop.

Measured on the common load (docs/benchmarks.md, "Kernels: decode attention"): in the
reference backend a decode step copies every block of every request out of the cache
in every layer (``index_select``) and then runs SDPA over the copy, so the cache is
read twice and written once, and SDPA's kernel is slow on the gathered (strided)
layout. Here the decodes (the first ``num_decodes`` tokens of the step) go through
``csrc/paged_decode.cpp``, which walks each request's block table and reads each key
and value once, accumulating in float32. Multi-token chunks that start a prompt
(no cached prefix) attend to their own keys through ``csrc/prefill_attention.cpp``
(a flash-style causal kernel with tiles sized for prompts of a few hundred tokens,
1.4-1.7x PyTorch's CPU flash kernel there in bfloat16). Chunks with a cached prefix
(chunked prefill's later chunks, prefix-cache hits) go through the same kernels reading
every key and value from the paged cache (``prefill_attention_paged``; a float8 cache's
values widened exactly as they are read); head sizes other than 64 and 128, and float32
prompts under ``FERRY_CPU_FLOAT32_EXACT=1`` take the reference's SDPA path (gathering
their blocks once per layer). A step's new keys and values reach the cache through one
C++ call, which also rounds them to float8 for a float8 cache.

Both kernels come in AVX-512 and AVX2/FMA versions (``kernel_isa()`` says which was
built); a CPU with neither decodes through a plain-loop version and sends prompts to SDPA.
On the AVX2-only Zen 3 EPYC the AVX2 decode kernel (one pass over the context, each cache
row read front to back) took a common-load decode step's attention from ~100 to ~50 ms in
float32. The kernels are built and loaded by ``services.kernels``; without a C++ compiler
the backend is unavailable and ``auto`` falls back to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.kernels import ops
from shared import envs

from ..model.packed_linear import fast_cpu_dtype
from .base import PagedBatch, as_decodes, register_backend
from .reference import PrefillSpan, ReferenceBackend, ReferenceMetadata


@dataclass
class CpuPagedMetadata:
    chunks: ReferenceMetadata  # slot mapping and the multi-token chunks left to SDPA (cached prefix)
    num_decodes: int
    block_table: torch.Tensor  # [num_decodes, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [num_decodes] int32
    fresh_spans: torch.Tensor | None = None  # [S, 2] int64 (start, end): chunks with no cached prefix
    # chunks with a cached prefix, for the paged prompt kernel: [P, 3] int64 (start, end, prefix)
    # and their block-table rows [P, max_blocks] int32 (chunks.prefills has them for SDPA too)
    prefix_spans: torch.Tensor | None = None
    prefix_tables: torch.Tensor | None = None


def prefill_kernel_enabled() -> bool:
    """``FERRY_CPU_PREFILL_KERNEL=0`` sends fresh chunks to SDPA too (for A/B runs)."""
    return envs.CPU_PREFILL_KERNEL.get()


def bf16_dot_enabled() -> bool:
    """``FERRY_CPU_BF16_DOT=0``: bfloat16 attention (prompts and decodes) through float32 FMAs,
    not AVX512-BF16 dot products."""
    return envs.CPU_BF16_DOT.get() is not False


def bf16_decode_through_fma() -> bool:
    """Whether decodes over a bfloat16 cache take float32 FMAs though dot products are allowed.

    On the Xeons with AMX (``amx_bf16``) ``vdpbf16ps`` issues one per two cycles where FMAs
    issue two per cycle (16 multiply-adds a cycle against 32), and the decode kernel, which
    widens each bfloat16 pair in one instruction per element, took 0.95x the time of its dot
    products there reading from memory, 0.83x in cache (docs/benchmarks.md, "Kernels:
    decode attention"). The
    Zen 4 issues ``vdpbf16ps`` at the FMA's rate and keeps them. A float8 cache keeps its dot
    products everywhere (its FMA path converts each byte: 1.7x their time on the Xeon).
    ``FERRY_CPU_BF16_DOT=1`` forces dot products, ``0`` FMAs for everything.
    """
    setting = envs.CPU_BF16_DOT.get()  # None: auto
    return ops.cpu_flag("amx_bf16") if setting is None else not setting


class CpuPagedBackend(ReferenceBackend):
    name = "cpu_paged"

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.kernel = ops.load()
        self.prefill_kernel = prefill_kernel_enabled() and bool(self.kernel.prefill_attention_available())
        self.float32_prefill = fast_cpu_dtype(torch.float32)  # FERRY_CPU_FLOAT32_EXACT=1: float32 prompts to SDPA
        self.bf16_dot = bf16_dot_enabled()
        self.bf16_decode_fma = bf16_decode_through_fma()

    def decode_dot(self, cache_dtype: torch.dtype) -> bool:
        """The decode kernel's ``bf16_dot`` for a cache of this dtype (bf16_decode_through_fma)."""
        return self.bf16_dot and not (self.bf16_decode_fma and cache_dtype == torch.bfloat16)

    def write_new_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        self.kernel.write_kv(key if fp8 else key.to(k_cache.dtype), value if fp8 else value.to(v_cache.dtype),
                             k_cache, v_cache, slot_mapping)

    def prepare(self, batch: PagedBatch) -> CpuPagedMetadata:  # type: ignore[override]
        if self.batch_invariant:  # every token through paged_decode, which sums a token's keys alike in any batch
            batch = as_decodes(batch)
        chunks = ReferenceMetadata(slot_mapping=batch.slot_mapping)
        self._prefill_spans(chunks, batch)
        fresh = None
        if self.prefill_kernel and chunks.prefills:
            spans = [(p.start, p.end) for p in chunks.prefills if p.num_computed == 0]
            if spans:
                fresh = torch.tensor(spans, dtype=torch.int64)
                chunks.prefills = [p for p in chunks.prefills if p.num_computed > 0]
        prefix_spans = prefix_tables = None
        if self.prefill_kernel and chunks.prefills:  # chunks with a cached prefix: the paged prompt kernel
            qsl = batch.query_start_loc_cpu
            rows = [i for i in range(batch.num_decodes, batch.num_reqs) if batch.seq_lens_cpu[i] > qsl[i + 1] - qsl[i]]
            assert len(rows) == len(chunks.prefills)
            prefix_spans = torch.tensor([(p.start, p.end, p.num_computed) for p in chunks.prefills], dtype=torch.int64)
            width = -(-max(batch.seq_lens_cpu[i] for i in rows) // batch.block_size)
            prefix_tables = batch.block_table[rows, :width].contiguous()
        nd = batch.num_decodes
        max_blocks = -(-max(batch.seq_lens_cpu[:nd], default=1) // batch.block_size)
        return CpuPagedMetadata(
            chunks=chunks,
            num_decodes=nd,
            block_table=batch.block_table[:nd, :max_blocks].contiguous(),
            seq_lens=batch.seq_lens[:nd].contiguous(),
            fresh_spans=fresh,
            prefix_spans=prefix_spans,
            prefix_tables=prefix_tables,
        )

    def forward(  # type: ignore[override]
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: CpuPagedMetadata,
        scale: float,
    ) -> torch.Tensor:
        # one C++ call where the reference's write_kv takes two index_copy_ and their views; a
        # float8 cache's rounding (as .to() rounds) happens in that call too
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        self.write_new_kv(key, value, k_cache, v_cache, metadata.chunks.slot_mapping)
        nd = metadata.num_decodes
        # a float8 cache is read with the query in the model's dtype; paged_decode takes a
        # strided query (a view of the q/k/v product) as it is, copying only where it must
        q = query[:nd] if fp8 else query[:nd].to(k_cache.dtype)
        decoded = self.kernel.paged_decode(q, k_cache, v_cache, metadata.block_table, metadata.seq_lens, scale,
                                           self.decode_dot(k_cache.dtype))
        if nd == query.shape[0]:
            return decoded.to(query.dtype)
        out = query.new_empty(query.shape)
        out[:nd] = decoded
        if (metadata.fresh_spans is not None and query.shape[-1] in (64, 128)
                and (query.dtype != torch.float32 or self.float32_prefill)):
            self.kernel.prefill_attention(query, key, value, out, metadata.fresh_spans, scale, self.bf16_dot)
        elif metadata.fresh_spans is not None:  # another head size, or float32 as transformers computes it
            fresh = [PrefillSpan(int(a), int(b), 0, None, None) for a, b in metadata.fresh_spans.tolist()]
            self._prefills_forward(query, key, value, k_cache, v_cache, fresh, scale, out)
        if (metadata.prefix_spans is not None and metadata.prefix_tables is not None and k_cache.dtype in (query.dtype, torch.float8_e4m3fn)
                and query.shape[-1] in (64, 128)
                and (query.dtype != torch.float32 or self.float32_prefill)):
            self.kernel.prefill_attention_paged(query, out, k_cache, v_cache, metadata.prefix_spans,
                                                metadata.prefix_tables, scale, self.bf16_dot)
        else:
            self._prefills_forward(query, key, value, k_cache, v_cache, metadata.chunks.prefills, scale, out)
        return out


# auto on the CPU: the fastest measured there (docs/benchmarks.md, "Kernels: decode attention"); without a compiler auto takes the reference.
register_backend("cpu_paged", CpuPagedBackend, ("cpu",), auto_rank=0)

"""Random paged-attention problems and the reference answer, shared by the CPU
interpreter tests (tests/unit/worker/test_triton_attention.py) and the GPU check
(tests/device/kernels.py).

A case is a list of requests, each ``(num_cached, num_new)``: ``num_cached`` tokens
already in the paged cache, ``num_new`` scheduled this step (1 = a decode).
Blocks are handed out from a shuffled pool so block tables are not contiguous,
and the cache is filled with random values everywhere, so a kernel that reads
a wrong slot or a padded block-table entry gives a wrong answer, not a lucky one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.backends import PagedBatch


@dataclass
class AttentionCase:
    batch: PagedBatch
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    scale: float


def make_case(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    extra_blocks: int = 0,
) -> AttentionCase:
    """Decodes (num_new == 1) must come first, as the runner orders them. ``extra_blocks``
    appends that many allocated-but-empty blocks (full of garbage) to every block table,
    as the scheduler does when it allocates ahead."""
    gen = torch.Generator().manual_seed(seed)  # block layout, on the host
    dev_gen = torch.Generator(device=device).manual_seed(seed)  # values, where they live (GBs on a GPU)
    num_decodes = 0
    for i, (_, n) in enumerate(reqs):
        if n == 1 and i == num_decodes:
            num_decodes += 1
    assert all(n > 1 for _, n in reqs[num_decodes:]), "decodes first"
    seq_lens = [c + n for c, n in reqs]
    blocks_per = [-(-s // block_size) + extra_blocks for s in seq_lens]
    num_blocks = sum(blocks_per) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per)
    table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    slots: list[int] = []
    for i, (cached, new) in enumerate(reqs):
        ids = [pool.pop() for _ in range(blocks_per[i])]
        table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        for p in range(cached, cached + new):
            slots.append(ids[p // block_size] * block_size + p % block_size)
    num_tokens = sum(n for _, n in reqs)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=dev_gen, device=device).to(dtype)

    k_cache, v_cache = rand(*shape), rand(*shape)
    query = rand(num_tokens, num_heads, head_dim)
    key, value = rand(num_tokens, num_kv_heads, head_dim), rand(num_tokens, num_kv_heads, head_dim)
    qsl = [0]
    for _, n in reqs:
        qsl.append(qsl[-1] + n)
    dev = torch.device(device)
    batch = PagedBatch(
        num_reqs=len(reqs),
        num_decodes=num_decodes,
        num_tokens=num_tokens,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_table=table.to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        max_query_len=max(n for _, n in reqs),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        max_model_len=max(seq_lens) + block_size,
        query_start_loc_cpu=tuple(qsl),
        seq_lens_cpu=tuple(seq_lens),
    )
    return AttentionCase(batch, query, key, value, k_cache, v_cache, scale=head_dim**-0.5)


def reference_attention(case: AttentionCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, k_cache, v_cache) from the reference backend, on copies of the case's caches.

    Uses the registered ``reference`` backend when the runner's PagedBatch refactor
    has registered one; otherwise today's ``attention.paged_attention`` directly.
    """
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    from services.worker import backends

    if "reference" in backends.available_backends(case.query.device.type):
        ref = backends.select_backend("reference", case.query.device)
        meta = ref.prepare(case.batch)
        out = ref.forward(0, case.query, case.key, case.value, k_cache, v_cache, meta, case.scale)
        return out, k_cache, v_cache
    return _via_paged_attention(case, k_cache, v_cache), k_cache, v_cache


def _via_paged_attention(case: AttentionCase, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    from services.worker.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, paged_attention

    b = case.batch
    dev = case.query.device
    table = b.block_table.long()
    meta = AttentionMetadata(kv_caches=[(k_cache, v_cache)], slot_mapping=b.slot_mapping, max_model_len=b.max_model_len)
    seq = list(b.seq_lens_cpu)
    qsl = list(b.query_start_loc_cpu)
    bs = b.block_size
    if b.num_decodes:
        nd = b.num_decodes
        mb = max(-(-s // bs) for s in seq[:nd])
        valid = torch.arange(mb * bs, device=dev)[None, :] < torch.tensor(seq[:nd], device=dev)[:, None]
        meta.decodes.append(DecodeGroup(torch.arange(nd, device=dev), table[:nd, :mb], valid.view(nd, 1, 1, -1)))
    for i in range(b.num_decodes, b.num_reqs):
        start, end = qsl[i], qsl[i + 1]
        cached = seq[i] - (end - start)
        if cached == 0:
            meta.prefills.append(PrefillSpan(start, end, 0, None, None))
            continue
        nb = -(-seq[i] // bs)
        q_pos = torch.arange(cached, seq[i], device=dev).unsqueeze(1)
        mask = torch.arange(seq[i], device=dev).unsqueeze(0) <= q_pos
        meta.prefills.append(PrefillSpan(start, end, cached, table[i, :nb], mask))

    class _Layer(torch.nn.Module):
        layer_idx = 0

    out, _ = paged_attention(
        _Layer(), case.query.transpose(0, 1).unsqueeze(0), case.key.transpose(0, 1).unsqueeze(0),
        case.value.transpose(0, 1).unsqueeze(0), None, scaling=case.scale, ferry_meta=meta,
    )
    return out[0]

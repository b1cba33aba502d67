"""A step's paged attention work (``PagedBatch``) and the plain reads and writes of the paged
KV cache that every backend shares; imported by base.py and variant.py, importing neither."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    """One step's attention work, built once per step by the runner, read by every layer."""

    num_reqs: int
    num_decodes: int  # the first num_decodes requests have query length 1
    num_tokens: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 on the device
    seq_lens: torch.Tensor  # [num_reqs] int32 on the device: context length after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32 on the device, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64 on the device: flat KV slot of each new token
    max_query_len: int
    max_seq_len: int
    block_size: int
    max_model_len: int  # no sequence is longer (sliding windows at least this wide change nothing)
    # Host copies (plain ints) for backends that plan on the CPU, so they never sync the device.
    query_start_loc_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]


def as_decodes(batch: PagedBatch) -> PagedBatch:
    """``batch`` with every query token as a decode of its own: token t of a chunk that starts
    at position p attends as a one-token request of context p + t + 1 over its request's block
    table (its own key is in the cache by then: every backend writes a step's keys and values
    before it attends).

    Batch-invariant attention (``--deterministic``, docs/api.md) computes every token this way,
    so a token's reduction over its keys is the decode kernel's, in the same order, whether it
    is computed in a prompt chunk of any size, after a prefix-cache hit, after a preemption or
    as a decode beside any other requests. A step of decodes only is returned as it is.
    """
    if batch.num_decodes == batch.num_reqs:
        return batch
    qsl = torch.tensor(batch.query_start_loc_cpu, dtype=torch.int64)
    q_lens = qsl[1:] - qsl[:-1]
    rows = torch.repeat_interleave(torch.arange(batch.num_reqs), q_lens)
    first = torch.tensor(batch.seq_lens_cpu, dtype=torch.int64) - q_lens  # each chunk's first position
    lens = first[rows] + torch.arange(len(rows)) - qsl[:-1][rows] + 1
    n = int(rows.numel())
    device = batch.block_table.device
    return PagedBatch(
        num_reqs=n, num_decodes=n, num_tokens=n,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(device, non_blocking=True),
        seq_lens=lens.to(torch.int32).to(device, non_blocking=True),
        block_table=batch.block_table.index_select(0, rows.to(device, non_blocking=True)),
        slot_mapping=batch.slot_mapping, max_query_len=1, max_seq_len=batch.max_seq_len,
        block_size=batch.block_size, max_model_len=batch.max_model_len,
        query_start_loc_cpu=tuple(range(n + 1)), seq_lens_cpu=tuple(lens.tolist()),
    )


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (PyTorch's CPU index ops do not take float8)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys/values ([num_tokens, kv_heads, head_dim]) at their slots
    (a float8 cache saturates at +-448, as PyTorch's conversion does)."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    raw_bytes(k_cache).view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, raw_bytes(key.to(k_cache.dtype)))
    raw_bytes(v_cache).view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, raw_bytes(value.to(v_cache.dtype)))

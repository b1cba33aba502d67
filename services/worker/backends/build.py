"""Building a ``PagedBatch`` from per-request lists: the runner's packing, in one place.

The runner (and the backend tests) describe a step as, per request in batch order
(decodes first), its query length, its context length after the step, and its block
ids. Everything else (token positions, flat KV slots, padded block table, the
query offsets) is derived here with a few vectorized numpy operations, so it is
computed once per step whatever the number of layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import PagedBatch


def build_paged_batch(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    block_size: int,
    max_model_len: int,
    device: torch.device,
) -> tuple[PagedBatch, np.ndarray]:
    """The step's ``PagedBatch`` and each token's position (numpy int64, for RoPE).

    Requests must come decodes first (query length 1), then multi-token chunks.
    """
    num_reqs = len(query_lens)
    q = np.asarray(query_lens, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    num_decodes = 0
    while num_decodes < num_reqs and q[num_decodes] == 1:
        num_decodes += 1
    if num_reqs and (q[num_decodes:] == 1).any():
        raise ValueError("a PagedBatch holds its decodes (query length 1) first")
    qsl = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(q, out=qsl[1:])
    num_tokens = int(qsl[-1])
    blocks_per = -(-s // block_size)
    max_blocks = int(blocks_per.max()) if num_reqs else 0
    table = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int64)
    for i, ids in enumerate(block_ids):
        n = int(blocks_per[i])
        if len(ids) < n:
            raise ValueError(f"request {i} needs {n} blocks for {int(s[i])} tokens but holds {len(ids)}")
        table[i, :n] = ids[:n]
    # Token t of request r sits at position seq_len - query_len + (t - query_start).
    req_of_token = np.repeat(np.arange(num_reqs), q)
    positions = np.arange(num_tokens) - qsl[:-1][req_of_token] + (s - q)[req_of_token]
    slots = table[req_of_token, positions // block_size] * block_size + positions % block_size
    if num_tokens and int(slots.min()) < 0:
        raise ValueError("a new token's KV slot is in a released block")
    # a hybrid cache's windowed layers: blocks their window left behind are -1 (released) and
    # never read (backends/variant.py); block 0 keeps every table entry a valid address
    np.maximum(table, 0, out=table)
    batch = PagedBatch(
        num_reqs=num_reqs,
        num_decodes=num_decodes,
        num_tokens=num_tokens,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(s.astype(np.int32)).to(device),
        block_table=torch.from_numpy(table.astype(np.int32)).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        max_query_len=int(q.max()) if num_reqs else 0,
        max_seq_len=int(s.max()) if num_reqs else 0,
        block_size=block_size,
        max_model_len=max_model_len,
        query_start_loc_cpu=tuple(int(x) for x in qsl),
        seq_lens_cpu=tuple(int(x) for x in s),
    )
    return batch, positions

"""Attention backends: the one seam between the model runner and an attention kernel.

The runner describes each step's attention work once, device-agnostically, as a
``PagedBatch``; a backend turns it into whatever per-step metadata its kernel wants
(``prepare``, once per step) and then, per layer, writes the new keys/values into
the paged cache and attends (``forward``). The model code never sees which backend
runs. Backends register by name; ``select_backend("auto", device)`` picks the
fastest one that is known to be correct on that device.

Every backend is tested against the reference backend (the original per-group SDPA
implementation) on random inputs: GQA and MQA, block boundaries, empty and full
last blocks, chunked prefill with a cached prefix, and mixed batches.

Layout conventions (shared by every backend and the KV cache allocator):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot of token at position p of a request: block_table[p // block_size] * block_size + p % block_size

Requests inside a ``PagedBatch`` are ordered decodes first: the first
``num_decodes`` requests have exactly one query token each, the rest are
multi-token chunks (prefill, chunked prefill, or recompute after preemption):

    tokens: | d0 | d1 | d2 | chunk of r3 (q=5) .... | chunk of r4 (q=3) |
    query_start_loc: [0, 1, 2, 3, 8, 11]
"""

from __future__ import annotations

import importlib.util

import torch

from . import cpu_paged, reference  # noqa: F401 - the built-in backends register themselves on import
from .base import (
    AttentionBackend,
    BackendFactory,
    PagedBatch,
    available_backends,
    register_backend,
    select_backend,
)

__all__ = ["AttentionBackend", "BackendFactory", "PagedBatch", "available_backends", "register_backend",
           "select_backend"]


def _triton(device: torch.device) -> AttentionBackend:
    """The CUDA kernels, imported on first use: Triton ships with PyTorch's CUDA builds (on a CPU
    only as the dev extra, for the tests), and whether its kernels compile or run interpreted is
    decided when they are defined, so nothing may import them before a test switches the
    interpreter on."""
    from .triton_backend import _make

    return _make(device)


if importlib.util.find_spec("triton") is not None:
    register_backend("triton", _triton, ("cuda",), auto_rank=0)

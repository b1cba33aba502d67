"""The physical KV cache: per-layer key and value tensors split into fixed-size blocks.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys
and the same for values. A token at position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``; the flat view
``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed by slot.
Blocks are gathered whole (one contiguous copy of ``block_size`` tokens each),
which is far cheaper on a CPU than gathering token by token.

The block count comes from ``shared.capacity.num_kv_blocks`` so the capacity
planner and the worker can never disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shared.capacity import kv_bytes_per_token, kv_shape_from_config, num_kv_blocks

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                                        torch.float8_e4m3fn: "fp8"}
FP8 = torch.float8_e4m3fn


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: 'auto' keeps the model's dtype; 'fp8' (also 'fp8_e4m3') is float8 e4m3."""
    name = kv_cache_dtype.strip().lower()
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        return FP8
    raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected 'auto' or 'fp8'")


def kv_dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def num_blocks_for_budget(budget_bytes: int, config: Mapping[str, Any], dtype: torch.dtype, block_size: int) -> int:
    """Blocks that fit ``budget_bytes``: the shared formula, nothing else."""
    return num_kv_blocks(budget_bytes, config, kv_dtype_name(dtype), block_size)


@dataclass
class KVCache:
    caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values)
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls, config: Mapping[str, Any], num_blocks: int, block_size: int, dtype: torch.dtype, device: str,
        layer_blocks: list[int] | None = None,
    ) -> KVCache:
        """``layer_blocks``: each layer's own block count (a hybrid cache: shared.capacity.HybridKV)."""
        num_layers, num_kv_heads, head_dim = kv_shape_from_config(config)
        counts = layer_blocks or [num_blocks] * num_layers
        # zeros, not empty: padded gathers read block 0 and masked garbage could be NaN.
        # Written in full here (committed at start-up): a lazily committed cache (calloc'ed
        # pages) took a page fault per 4 KiB on first write, which cost ~5 % of throughput
        # on the common load (docs/benchmarks.md, "Step buffers and page faults") for little resident
        # memory saved once the cache has cycled.
        caches = [
            (torch.zeros((n, block_size, num_kv_heads, head_dim), dtype=dtype, device=device),
             torch.zeros((n, block_size, num_kv_heads, head_dim), dtype=dtype, device=device))
            for n in counts
        ]
        return cls(caches, num_blocks, block_size)

    @staticmethod
    def bytes_for(config: Mapping[str, Any], num_blocks: int, block_size: int, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(config, kv_dtype_name(dtype)) * block_size * num_blocks

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.caches)


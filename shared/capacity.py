"""KV-cache arithmetic shared by the worker (sizing its cache at start-up) and
``ferry plan`` (sizing a deployment), so the two can never disagree.

(Extended by the capacity-planning work; the functions below are the contract.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "float8_e4m3fn": 1}


def kv_shape_from_config(config: Mapping[str, Any]) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from an HF config dict."""
    num_layers = int(config["num_hidden_layers"])
    num_heads = int(config["num_attention_heads"])
    num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
    return num_layers, num_kv_heads, head_dim


def kv_bytes_per_token(config: Mapping[str, Any], kv_dtype: str) -> int:
    """Keys and values of one token across every layer."""
    num_layers, num_kv_heads, head_dim = kv_shape_from_config(config)
    return 2 * num_layers * num_kv_heads * head_dim * DTYPE_BYTES[kv_dtype]


def num_kv_blocks(kv_budget_bytes: int, config: Mapping[str, Any], kv_dtype: str, block_size: int) -> int:
    """How many KV blocks of ``block_size`` tokens fit in ``kv_budget_bytes``."""
    block_bytes = kv_bytes_per_token(config, kv_dtype) * block_size
    return max(0, kv_budget_bytes // block_bytes)
